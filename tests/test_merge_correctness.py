"""Full budget = full read, bit for bit; smaller budgets stay within the predicted bound."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from mergepipe.devtools.synthetic import FamilyPaths, write_model
from mergepipe.flows.merge import merge

from .helpers import assert_bit_identical, config_for, frobenius_diff
from .reference import load_model, reference_merge

METHODS = ["linear", "task_arithmetic", "ties", "dare_linear", "dare_ties"]


def _density(method):
    return 0.5 if method in ("ties", "dare_linear", "dare_ties") else None


@pytest.mark.parametrize("method", METHODS)
def test_full_budget_is_bit_identical_to_full_read_reference_bf16(method, bf16_family, tmp_path, session_catalog):
    weights = [0.5, 0.3, 0.8]
    cfg = config_for(
        tmp_path,
        bf16_family,
        method,
        weights=weights,
        density=_density(method),
        parameters={"lambda": 0.9} if method != "linear" else {},
        seed=7,
    )
    result = merge(config=str(cfg), out=str(tmp_path / "out"), budget="100%", catalog=session_catalog)
    expected = reference_merge(
        method,
        bf16_family.base,
        bf16_family.experts,
        weights,
        densities=[_density(method) or 1.0] * 3,
        lam=0.9 if method != "linear" else 1.0,
        seed=7,
        block_size=4096,
    )
    assert_bit_identical(tmp_path / "out", expected)
    assert result["expert_bytes_read"] == result["expert_bytes_planned"] <= result["budget_bytes"]


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "dare_ties"])
def test_full_budget_bit_identical_fp32_three_shards(method, fp32_family, tmp_path, session_catalog):
    weights = [1.0, 0.7, 0.4]
    cfg = config_for(tmp_path, fp32_family, method, weights=weights, density=_density(method), seed=3)
    merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    expected = reference_merge(
        method,
        fp32_family.base,
        fp32_family.experts,
        weights,
        densities=[_density(method) or 1.0] * 3,
        seed=3,
        block_size=4096,
    )
    assert_bit_identical(tmp_path / "out", expected)


@pytest.mark.parametrize("method", ["ties", "dare_ties"])
@pytest.mark.parametrize(
    "family,dtypes",
    [
        ("bf16_family", {}),  # into the stored base's own buffer
        ("bf16_family", {"out_dtype": "float32"}),  # into a fresh fp32 output
        ("fp32_family", {}),  # fp32 stored: the widening is the stored base itself
        ("fp32_family", {"dtype": "bfloat16"}),  # each slab rounded to bf16, then widened
        ("fp32_family", {"dtype": "float16", "out_dtype": "bfloat16"}),
    ],
)
def test_elections_from_the_stored_base_widened_slab_by_slab(
    method, family, dtypes, request, tmp_path, session_catalog, monkeypatch
):
    """Every base tensor left as stored and widened a slab at a time (as an embedding is), the
    result rounded into the stored base's buffer or a fresh output: the reference, bit for bit."""
    from mergepipe.execute import whole

    monkeypatch.setattr(whole, "WHOLE_BASE_BYTES", 0)
    fam = request.getfixturevalue(family)
    weights = [0.9, -0.4, 0.6]
    cfg = config_for(tmp_path, fam, method, weights=weights, density=0.5, seed=5, **dtypes)
    merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    compute = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtypes.get("dtype"))
    out_dtype = (
        torch.float32 if dtypes.get("out_dtype") == "float32" else torch.bfloat16 if dtypes.get("out_dtype") else None
    )
    expected = reference_merge(
        method,
        fam.base,
        fam.experts,
        weights,
        densities=[0.5] * 3,
        seed=5,
        block_size=4096,
        out_dtype=out_dtype,
        compute_dtype=compute,
    )
    assert_bit_identical(tmp_path / "out", expected)


