"""Group marks: the record of a finished layer group, as the files that say it is done (JSON,
with Arrow tables beside it as Arrow IPC files, which JSON would cost far more to write and read).
Where the files go (a staging folder, or a staging prefix in an object store) is the staging's."""

from __future__ import annotations

import json
from collections.abc import Callable

import pyarrow as pa


def mark_files(group: str, record: dict) -> list[tuple[str, bytes]]:
    """(name, bytes) of the files that mark `group` done with `record`, the mark itself last:
    written in this order, the mark is what says the group is done."""
    files: list[tuple[str, bytes]] = []

    def plain(value, path: str):
        if isinstance(value, pa.Table):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_file(sink, value.schema) as out:
                out.write_table(value)
            name = f"{group}.{path}.arrow"
            files.append((name, sink.getvalue().to_pybytes()))
            return {"arrow_file": name}
        if isinstance(value, dict):
            return {k: plain(v, f"{path}.{k}" if path else k) for k, v in value.items()}
        return value

    text = json.dumps(plain(record, ""), sort_keys=True).encode()
    return [*files, (group, text)]


def read_mark(group: str, read: Callable[[str], bytes]) -> dict | None:
    """The record `group`'s mark holds, its tables read back; None when the mark or a file it
    names is missing or unreadable. `read(name)` gives a mark file's bytes (OSError if absent)."""

    def tables(value):
        if isinstance(value, dict):
            if set(value) == {"arrow_file"}:
                return pa.ipc.open_file(pa.BufferReader(read(value["arrow_file"]))).read_all()
            return {k: tables(v) for k, v in value.items()}
        return value

    try:
        record = json.loads(read(group))
        return tables(record) if isinstance(record, dict) else None
    except (OSError, ValueError, pa.ArrowException):
        return None
