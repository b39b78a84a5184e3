"""Pure functions: sizes, budgets, blocks, layout, spec validation."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load

from mergepipe.config.sizes import parse_budget, parse_size
from mergepipe.config.spec import load_spec
from mergepipe.errors import BadInput
from mergepipe.index.blocks import block_rows, layer_group
from mergepipe.plan.output import plan_output
from mergepipe.plan.params import resolve_params
from mergepipe.storage.safetensors_format import build_header, parse_header


def test_sizes_and_budgets():
    assert parse_size("512MiB", key="k") == 512 * 2**20
    assert parse_size("2GB", key="k") == 2 * 10**9
    assert parse_size(1024, key="k") == 1024
    assert parse_budget("10%").resolve(1000) == 100
    assert parse_budget("100%").resolve(12345) == 12345
    assert parse_budget(None).resolve(7) == 7
    assert parse_budget("1KiB").resolve(10**9) == 1024
    for bad in ("-5%", "-1MiB", "150%", "lots", "3.5"):
        with pytest.raises(BadInput):
            parse_budget(bad)


def test_block_rows():
    assert block_rows((), 4, 1024) == [(0, 1)]
    assert block_rows((10,), 4, 8) == [(0, 10)]
    assert block_rows((0, 5), 4, 8) == []
    assert block_rows((10, 4), 4, 32) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert block_rows((3, 1000), 4, 16) == [(0, 1), (1, 2), (2, 3)]  # a row larger than a block is one block


def test_layer_groups():
    assert layer_group("model.layers.3.mlp.up_proj.weight") == "layer.00003"
    assert layer_group("encoder.layer.11.attention.self.query.weight") == "layer.00011"
    assert layer_group("model.embed_tokens.weight") == "embeddings"
    assert layer_group("lm_head.weight") == "head"
    assert layer_group("model.norm.weight") == "other"


def test_built_header_loads_with_safetensors():
    entries = [("a", "BF16", (3, 2)), ("b", "F32", (4,)), ("s", "F32", ()), ("z", "F32", (0, 3))]
    header, ranges = build_header(entries)
    assert len(header) % 8 == 0
    size = ranges[-1][1]
    buf = bytearray(size)
    buf[: len(header)] = header
    tensors = st_load(bytes(buf))
    assert tensors["a"].shape == (3, 2) and tensors["a"].dtype == torch.bfloat16
    assert tensors["s"].shape == () and tensors["z"].shape == (0, 3)
    parsed, meta = parse_header(header[8:], size, "mem")
    assert meta == {"format": "pt"} and list(parsed) == ["a", "b", "s", "z"]


@pytest.mark.parametrize(
    "body,match",
    [
        (b"not json", "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (json.dumps({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode(), "needs 8"),
        (json.dumps({"t": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}).encode(), "unsupported dtype"),
        (json.dumps({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 400]}}).encode(), "past the end"),
    ],
)
def test_header_errors_name_the_problem(body, match):
    with pytest.raises(BadInput, match=match):
        parse_header(body, 8 + len(body) + 16, "x.safetensors")


_A = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
_B = '{"dtype":"F32","shape":[1],"data_offsets":[4,8]}'


@pytest.mark.parametrize(
    "body",
    [
        '{"a":%s,"a":%s}' % (_A, _B),
        '{"a":{},"a":%s}' % _B,  # the parse keeps the last, which is valid
        '{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        '{"__metadata__":{"k":"{","k":"v"},"a":%s}' % _A,
    ],
)
def test_header_with_a_key_given_twice_is_refused(body):
    with pytest.raises(BadInput, match="appears twice"):
        parse_header(body.encode(), 8 + len(body) + 16, "x.safetensors")


def test_header_whose_strings_hold_braces_and_key_names_parses():
    body = json.dumps({"__metadata__": {"note": '{"dtype": "shape"}'}, "t{": json.loads(_A), "b": json.loads(_B)})
    tensors, meta = parse_header(body.encode(), 8 + len(body) + 16, "x.safetensors")
    assert meta == {"note": '{"dtype": "shape"}'} and list(tensors) == ["t{", "b"]


def test_output_shards_split_by_size():
    entries = {f"model.layers.{i}.w": ("F32", (256,)) for i in range(4)}  # 1 KiB each
    layout = plan_output(entries, 2048)
    assert [s.name for s in layout.shards] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert list(layout.groups) == ["layer.00000", "layer.00001", "layer.00002", "layer.00003"]
    one = plan_output(entries, 10**6)
    assert [s.name for s in one.shards] == ["model.safetensors"]


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_spec_is_strict_and_errors_name_the_key(tmp_path):
    good = "merge_method: ties\nbase_model: b\nmodels:\n  - model: e\n    parameters: {weight: 1.0, density: 0.5}\n"
    spec = load_spec(_write(tmp_path, good))
    assert spec.base_model == str((tmp_path / "b").resolve())
    p = resolve_params(spec)
    assert p["normalize"] is True and p["density"] == (0.5,)
    cases = {
        good + "normalise: true\n": "normalise: unknown key",
        good.replace("density: 0.5", "density: 1.5"): "density",
        good.replace("density: 0.5", "densty: 0.5"): "densty: unknown key",
        good.replace("ties", "frankenmerge"): "unknown merge_method",
        "merge_method: ties\nbase_model: b\nmodels: []\n": "models",
        good + "budget: 5%\nmax_error: 1.0\n": "not both",
        good + "budget: -3%\n": "negative",
        "merge_method: ties\nbase_model: b\nmodels:\n  - model: e\n": None,
    }
    for text, match in cases.items():
        if match is None:
            with pytest.raises(BadInput, match=r"models\[0\]\.parameters\.weight"):
                resolve_params(load_spec(_write(tmp_path, text)))
        else:
            with pytest.raises(BadInput, match=match):
                load_spec(_write(tmp_path, text))
    with pytest.raises(BadInput, match="not found"):
        load_spec(tmp_path / "missing.yaml")
    with pytest.raises(BadInput, match="not valid YAML"):
        load_spec(_write(tmp_path, "a: [1, 2"))


def test_declared_header_over_limit_is_rejected_unallocated():
    from mergepipe.storage.safetensors_format import header_length

    with pytest.raises(BadInput, match="at or over the"):
        header_length(struct.pack("<Q", 200 * 2**20), 10**10, "big.safetensors")


def test_locations_and_output_names():
    from mergepipe.storage.location import inside, join, normalize, split
    from mergepipe.storage.writer import is_output_name, upload_order

    assert normalize("s3://bkt//a/b/") == "s3://bkt/a/b"
    assert join("s3://bkt/a/", "x.json") == "s3://bkt/a/x.json"
    assert split("s3://bkt/a/x.json") == ("s3://bkt/a", "x.json")
    assert inside("s3://bkt/a/b", "s3://bkt/a") and inside("s3://bkt/a", "s3://bkt/a/")
    assert not inside("s3://bkt/ab", "s3://bkt/a")
    assert all(
        map(
            is_output_name,
            [
                "model-00001-of-00002.safetensors",
                "model.safetensors",
                "config.json",
                "mergepipe-manifest.json",
                "mergepipe-access.parquet",
            ],
        )
    )
    assert not is_output_name("notes.txt") and not is_output_name("sub/model.safetensors")
    names = [
        "mergepipe-manifest.json",
        "config.json",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
    ]
    order = upload_order(names)
    assert order[:2] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert order[-1] == "mergepipe-manifest.json" and sorted(order) == sorted(names)


def test_storage_options_are_never_shown(tmp_path):
    cfg = tmp_path / "m.yaml"
    cfg.write_text(
        "merge_method: linear\nbase_model: s3://b/base\nmodels:\n  - model: s3://b/x\n    parameters: {weight: 1}\n"
        "storage_options: {key: AKIAX, secret: hush-hush-123}\n"
    )
    spec = load_spec(cfg)
    assert spec.storage_options["secret"] == "hush-hush-123"
    assert "hush-hush-123" not in repr(spec) and "hush-hush-123" not in str(spec)
    assert "storage_options" not in json.dumps(spec.content())
    # A Dask worker reads only this key of the config the flow validated (no second validation).
    from mergepipe.config.spec import storage_options_of

    assert storage_options_of(cfg) == {"key": "AKIAX", "secret": "hush-hush-123"}
    cfg.write_text("merge_method: linear\nbase_model: b\nmodels: [{model: x}]\n")
    assert storage_options_of(cfg) == {}


@pytest.mark.parametrize("step", [5, 1 << 18])
def test_weighted_sum_over_planned_rows_equals_whole_tensors(monkeypatch, step):
    """task_arithmetic computes only the rows an expert was read in when it can, converting the
    stored rows piece by piece: the result is bit-identical to the same operator on whole expert
    tensors (base values elsewhere), with steps that split the row runs and with none."""
    from mergepipe.execute.experts import LazyExperts
    from mergepipe.operators import OPERATORS, TensorContext, gta

    monkeypatch.setattr(gta, "ROW_STEP_ELEMENTS", step)
    g = torch.Generator().manual_seed(4)
    base = torch.randn(40, 6, generator=g)
    base[3, 2] = -0.0  # signed zeros must survive either way
    patches = {0: [((0, 5), None), ((20, 23), None)], 2: [((7, 40), None)]}  # expert 1: nothing planned
    for k, runs in patches.items():
        # stored as bf16, computed after rounding to fp16 (a config `dtype`): conversions count
        patches[k] = [
            ((r0, r1), (base[r0:r1] + torch.randn(r1 - r0, 6, generator=g) * 0.1).to(torch.bfloat16))
            for (r0, r1), _ in runs
        ]
    patches[2][0][1][0, 0] = -0.0

    def to_compute(t):
        return t.to(torch.float16).to(torch.float32)

    lazy = LazyExperts(base, lambda k: patches.get(k), 3, to_compute)
    whole = [lazy[k] for k in range(3)]
    op = OPERATORS["task_arithmetic"]
    for normalize, lam in [(False, 1.0), (True, 0.7), (False, -1.3)]:
        params = op.params(3, weight=(0.5, -0.25, 1.5), lambda_=lam, normalize=normalize)
        ctx = TensorContext("t", ((0, 40),), 0)
        a = op.merge(base, LazyExperts(base, lambda k: patches.get(k), 3, to_compute), params, ctx)
        b = op.merge(base, whole, params, ctx)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (normalize, lam)
        # and the textbook formula, whole tensors, out of place
        mixed = sum((x - base) * w for x, w in zip(whole, params["weight"]))
        if normalize:
            mixed = mixed / sum(params["weight"])
        assert torch.equal(a.view(torch.int32), (base + mixed * lam).view(torch.int32)), (normalize, lam)


@pytest.mark.parametrize("method", ["ties", "dare_ties", "breadcrumbs_ties", "della"])
def test_sign_election_holds_or_recomputes_the_same_deltas(monkeypatch, method):
    """Consensus operators in the whole-tensor form keep the sparsified deltas between their
    two passes when they fit, and compute them again when they do not: bit-identical results
    either way. (TIES and DARE normally run slab by slab: test_slabs.py.)"""
    from mergepipe.operators import OPERATORS, TensorContext, gta

    monkeypatch.setattr(gta, "SLAB_KEEPS", {})

    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, 5, generator=g)
    experts = [base + torch.randn(64, 5, generator=g) * 0.1 for _ in range(3)]
    op = OPERATORS[method]
    values = dict(weight=(0.6, 0.3, 0.9), density=(0.5, 0.7, 0.3), gamma=(0.01,) * 3, epsilon=(0.1,) * 3)
    params = op.params(
        3, **{k: v for k, v in values.items() if op.declared(k)}, normalize=True, rescale=method.startswith("della")
    )
    ctx = TensorContext("t", ((0, 16), (16, 40), (40, 64)), 3)
    held = op.merge(base, experts, params, ctx)
    monkeypatch.setattr(gta, "HELD_DELTA_BYTES", 0)
    recomputed = op.merge(base, experts, params, ctx)
    assert torch.equal(held.view(torch.int32), recomputed.view(torch.int32))
    assert not torch.equal(held, base)


@pytest.mark.parametrize("sample", [4, 1024])
def test_order_statistic_by_bracket_equals_kthvalue(monkeypatch, sample):
    """The bracketed k-th value equals torch.kthvalue's, on data whose order fools a strided
    sample (sorted, reversed, periodic), with runs of equal values (zeros), NaN, and brackets
    that miss (the fallback); on shuffled data the bracket holds the answer, so kthvalue never
    sees the whole tensor."""
    from mergepipe.operators import sparsify

    monkeypatch.setattr(sparsify, "_BRACKET_SAMPLE", sample)
    kthvalue, seen = torch.kthvalue, []
    monkeypatch.setattr(torch, "kthvalue", lambda v, k: (seen.append(v.numel()), kthvalue(v, k))[1])
    g = torch.Generator().manual_seed(1)
    n = max(200, 5 * sample)
    cases = {
        "shuffled": torch.randn(n, generator=g),
        "sorted": torch.sort(torch.randn(n, generator=g)).values,
        "reversed": torch.sort(torch.randn(n, generator=g), descending=True).values,
        "periodic": torch.arange(n).remainder(7).float(),
        "zeros": torch.where(torch.rand(n, generator=g) < 0.6, 0.0, torch.randn(n, generator=g).abs()),
        "nan": torch.cat([torch.randn(n - 40, generator=g), torch.full((40,), float("nan"))]),
    }
    for name, v in cases.items():
        seen.clear()
        for k in sorted({1, 2, n // 3, n // 2, n - 41, n - 40, n - 39, n - 1, n, *range(1, n + 1, max(1, n // 97))}):
            got, want = sparsify._order_statistic(v, k), kthvalue(v, k).values
            assert torch.equal(got, want) or (got.isnan() and want.isnan()), (name, k, got, want)
        if name == "shuffled" and sample > 4:
            assert max(seen) < n // 3, seen  # the bracket: about 2 * margin / sample of the elements


@pytest.mark.parametrize("chunk", [3, 1 << 22])
def test_selection_ties_go_to_the_lowest_indices(monkeypatch, chunk):
    """Top-k and bottom-k masks against a stable sort, with many ties, and with the tie count
    split over several chunks."""
    from mergepipe.operators import sparsify

    monkeypatch.setattr(sparsify, "_TIE_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 60, (1,), generator=g))
        v = torch.randint(0, 5, (n,), generator=g).float() * 0.5 - 1
        k = int(torch.randint(0, n + 2, (1,), generator=g))
        want = torch.zeros(n, dtype=torch.bool)
        want[sorted(range(n), key=lambda i: (float(v[i]), i))[: max(0, k)]] = True
        assert torch.equal(sparsify.rank_below(v, k), want)
        density = float(torch.rand(1, generator=g))
        top = max(1, int(density * n))
        want = torch.zeros(n, dtype=torch.bool)
        want[sorted(range(n), key=lambda i: (-abs(float(v[i])), i))[:top]] = True
        assert torch.equal(sparsify.magnitude_keep_mask(v, density), want)


@pytest.mark.parametrize("guaranteed", [True, False])
def test_sweep_plot_marks_a_heuristic_bound_and_shares_its_axes(guaranteed):
    """The bound of a non-additive operator is drawn dotted and labelled heuristic, never as the
    guarantee's dashed line; the three panels share one x range and the time axis starts at 0."""
    from mergepipe.publish.report import sweep_figure

    rows = [
        {
            "budget_bytes": b,
            "full_expert_bytes": 100,
            "expert_bytes_read": b * 2**20,
            "wall_seconds": 5 + b / 10,
            "relative_to_full": 1e-3 / (b + 1),
            "error_bound": 2e-3 / (b + 1),
            "full_norm": 1.0,
            "bound_guaranteed": guaranteed,
        }
        for b in (10, 50, 100)
    ]
    fig = sweep_figure(rows, "t")
    a, b, c = fig.axes
    assert a.get_xlim() == b.get_xlim() == c.get_xlim()
    assert b.get_ylim()[0] == 0
    lines = {line.get_label(): line.get_linestyle() for line in c.get_lines()}
    if guaranteed:
        assert lines.get("bound") == "--" and "heuristic (not a bound)" not in lines
    else:
        assert lines.get("heuristic (not a bound)") == ":" and "bound" not in lines