def test_out_dtype_is_applied(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic", out_dtype="float32")
    merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    expected = reference_merge(
        "task_arithmetic", bf16_family.base, bf16_family.experts, [0.5, 0.3, 0.8], out_dtype=None
    )
    got = load_model(tmp_path / "out")
    for name, t in got.items():
        if expected[name].is_floating_point():
            assert t.dtype.is_floating_point and t.dtype.itemsize == 4, name
        else:
            assert t.dtype == expected[name].dtype, name


@pytest.mark.parametrize("method", ["linear", "task_arithmetic"])
def test_error_within_bound_and_bound_shrinks_with_budget(method, bf16_family, tmp_path, session_catalog):
    # fp32 output: the bound is on the merged fp32 values, before any cast to a narrower dtype.
    cfg = config_for(tmp_path, bf16_family, method, out_dtype="float32")
    full_out = tmp_path / "full"
    full = merge(config=str(cfg), out=str(full_out), budget="100%", catalog=session_catalog)
    assert full["error_bound"] == 0.0
    theta_full = load_model(full_out)
    bounds, measured = [], []
    for pct in (5, 10, 25, 50):
        out = tmp_path / f"b{pct}"
        r = merge(config=str(cfg), out=str(out), budget=f"{pct}%", catalog=session_catalog)
        assert r["bound_guaranteed"]
        assert r["expert_bytes_read"] == r["expert_bytes_planned"] <= r["budget_bytes"]
        err = frobenius_diff(load_model(out), theta_full)
        # fp32 evaluation adds a few ulps per element on top of the exact-arithmetic bound.
        assert err <= r["error_bound"] * (1 + 1e-5) + 1e-6, (pct, err, r["error_bound"])
        assert err > 0
        bounds.append(r["error_bound"])
        measured.append(err)
    assert all(a > b for a, b in zip(bounds, bounds[1:])), bounds


def test_ranking_against_the_base_chooses_other_blocks_within_the_bound(bf16_family, tmp_path, session_catalog):
    """rank_by: delta_over_sqrt_base reads other blocks at 25%, within the same budget; its error
    stays within the bound, which is computed on what it leaves out. At full budget it reads
    every block, so the output's bytes are the default ranking's."""
    kw = dict(out_dtype="float32")
    plain = config_for(tmp_path, bf16_family, "task_arithmetic", **kw)
    ranked = config_for(
        tmp_path, bf16_family, "task_arithmetic", name="ranked.yaml", rank_by="delta_over_sqrt_base", **kw
    )
    runs = {}
    for label, cfg in (("plain", plain), ("ranked", ranked)):
        for pct in (25, 100):
            out = tmp_path / f"{label}-{pct}"
            runs[label, pct] = (merge(config=str(cfg), out=str(out), budget=f"{pct}%", catalog=session_catalog), out)
    access = {
        k: {
            tuple(r.values())
            for r in pq.read_table(out / "mergepipe-access.parquet", columns=["expert", "tensor", "block"]).to_pylist()
        }
        for k, (_, out) in runs.items()
    }
    assert access["ranked", 100] == access["plain", 100]
    assert access["ranked", 25] != access["plain", 25]
    r, out = runs["ranked", 25]
    assert r["bound_guaranteed"] and r["expert_bytes_read"] == r["expert_bytes_planned"] <= r["budget_bytes"]
    err = frobenius_diff(load_model(out), load_model(runs["ranked", 100][1]))
    assert 0 < err <= r["error_bound"] * (1 + 1e-5) + 1e-6
    assert runs["ranked", 25][0]["digest"] != runs["plain", 25][0]["digest"]
    shards = [
        json.loads((runs[k][1] / "mergepipe-manifest.json").read_text())["content"]["output"]["shards"]
        for k in (("plain", 100), ("ranked", 100))
    ]
    assert shards[0] == shards[1]


def test_untouched_tensors_equal_base_and_lora_reads_only_its_projections(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    r = merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    base = load_model(bf16_family.base)
    got = load_model(tmp_path / "out")
    for name in base:
        if "norm" in name or name in ("model.logit_scale", "model.position_ids"):
            assert got[name].dtype == base[name].dtype and bool((got[name] == base[name]).all()), name
    access = pq.read_table(tmp_path / "out" / "mergepipe-access.parquet").to_pylist()
    lora_tensors = {a["tensor"] for a in access if a["expert"] == 2}
    assert lora_tensors and all(".q_proj." in t or ".v_proj." in t for t in lora_tensors)
    assert not any("norm" in a["tensor"] for a in access)
    # At full budget the LoRA expert's planned bytes are exactly its changed projections.
    lora = load_model(bf16_family.experts[2])
    changed = sum(lora[t].numel() * lora[t].element_size() for t in lora if not torch_equal(lora[t], base[t]))
    plan_bytes = sum(a["bytes"] for a in access if a["expert"] == 2)
    assert plan_bytes == changed
    assert r["expert_bytes_planned"] < r["full_expert_bytes"]


def torch_equal(a, b) -> bool:
    return a.dtype == b.dtype and bool((a == b).all())


def test_expert_stored_in_another_dtype_is_costed_and_merged_in_its_own(bf16_family, tmp_path, session_catalog):
    """Dtypes may differ across the family: an fp32 expert beside a bf16 base costs 4 bytes per
    element and is read as fp32."""
    tensors = load_model(bf16_family.experts[0])
    g = torch.Generator().manual_seed(5)
    wide = {
        k: (v.float() + 1e-5 * torch.randn(v.shape, generator=g)) if v.is_floating_point() and v.dim() == 2 else v
        for k, v in tensors.items()
    }
    write_model(tmp_path / "wide", wide, shards=1, sidecars=False)
    fam = FamilyPaths(bf16_family.base, [tmp_path / "wide", bf16_family.experts[2]])
    cfg = config_for(tmp_path, fam, "task_arithmetic", weights=[0.6, 0.4])
    r = merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    expected = reference_merge("task_arithmetic", fam.base, fam.experts, [0.6, 0.4])
    assert_bit_identical(tmp_path / "out", expected)
    access = pq.read_table(tmp_path / "out" / "mergepipe-access.parquet").to_pylist()
    wide_bytes = sum(a["bytes"] for a in access if a["expert"] == 0)
    assert wide_bytes == sum(v.numel() * 4 for v in wide.values() if v.is_floating_point() and v.dim() == 2)
    assert r["expert_bytes_read"] == r["expert_bytes_planned"]


def test_config_dtype_rounds_inputs_and_sets_the_output_dtype(fp32_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, fp32_family, "task_arithmetic", weights=[1.0, 0.5, 0.5], dtype="bfloat16")
    merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    expected = reference_merge(
        "task_arithmetic", fp32_family.base, fp32_family.experts, [1.0, 0.5, 0.5], compute_dtype=torch.bfloat16
    )
    assert_bit_identical(tmp_path / "out", expected)


def test_max_error_target_is_met_and_holds(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic", out_dtype="float32")
    full = merge(config=str(cfg), out=str(tmp_path / "full"), catalog=session_catalog)
    loose = merge(config=str(cfg), out=str(tmp_path / "loose"), budget="10%", catalog=session_catalog)
    target = loose["error_bound"] / 2
    r = merge(config=str(cfg), out=str(tmp_path / "target"), max_error=target, catalog=session_catalog)
    assert 0 < r["error_bound"] <= target
    assert loose["expert_bytes_planned"] < r["expert_bytes_planned"] < full["expert_bytes_planned"]
    assert r["expert_bytes_read"] == r["expert_bytes_planned"]
    err = frobenius_diff(load_model(tmp_path / "target"), load_model(tmp_path / "full"))
    assert err <= r["error_bound"] * (1 + 1e-5) + 1e-6


def test_models_given_as_single_files(bf16_family, tmp_path, session_catalog):
    """A model may be one .safetensors file rather than a folder."""
    single = []
    for i, e in enumerate(bf16_family.experts[:2]):
        write_model(tmp_path / f"single-{i}", load_model(e), shards=1, sidecars=False)
        single.append(tmp_path / f"single-{i}" / "model.safetensors")
    fam = FamilyPaths(bf16_family.base, single)
    cfg = config_for(tmp_path, fam, "task_arithmetic", weights=[0.7, 0.2])
    merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    assert_bit_identical(
        tmp_path / "out", reference_merge("task_arithmetic", fam.base, [p.parent for p in single], [0.7, 0.2])
    )
