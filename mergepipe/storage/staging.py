"""Where an output waits until it is published: a folder beside a local output
(storage.writer.LocalStaging), a prefix beside an object-store output
(storage.store_staging.StoreStaging). Both are named by the plan digest, so a merge run again
finds what an earlier run of the same plan staged; tasks pass the staging's location."""

from __future__ import annotations

from pathlib import Path

from mergepipe.storage.location import is_remote
from mergepipe.storage.store_staging import StoreStaging, StoreWriter, staging_prefix
from mergepipe.storage.writer import LocalStaging, LocalWriter, staging_dir

Staging = LocalStaging | StoreStaging
# A layer group's writer into a staging: write(shard, offset, data), in layout order; close()
# gives what the group's mark keeps of the writes; abort() drops what is half written.
OutputWriter = LocalWriter | StoreWriter


def staging_for(out: str, key: str) -> Staging:
    """The staging of output `out` for the plan whose digest is `key`."""
    return StoreStaging(staging_prefix(out, key)) if is_remote(out) else LocalStaging(staging_dir(out, key))


def staging_at(location: str) -> Staging:
    """The staging at a location staging_for gave (as tasks pass it)."""
    return StoreStaging(location) if is_remote(location) else LocalStaging(Path(location))
