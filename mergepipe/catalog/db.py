"""Opening the catalog: short connections that wait for another process's lock."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from contextlib import contextmanager
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterator

import duckdb

from mergepipe.errors import MergepipeError

# The lock-wait note goes to this logger; the CLI shows it on stderr.
log = logging.getLogger("mergepipe.catalog")


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
        con.execute("ROLLBACK")
        raise
    finally:
        for name in tables:
            con.unregister(name)


def sql_text(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text()


def _is_lock_error(err: Exception) -> bool:
    text = str(err)
    return "lock" in text.lower() and ("Could not set lock" in text or "Conflicting lock" in text)


@contextmanager
def connect(
    path: str | Path, *, read_only: bool = False, timeout: float | None = None
) -> Iterator[duckdb.DuckDBPyConnection]:
    """A connection held only for the duration of the block.

    DuckDB lets one process at a time open a file for writing and fails at once otherwise;
    we retry with jittered backoff until `timeout`, then say who holds the lock."""
    path = Path(path)
    timeout = lock_timeout() if timeout is None else timeout
    if read_only and not path.exists():
        raise MergepipeError(f"{path}: no catalog yet (run `mergepipe index` first)")
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    delay, told = 0.05, False
    while True:
        try:
            con = duckdb.connect(str(path), read_only=read_only, config={"memory_limit": "4GB"})
            break
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
    try:
        if not read_only:
            _ensure_schema(con, path)
        yield con
    finally:
        con.close()


def _ensure_schema(con: duckdb.DuckDBPyConnection, path: Path) -> None:
    """Create the schema, upgrade an earlier version's, or refuse a newer one."""
    con.execute("CREATE TABLE IF NOT EXISTS catalog_meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL)")
    meta = dict(con.execute("SELECT key, value FROM catalog_meta").fetchall())
    version = meta.get("schema_version")
    if version == SCHEMA_VERSION and meta.get("schema_sha256") == _schema_sha256():
        return  # this very schema (views and comments too) is in place: nothing to write
    if version is None:
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        if "block_stats" in tables:
            raise MergepipeError(f"{path}: catalog from an earlier development version; use another catalog file")
    elif version != SCHEMA_VERSION:
        if version not in MIGRATIONS:
            raise MergepipeError(
                f"{path}: catalog schema version {version}, this mergepipe uses {SCHEMA_VERSION}; "
                "use another catalog file (--catalog or MERGEPIPE_CATALOG)"
            )
        con.execute("BEGIN")
        try:
            while version in MIGRATIONS:
                con.execute(sql_text(MIGRATIONS[version]))
                version = con.execute("SELECT value FROM catalog_meta WHERE key = 'schema_version'").fetchall()[0][0]
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    con.execute(sql_text("schema.sql"))
    con.execute("INSERT OR IGNORE INTO catalog_meta VALUES ('schema_version', ?)", [SCHEMA_VERSION])
    con.execute(sql_text("comments.sql"))
    # Last: with it recorded, later connections skip the statements above.
    con.execute("INSERT OR REPLACE INTO catalog_meta VALUES ('schema_sha256', ?)", [_schema_sha256()])


@lru_cache(maxsize=1)
def _schema_sha256() -> str:
    return hashlib.sha256((sql_text("schema.sql") + sql_text("comments.sql")).encode()).hexdigest()
