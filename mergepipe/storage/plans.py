"""Saved plans: a plan's record (JSON) and its access set (Parquet) in a folder that layer tasks
load by path, written so that a reader never sees half of either."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mergepipe.storage.canonical import digest_of

PLAN_FILE = "plan.json"
ACCESS_TABLE = "access.parquet"


def plan_folder(root: Path, plan_digest: str, inputs: list[tuple[str, str]]) -> Path:
    """Where a plan is saved. The digest identifies content only, so the folder also keys on the
    inputs' (location, fingerprint): the same plan over another copy of the family must not
    share (or overwrite) this one's files."""
    return root / f"{plan_digest[:24]}-{digest_of([list(i) for i in inputs])[:12]}"


def save_plan(folder: Path, record: dict, access: pa.Table) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{PLAN_FILE}.tmp"
    # compact: json's C encoder writes only without indentation (a plan of 100k tensors)
    tmp.write_text(json.dumps(record, sort_keys=True, separators=(",", ":")))
    pq.write_table(access, folder / f"{ACCESS_TABLE}.tmp")
    os.replace(folder / f"{ACCESS_TABLE}.tmp", folder / ACCESS_TABLE)
    os.replace(tmp, folder / PLAN_FILE)
    return folder


def load_plan(folder: str | Path) -> tuple[dict, pa.Table]:
    folder = Path(folder)
    return json.loads((folder / PLAN_FILE).read_text()), pq.read_table(folder / ACCESS_TABLE)
