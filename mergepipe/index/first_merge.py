"""A first merge's indexing: the statistics its layer groups' taps measured, made into the
statistics pass's result; the blocks they found unchanged, whose bytes count as index reads;
and the check that the plan the merge is recorded under is the one it executed, less those."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from mergepipe.config.spec import expert_label
from mergepipe.errors import DeterminedError
from mergepipe.index.family import Family
from mergepipe.index.stats import BLOCKS_SCHEMA, STATS_SCHEMA, StatsResult, content_digest
from mergepipe.index.tap import HASHES_SCHEMA
from mergepipe.storage.ledger import ByteLedger


def tap_stats(parts: list[dict], family: Family, positions: list[int]) -> StatsResult:
    """The statistics pass's result (index.stats.compute_stats) from every layer group's tap
    result, for the experts at `positions`: the same rows, layout and content digests."""
    stats = pa.concat_tables([p["stats"] for p in parts]).combine_chunks() if parts else STATS_SCHEMA.empty_table()
    blocks = pa.concat_tables([p["blocks"] for p in parts]).combine_chunks() if parts else BLOCKS_SCHEMA.empty_table()
    result = StatsResult(stats, blocks)
    hashes = pa.concat_tables([p["sha256"] for p in parts]) if parts else HASHES_SCHEMA.empty_table()

    def of(role: str) -> dict[str, str]:
        mine = hashes.filter(pc.equal(hashes["role"], role))
        return dict(zip(mine["tensor"].to_pylist(), mine["sha256"].to_pylist()))

    result.content[family.base_fp] = content_digest(of("base"), family.base)
    fps = family.expert_fps()
    for i in positions:
        result.content[fps[i]] = content_digest(of(expert_label(i)), family.experts[i])
    return result


def unchanged_blocks(stats: pa.Table) -> list[tuple[str, str, int, int]]:
    """(expert_fp, tensor, block, bytes) of the statistics rows whose block equals the base's."""
    rows = stats.filter(pc.equal(stats["nnz_delta"], 0))
    return list(zip(*(rows[c].to_pylist() for c in ("expert_fp", "tensor", "block", "bytes"))))


def count_unchanged_as_index(stats: pa.Table, inputs: list, ledger: ByteLedger) -> int:
    """Move the bytes of the blocks a group found unchanged (read by every input listing that
    expert; `inputs`: the executed plan's) from `expert` to `index` in its ledger: they were
    read for the index alone. Returns how many bytes moved."""
    positions: dict[str, list[int]] = {}
    for k, inp in enumerate(inputs[1:]):
        positions.setdefault(inp.model_fp, []).append(k)
    moved = 0
    for fp, tensor, _, nbytes in unchanged_blocks(stats):
        for k in positions[fp]:
            inp = inputs[k + 1]
            file = inp.tensors[tensor].file
            ledger.add("expert", inp.role, file, -nbytes, requests=0)
            ledger.add("index", inp.role, file, nbytes, requests=0)
            moved += nbytes
    return moved


def check_recorded_plan(executed: pa.Table, chosen: pa.Table, stats: pa.Table, expert_fps: list[str]) -> None:
    """The access set of the plan a merge of the newly indexed family chooses (`chosen`) must be
    the one executed less the blocks found unchanged (reading those changed no output byte);
    else the merge is not published."""
    unchanged = {(fp, t, b) for fp, t, b, _ in unchanged_blocks(stats)}
    expected = {
        (e, t, b)
        for e, t, b in zip(*(executed[c].to_pylist() for c in ("expert", "tensor", "block")))
        if (expert_fps[e], t, b) not in unchanged
    }
    got = set(zip(*(chosen[c].to_pylist() for c in ("expert", "tensor", "block"))))
    if got != expected:
        raise DeterminedError(
            f"the plan chosen after indexing differs from the blocks merged ({len(got)} pairs against "
            f"{len(expected)}); not publishing"
        )
