"""The statistics a first merge takes from the bytes it reads (index.tap) are the statistics
pass's, however the bytes come: whole tensors of every model in one batch, pieces cut anywhere
and fed again in part, one shard whole and the other in pieces, and models of other layouts."""

from __future__ import annotations

import random

import pytest
from safetensors.torch import load_file

from mergepipe.devtools.synthetic import make_family
from mergepipe.index.family import load_family
from mergepipe.index.first_merge import tap_stats
from mergepipe.index.stats import compute_stats
from mergepipe.index.tap import StatsTap
from mergepipe.plan.record import describe_inputs
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.reader import RangeReader, ReadRequest

from .helpers import replace_model

BLOCK = 2048


def _family(root, float32_expert: bool):
    paths = make_family(root, experts=("dense", "lora", "dense"), vocab=96, shards=2, seed=3)
    if float32_expert:  # another layout: the same values stored as fp32
        folder = paths.experts[2]
        tensors = {}
        for f in sorted(folder.glob("*.safetensors")):
            tensors.update({n: t.float() if t.is_floating_point() else t for n, t in load_file(f).items()})
        replace_model(folder, tensors, shards=2)
    return load_family(str(paths.base), [str(e) for e in paths.experts], RangeReader(ByteLedger()))


def _feeds(family, inputs, pattern: str, rng: random.Random):
    """(requests, buffers) batches as a merge's reads might give them."""
    models = [family.base, *family.experts]
    for f_i, file in enumerate(family.base.shards):
        whole = pattern == "whole" or (pattern == "mixed" and f_i == 0)
        per_model = []
        for inp, model in zip(inputs, models):
            data = open(model.path(file), "rb").read()
            spans = [e for e in inp.tensors.values() if e.file == file]
            lo, hi = min(e.start for e in spans), max(e.start + e.nbytes for e in spans)
            per_model.append((inp, model, data, lo, hi))
        if whole:
            yield (
                [ReadRequest(m.path(file), [(lo, hi)], "base", inp.role, file) for inp, m, _, lo, hi in per_model],
                [[bytearray(d[lo:hi])] for _, _, d, lo, hi in per_model],
            )
            continue
        # Each model cut at its own points; a piece may start before the last one ended.
        for inp, m, d, lo, hi in per_model:
            at = lo
            while at < hi:
                start = max(lo, at - rng.choice([0, 0, 1, 37, 700]))
                end = min(hi, at + rng.choice([1, 5, 333, 2048, 5000, 20000]))
                yield [ReadRequest(m.path(file), [(start, end)], "base", inp.role, file)], [[bytearray(d[start:end])]]
                at = end


@pytest.mark.parametrize("float32_expert", [False, True], ids=["one-layout", "fp32-expert"])
@pytest.mark.parametrize("pattern", ["whole", "pieces", "mixed"])
def test_tap_gives_the_statistics_pass_result_however_bytes_come(tmp_path, pattern, float32_expert):
    family = _family(tmp_path / "fam", float32_expert)
    positions = [0, 1, 2]
    ref = compute_stats(family, positions, BLOCK, RangeReader(ByteLedger()))
    inputs = describe_inputs(family, {fp: "-" for fp in [family.base_fp, *family.expert_fps()]})
    names = sorted(family.base.tensors)
    tap = StatsTap(inputs, [p + 1 for p in positions], BLOCK, names)
    assert tap.one_layout is not float32_expert  # the fast path is what "one-layout" tests
    for requests, buffers in _feeds(family, inputs, pattern, random.Random(11)):
        tap.feed(requests, buffers)
    got = tap_stats([tap.result()], family, positions)

    def rows(table):
        return sorted(zip(*(table[c].to_pylist() for c in table.column_names)))

    assert rows(got.stats) == rows(ref.stats) and len(rows(ref.stats)) > 0
    assert rows(got.blocks) == rows(ref.blocks)
    assert got.content == ref.content


def test_tap_refuses_a_tensor_not_wholly_read(tmp_path):
    family = _family(tmp_path / "fam", False)
    inputs = describe_inputs(family, {fp: "-" for fp in [family.base_fp, *family.expert_fps()]})
    names = sorted(family.base.tensors)
    tap = StatsTap(inputs, [1], BLOCK, names)
    feeds = list(_feeds(family, inputs, "whole", random.Random(0)))
    requests, buffers = feeds[0]
    tap.feed(requests[:2], buffers[:2])  # the first shard, base and expert 0
    with pytest.raises(Exception, match="bytes were read"):
        tap.result()
