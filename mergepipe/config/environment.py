"""Settings from the environment: where local state lives (MERGEPIPE_HOME), the catalog's
location, how many layer groups run at once. Read here, once per call, and passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import SplitResult, quote, unquote, urlsplit

from mergepipe.errors import BadInput

SHARED_SCHEMES = ("postgresql", "postgres")


def home() -> Path:
    """MERGEPIPE_HOME: the default catalog."""
    return Path(os.environ.get("MERGEPIPE_HOME", "~/.mergepipe")).expanduser()


@dataclass(frozen=True)
class CatalogLocation:
    """Where the catalog lives: a DuckDB file (`path`), or a PostgreSQL database that many
    processes on many machines share (`url`, held without its password). A password given in
    the URL is kept apart (`password`, out of repr and comparisons) so that no message, record
    or flow parameter built from the location carries it."""

    path: Path | None = None
    url: str | None = None
    password: str | None = field(default=None, repr=False, compare=False)

    @property
    def shared(self) -> bool:
        return self.url is not None

    def __str__(self) -> str:
        return self.url if self.url is not None else str(self.path)

    def connection_url(self) -> str:
        """The URL to connect with: the password put back where the user gave one."""
        if self.password is None:
            return self.url
        parts = urlsplit(self.url)
        user, _, host = parts.netloc.rpartition("@")
        netloc = f"{user}:{quote(self.password, safe='')}@{host}"
        return SplitResult(parts.scheme, netloc, parts.path, parts.query, parts.fragment).geturl()


def parse_catalog(text: str | Path, key: str = "--catalog") -> CatalogLocation:
    """A local path (a DuckDB file) or `postgresql://user[:password]@host[:port]/dbname[?options]`."""
    text = str(text)
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if not scheme:
        return CatalogLocation(path=Path(text).expanduser())
    if scheme not in SHARED_SCHEMES:
        raise BadInput(f"{key}: {scheme}:// is not a catalog location (a DuckDB file path, or postgresql://…)")
    parts = urlsplit(text)
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise BadInput(f"{key}: the port in {_redacted(parts)} is not a number") from None
    if not parts.hostname:
        raise BadInput(f"{key}: {_redacted(parts)} names no host (postgresql://user@host:port/dbname)")
    if not parts.path.strip("/"):
        raise BadInput(f"{key}: {_redacted(parts)} names no database (postgresql://user@host:port/dbname)")
    password = unquote(parts.password) if parts.password is not None else None
    return CatalogLocation(url=_redacted(parts, mark=None), password=password)


def _redacted(parts: SplitResult, mark: str | None = "***") -> str:
    """The URL without its password (or with `mark` in its place)."""
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        name = user.split(":", 1)[0]
        netloc = f"{name}:{mark}@{host}" if mark else f"{name}@{host}"
    return SplitResult(parts.scheme, netloc, parts.path, parts.query, parts.fragment).geturl()


def catalog_location(given: str | Path | None = None) -> CatalogLocation:
    """The catalog: the one given (--catalog), else MERGEPIPE_CATALOG, else the home's DuckDB file."""
    if given:
        return parse_catalog(given)
    env = os.environ.get("MERGEPIPE_CATALOG")
    if env:
        return parse_catalog(env, key="MERGEPIPE_CATALOG")
    return CatalogLocation(path=home() / "catalog.duckdb")


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's RAM, or its cgroup's limit if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def default_memory() -> int:
    """The memory budget when neither --memory nor the config's `memory` gives one: half of
    what the machine (or cgroup) has, leaving the rest to the page cache and other processes."""
    return machine_memory() // 2


def worker_count() -> int:
    """MERGEPIPE_WORKERS: layer groups merged at once (default 2)."""
    return max(1, int(os.environ.get("MERGEPIPE_WORKERS", "2")))


def claim_stale_seconds() -> float:
    """How long an index claim lives without a heartbeat before another client takes it over
    (MERGEPIPE_CLAIM_STALE_SECONDS; its holder beats six times as often)."""
    value = os.environ.get("MERGEPIPE_CLAIM_STALE_SECONDS", "120")
    try:
        seconds = float(value)
    except ValueError:
        raise BadInput(f"MERGEPIPE_CLAIM_STALE_SECONDS: {value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise BadInput(f"MERGEPIPE_CLAIM_STALE_SECONDS: {value!r} must be above 0")
    return seconds
