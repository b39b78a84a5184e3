"""Rankings: which calibration a plan ranked by activation uses, and how two rankings' access
sets differ (pure)."""

from __future__ import annotations

import pyarrow as pa

from mergepipe.catalog.calibration import CalibrationRow
from mergepipe.errors import BadInput
from mergepipe.index.blocks import layer_index, with_layer


def calibrate_hint(base_uri: str) -> str:
    return f"run `mergepipe calibrate CONFIG --data FILE` first (texts like the model's inputs) for the base {base_uri}"


def choose_calibration(rows: list[CalibrationRow], wanted: str | None, base_uri: str) -> CalibrationRow:
    """The calibration `wanted` names (its data's location as calibrated, or a prefix of its
    digest), else the base's only one. None there, or several without a choice: BadInput
    saying what to do."""
    if not rows:
        raise BadInput(
            f"rank_by: activation needs a calibration of the base, and the catalog has none: {calibrate_hint(base_uri)}"
        )
    listed = "; ".join(f"{r.data_uri} ({r.data_digest[:12]}{', with gradients' if r.gradients else ''})" for r in rows)
    if wanted is None:
        if len(rows) == 1:
            return rows[0]
        raise BadInput(
            f"calibration: the base {base_uri} has {len(rows)} calibrations, name one (its data or digest): {listed}"
        )
    found = [r for r in rows if r.data_uri == wanted or r.data_digest.startswith(wanted)]
    if not found:
        found = [r for r in rows if r.data_uri.endswith("/" + wanted.lstrip("./"))]
    if len(found) != 1:
        what = "no" if not found else "more than one"
        raise BadInput(f"calibration: {wanted!r} names {what} calibration of the base {base_uri} (it has: {listed})")
    return found[0]


def tensor_kind(name: str) -> str:
    """A tensor's name with its layer's number as `*`: what the tensors of every layer share."""
    return name if layer_index(name) is None else with_layer(name, "*")


def compare_access(first: pa.Table, second: pa.Table) -> list[dict]:
    """How two access sets of one family differ, per tensor kind: the bytes each reads, those
    both read, and those only one reads (kinds in name order, then a total row)."""
    sets = []
    for table in (first, second):
        cols = table.select(["expert", "tensor", "block", "bytes"]).to_pydict()
        sets.append({(e, t, b): n for e, t, b, n in zip(cols["expert"], cols["tensor"], cols["block"], cols["bytes"])})
    a, b = sets
    rows: dict[str, dict] = {}
    for key in a.keys() | b.keys():
        row = rows.setdefault(
            tensor_kind(key[1]),
            {"first_bytes": 0, "second_bytes": 0, "both_bytes": 0, "first_only": 0, "second_only": 0},
        )
        in_a, in_b = key in a, key in b
        size = a[key] if in_a else b[key]
        row["first_bytes"] += size if in_a else 0
        row["second_bytes"] += size if in_b else 0
        row["both_bytes"] += size if in_a and in_b else 0
        row["first_only"] += size if in_a and not in_b else 0
        row["second_only"] += size if in_b and not in_a else 0
    out = [{"kind": kind, **rows[kind]} for kind in sorted(rows)]
    total = {
        k: sum(r[k] for r in out) for k in ("first_bytes", "second_bytes", "both_bytes", "first_only", "second_only")
    }
    return [*out, {"kind": "(all)", **total}]
