"""Opening the catalog: short connections to a DuckDB file (waiting for another process's lock)
or to a PostgreSQL database that many machines share, attached through DuckDB's postgres
extension so that every statement is the same DuckDB SQL on both."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from contextlib import contextmanager
from functools import lru_cache
from importlib import metadata, resources
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import duckdb

from mergepipe.config.environment import CatalogLocation, parse_catalog
from mergepipe.errors import MergepipeError

# The lock-wait note goes to this logger; the CLI shows it on stderr.
log = logging.getLogger("mergepipe.catalog")
T = TypeVar("T")


def lock_timeout() -> float:
    """Seconds a writer waits for another process's lock on the catalog file."""
    return float(os.environ.get("MERGEPIPE_CATALOG_LOCK_TIMEOUT", "120"))


SCHEMA_VERSION = "4"
# Upgrades from each earlier version (applied in order, each in the schema check's transaction).
MIGRATIONS = {"1": "migrate_1_to_2.sql", "2": "migrate_2_to_3.sql", "3": "migrate_3_to_4.sql"}


@contextmanager
def transaction(con: duckdb.DuckDBPyConnection, **tables) -> Iterator[duckdb.DuckDBPyConnection]:
    """BEGIN … COMMIT (ROLLBACK on any error), with Arrow tables registered as views for the
    duration, so bulk inserts read them by name."""
    for name, table in tables.items():
        con.register(name, table)
    con.execute("BEGIN")
    try:
        yield con
        con.execute("COMMIT")
    except BaseException:
        _roll_back(con)
        raise
    finally:
        for name in tables:
            con.unregister(name)


def _roll_back(con: duckdb.DuckDBPyConnection) -> None:
    """ROLLBACK, unless the failure was the COMMIT itself (PostgreSQL refusing a serializable
    transaction at its end): that ended the transaction already, and the caller's error stands."""
    try:
        con.execute("ROLLBACK")
    except duckdb.TransactionException:
        pass


def write(con: duckdb.DuckDBPyConnection, body: Callable[[], T], **tables) -> T:
    """body() in one transaction. On a shared catalog another client may commit the same keys
    between our reads and our commit (INSERT OR IGNORE is checked here, not by PostgreSQL's
    ON CONFLICT); PostgreSQL then refuses ours whole, and the rerun sees their rows."""
    for attempt in range(WRITE_ATTEMPTS):
        try:
            with transaction(con, **tables):
                return body()
        except duckdb.Error as err:
            if attempt == WRITE_ATTEMPTS - 1 or not _lost_race(err):
                raise
            log.debug("catalog write lost a race with another client (%s); again", err)
            time.sleep(0.05 * (attempt + 1) * (1 + random.random()))
    raise AssertionError("unreachable")


WRITE_ATTEMPTS = 8


def _lost_race(err: Exception) -> bool:
    """PostgreSQL's words for a write that another transaction's commit made invalid (DuckDB's
    own file catalog has one writer at a time and never says them)."""
    text = str(err)
    return "duplicate key value violates unique constraint" in text or "could not serialize access" in text


def sql_text(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text()


def _is_lock_error(err: Exception) -> bool:
    text = str(err)
    return "lock" in text.lower() and ("Could not set lock" in text or "Conflicting lock" in text)


def as_location(where: CatalogLocation | str | Path) -> CatalogLocation:
    return where if isinstance(where, CatalogLocation) else parse_catalog(where)


@contextmanager
def connect(
    where: CatalogLocation | str | Path, *, read_only: bool = False, timeout: float | None = None
) -> Iterator[duckdb.DuckDBPyConnection]:
    """A connection held only for the duration of the block, to either kind of catalog; its
    tables are the default schema, so statements name them bare."""
    location = as_location(where)
    con = _open_shared(location, read_only) if location.shared else _open_file(location.path, read_only, timeout)
    try:
        if not read_only:
            _ensure_schema(con, location)
        if location.shared:
            con.execute(sql_text("views.sql").replace("CREATE OR REPLACE VIEW", "CREATE OR REPLACE TEMP VIEW"))
        yield con
    finally:
        con.close()


def _open_file(path: Path, read_only: bool, timeout: float | None) -> duckdb.DuckDBPyConnection:
    """DuckDB lets one process at a time open a file for writing and fails at once otherwise;
    we retry with jittered backoff until `timeout`, then say who holds the lock."""
    timeout = lock_timeout() if timeout is None else timeout
    if read_only and not path.exists():
        raise MergepipeError(f"{path}: no catalog yet (run `mergepipe index` first)")
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    delay, told = 0.05, False
    while True:
        try:
            return duckdb.connect(str(path), read_only=read_only, config={"memory_limit": "4GB"})
        except duckdb.IOException as err:
            if not _is_lock_error(err):
                raise
            waited = time.monotonic() - started
            if waited > timeout:
                raise MergepipeError(
                    f"{path}: catalog still locked by another process after {timeout:g} s "
                    f"(MERGEPIPE_CATALOG_LOCK_TIMEOUT); {err}"
                ) from None
            if waited > 1 and not told:
                log.warning("%s: catalog locked by another process; waiting up to %g s", path, timeout)
                told = True
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 1.0)


