"""Settings from the environment: where local state lives (MERGEPIPE_HOME), the catalog's
location, how many layer groups run at once. Read here, once per call, and passed down."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """MERGEPIPE_HOME: the default catalog, saved plans, the statistics cache and the upload spool."""
    return Path(os.environ.get("MERGEPIPE_HOME", "~/.mergepipe")).expanduser()


def catalog_path(given: str | Path | None = None) -> Path:
    """The catalog file: the one given (--catalog), else MERGEPIPE_CATALOG, else the home's."""
    if given:
        return Path(given).expanduser()
    env = os.environ.get("MERGEPIPE_CATALOG")
    return Path(env).expanduser() if env else home() / "catalog.duckdb"


def spool_dir() -> Path:
    """Where outputs bound for an object store are staged before their upload."""
    return home() / "spool"


def plans_root() -> Path:
    """Where saved plans live for the layer tasks to load."""
    return home() / "plans"


def results_dir() -> Path:
    """Where Prefect persists task results (the statistics pass's cache)."""
    return home() / "results"


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