def test_part_plan_joins_pieces_in_parts_the_store_accepts():
    """Every part but the last at least the minimum and at most the maximum; the parts cover the
    pieces exactly, in order; a piece with the minimum left is copied, not sent."""
    import random

    from mergepipe.storage.store_staging import part_plan

    rng = random.Random(3)
    for trial in range(3000):
        lo = rng.choice([1, 4, 16])
        hi = rng.choice([2 * lo, 3 * lo, 10 * lo])
        pieces = [
            (f"p{i}", rng.choice([0, 1, lo - 1, lo, lo + 1, rng.randrange(1, 6 * hi)]))
            for i in range(rng.randrange(1, 8))
        ]
        pieces = [(name, max(0, n)) for name, n in pieces]
        parts = part_plan(pieces, lo, hi)
        flat = [r for _, ranges in parts for r in ranges]
        # The ranges, joined, are the pieces' bytes in order.
        got = [(src, b) for src, s, e in flat for b in range(s, e)]
        want = [(src, b) for src, n in pieces for b in range(n)]
        assert got == want, (pieces, parts)
        sizes = [sum(e - s for _, s, e in ranges) for _, ranges in parts]
        assert all(lo <= n <= hi for n in sizes[:-1]), (pieces, lo, hi, sizes)
        assert all(0 < n <= hi for n in sizes[-1:])
        for copied, ranges in parts:
            assert not copied or len(ranges) == 1
    # A small header is gathered with the start of the next piece; the rest of a large piece is
    # copied, split so that no copied part is under the minimum; a small last piece is sent.
    assert part_plan([("h", 3), ("a", 40), ("b", 5)], 10, 25) == [
        (False, [("h", 0, 3), ("a", 0, 7)]),
        (True, [("a", 7, 30)]),
        (True, [("a", 30, 40)]),
        (False, [("b", 0, 5)]),
    ]