def _open_shared(location: CatalogLocation, read_only: bool) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with the PostgreSQL database attached as `catalog` and in use.
    PostgreSQL lets many writers work at once: its keys and serializable isolation refuse a
    write that conflicts with another client's, and write() runs it again. DuckDB's temporary
    tables (the planner's) stay in this process."""
    con = duckdb.connect(config={"memory_limit": "4GB"})
    try:
        load_extension(con, "postgres")
        # Serializable: a write that read what another client's concurrent write changed (such
        # as the names models hold) fails at commit, and write() runs it again.
        options = "TYPE postgres, READ_ONLY" if read_only else "TYPE postgres, ISOLATION_LEVEL 'SERIALIZABLE'"
        url = location.connection_url().replace("'", "''")  # ATTACH takes no parameters: a quoted literal
        con.execute(f"ATTACH '{url}' AS catalog ({options})")
        con.execute("USE catalog")
    except duckdb.Error as err:
        con.close()
        # The error text may quote the connection string: say it again without the password.
        text = str(err).replace(location.password, "***") if location.password else str(err)
        raise MergepipeError(f"{location}: cannot open the shared catalog: {text}") from None
    return con


# The extensions a shared catalog needs, by DuckDB's name for them and the PyPI wheel that
# carries a build of them (duckdb-extension-<name>, made for one DuckDB version).
EXTENSION_WHEELS = {"postgres": "duckdb_extension_postgres"}


def wheel_extension(name: str) -> Path | None:
    """The extension file of an installed duckdb-extension-<name> wheel built for this DuckDB,
    or None (no such wheel, or one for another version)."""
    module = EXTENSION_WHEELS[name]
    try:
        version = metadata.version(module.replace("_", "-"))
        root = resources.files(module)
    except (metadata.PackageNotFoundError, ModuleNotFoundError):
        return None
    if version != duckdb.__version__:
        return None
    path = Path(str(root)) / "extensions" / f"v{version}" / f"{name}.duckdb_extension"
    return path if path.is_file() else None


def load_extension(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """LOAD an extension. From its wheel where one matches this DuckDB (DuckDB's extension
    repository may be out of reach); installing the wheel's file into DuckDB's extension
    folder gives it the name DuckDB loads it by (postgres is postgres_scanner). Otherwise
    DuckDB's normal INSTALL from its repository."""
    try:
        con.execute(f"LOAD {name}")
        return
    except duckdb.Error:
        pass
    path = wheel_extension(name)
    con.execute(f"INSTALL '{path}'" if path else f"INSTALL {name}")
    con.execute(f"LOAD {name}")


def _ensure_schema(con: duckdb.DuckDBPyConnection, location: CatalogLocation) -> None:
    """Create the schema, upgrade an earlier version's, or refuse a newer one. Processes that
    open a new shared catalog at once may race to create it: PostgreSQL refuses all but one
    CREATE of a name, and the others find it made when they try again."""
    for attempt in range(5):
        try:
            return _ensure_schema_once(con, location)
        except duckdb.Error as err:
            if not location.shared or attempt == 4 or not _is_creation_race(err):
                raise
            time.sleep(0.1 * (1 + random.random()))


def _is_creation_race(err: Exception) -> bool:
    text = str(err).lower()
    return "duplicate key" in text or "already exists" in text or "could not serialize" in text


def _ensure_schema_once(con: duckdb.DuckDBPyConnection, location: CatalogLocation) -> None:
    """In one transaction: another client opening the catalog meanwhile sees no schema or all of
    it, never tables without their version."""
    con.execute(META_TABLE)
    con.execute("BEGIN")
    try:
        _write_schema(con, location)
        con.execute("COMMIT")
    except BaseException:
        _roll_back(con)
        raise


def _write_schema(con: duckdb.DuckDBPyConnection, location: CatalogLocation) -> None:
    meta = dict(con.execute("SELECT key, value FROM catalog_meta").fetchall())
    version = meta.get("schema_version")
    if version == SCHEMA_VERSION and meta.get("schema_sha256") == _schema_sha256():
        return  # this very schema (views and comments too) is in place: nothing to write
    if version is None:
        tables = {
            r[0]
            for r in con.execute(
                "SELECT table_name FROM duckdb_tables() "
                "WHERE database_name = current_database() AND schema_name = current_schema()"
            ).fetchall()
        }
        if "block_stats" in tables:
            raise MergepipeError(f"{location}: catalog from an earlier development version; use another catalog")
    elif version != SCHEMA_VERSION:
        if version not in MIGRATIONS:
            raise MergepipeError(
                f"{location}: catalog schema version {version}, this mergepipe uses {SCHEMA_VERSION}; "
                "use another catalog (--catalog or MERGEPIPE_CATALOG)"
            )
        while version in MIGRATIONS:
            con.execute(sql_text(MIGRATIONS[version]))
            version = con.execute("SELECT value FROM catalog_meta WHERE key = 'schema_version'").fetchall()[0][0]
    con.execute(sql_text("schema.sql"))
    con.execute("INSERT OR IGNORE INTO catalog_meta VALUES ('schema_version', ?)", [SCHEMA_VERSION])
    if not location.shared:
        # A shared catalog's views are each connection's own, and its comments are read from
        # a reference copy of this schema (describe_schema): PostgreSQL keeps neither.
        con.execute(sql_text("views.sql"))
        con.execute(sql_text("comments.sql"))
    # Last: with it recorded, later connections skip the statements above.
    con.execute("INSERT OR REPLACE INTO catalog_meta VALUES ('schema_sha256', ?)", [_schema_sha256()])


@lru_cache(maxsize=1)
def _schema_sha256() -> str:
    return hashlib.sha256("".join(sql_text(n) for n in SCHEMA_FILES).encode()).hexdigest()


SCHEMA_FILES = ("schema.sql", "views.sql", "comments.sql")
# Outside schema.sql: it is read first, to learn which schema a catalog holds.
META_TABLE = "CREATE TABLE IF NOT EXISTS catalog_meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL)"


def reference_schema() -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB holding this version's schema with its views and comments: what a
    shared catalog of this version holds, described without the database's help."""
    con = duckdb.connect()
    con.execute(META_TABLE)
    for name in SCHEMA_FILES:
        con.execute(sql_text(name))
    return con
