"""A family's models, files and tensor tables as Arrow tables, the form the catalog ingests."""

from __future__ import annotations

from typing import NamedTuple

import pyarrow as pa

from mergepipe.index.blocks import layer_group
from mergepipe.index.family import model_fingerprint
from mergepipe.storage.location import trailing_names
from mergepipe.storage.model_files import ModelFiles

MODELS_SCHEMA = pa.schema(
    [
        ("model_fp", pa.string()),
        ("uri", pa.string()),
        # display names to choose from, shortest first (the catalog keeps the first one no
        # other location holds)
        ("names", pa.list_(pa.string())),
        ("n_tensors", pa.int64()),
        ("tensor_bytes", pa.int64()),
    ]
)
FILES_SCHEMA = pa.schema(
    [
        ("model_fp", pa.string()),
        ("file", pa.string()),
        ("size", pa.int64()),
        ("mtime_ns", pa.int64()),
        ("ctime_ns", pa.int64()),
        ("inode", pa.int64()),
        ("header_bytes", pa.int64()),
        ("etag", pa.string()),
        ("version_id", pa.string()),
    ]
)
TENSORS_SCHEMA = pa.schema(
    [
        ("model_fp", pa.string()),
        ("name", pa.string()),
        ("file", pa.string()),
        ("dtype", pa.string()),
        ("shape", pa.list_(pa.int64())),
        ("byte_start", pa.int64()),
        ("byte_end", pa.int64()),
        ("layer", pa.string()),
    ]
)


class ModelTables(NamedTuple):
    models: pa.Table
    files: pa.Table
    tensors: pa.Table


def model_tables(models: list[ModelFiles]) -> ModelTables:
    m_rows, f_rows = [], []
    t_cols: dict[str, list] = {f.name: [] for f in TENSORS_SCHEMA}
    for model in models:
        fp = model_fingerprint(model)
        m_rows.append(
            {
                "model_fp": fp,
                "uri": model.uri,
                "names": trailing_names(model.uri),
                "n_tensors": len(model.tensors),
                "tensor_bytes": sum(loc.nbytes for loc in model.tensors.values()),
            }
        )
        for shard, ffp in model.fingerprints.items():
            f_rows.append(
                {
                    "model_fp": fp,
                    "file": shard,
                    "size": ffp.size,
                    "mtime_ns": ffp.mtime_ns,
                    "ctime_ns": ffp.ctime_ns,
                    "inode": ffp.inode,
                    "header_bytes": len(model.header_bytes.get(shard, b"")),
                    "etag": ffp.etag,
                    "version_id": ffp.version_id,
                }
            )
        # Columns, not a dict per tensor: a checkpoint may hold 100k tensors.
        locs = model.tensors.values()
        t_cols["model_fp"].extend([fp] * len(locs))
        t_cols["name"].extend(model.tensors)
        t_cols["file"].extend([loc.file for loc in locs])
        t_cols["dtype"].extend([loc.dtype for loc in locs])
        t_cols["shape"].extend([loc.shape for loc in locs])
        t_cols["byte_start"].extend([loc.start for loc in locs])
        t_cols["byte_end"].extend([loc.end for loc in locs])
        t_cols["layer"].extend([layer_group(name) for name in model.tensors])
    return ModelTables(
        pa.Table.from_pylist(m_rows, schema=MODELS_SCHEMA),
        pa.Table.from_pylist(f_rows, schema=FILES_SCHEMA),
        pa.table(t_cols, schema=TENSORS_SCHEMA),
    )
