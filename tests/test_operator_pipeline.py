"""The operators added for mergekit compatibility, end to end through a config: at full budget
the output equals the operator applied to whole tensors read with safetensors; under a budget
the merge runs and says its bound is not guaranteed."""

from __future__ import annotations

import pytest
import torch
import yaml

from mergepipe.config.spec import load_spec
from mergepipe.devtools.synthetic import make_family
from mergepipe.flows.merge import merge
from mergepipe.flows.replay import replay
from mergepipe.index.blocks import block_rows
from mergepipe.operators import OPERATORS, TensorContext
from mergepipe.plan.params import resolve_params
from mergepipe.publish.manifest import MANIFEST_FILE, verify_output

from .helpers import assert_bit_identical
from .reference import load_model

CASES = {
    "breadcrumbs": ({"density": 0.8, "gamma": 0.05}, 3, {}),
    "breadcrumbs_ties": ({"density": 0.8, "gamma": 0.05}, 3, {}),
    "della": ({"density": 0.5, "epsilon": 0.1}, 3, {}),
    "della_linear": ({"density": 0.5, "epsilon": 0.1}, 3, {}),
    "model_stock": ({}, 3, {"filter_wise": True}),
    "slerp": ({}, 1, {"t": 0.3}),
    "nuslerp": ({}, 2, {"nuslerp_flatten": False}),
    "nearswap": ({}, 1, {"t": 0.001}),
    "ram": ({}, 3, {"epsilon": 0.001}),
    "ramplus_tl": ({}, 3, {"r": 0.3, "alpha": 0.5}),
    "karcher": ({}, 3, {}),
    "multislerp": ({}, 3, {"normalize_weights": False}),
    "sce": ({}, 3, {"select_topk": 0.5}),
    "arcee_fusion": ({}, 1, {}),
}


@pytest.fixture(scope="module")
def fp32_three(tmp_path_factory):
    root = tmp_path_factory.mktemp("ops")
    return make_family(
        root / "fam",
        experts=("dense", "dense", "lora"),
        n_layers=2,
        hidden=32,
        intermediate=64,
        vocab=64,
        dtype="float32",
        shards=2,
        seed=5,
    )


@pytest.mark.parametrize("method", sorted(CASES))
def test_new_operator_end_to_end(method, fp32_three, tmp_path, session_catalog):
    per_model, k, shared = CASES[method]
    fam = type(fp32_three)(fp32_three.base, fp32_three.experts[:k])
    weights = [0.6, 0.9, 0.4][:k]
    takes_weight = OPERATORS[method].declared("weight") is not None
    models = [
        {"model": str(e), "parameters": {**per_model, **({"weight": w} if takes_weight else {})}}
        for e, w in zip(fam.experts, weights)
    ]
    cfg = tmp_path / "m.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "merge_method": method,
                "base_model": str(fam.base),
                "models": models,
                "parameters": shared,
                "block_size": "2KiB",
            }
        )
    )
    full = merge(config=str(cfg), out=str(tmp_path / "full"), budget="100%", catalog=session_catalog)
    assert full["bound_guaranteed"] is False

    spec = load_spec(cfg)
    op, params = OPERATORS[method], resolve_params(spec)
    base, experts = load_model(fam.base), [load_model(e) for e in fam.experts]
    expected = {}
    for name, b in base.items():
        if not b.is_floating_point():
            expected[name] = b
            continue
        ctx = TensorContext(name, tuple(block_rows(tuple(b.shape), b.element_size(), 2048)), spec.seed)
        expected[name] = op.merge(b, [e[name] for e in experts], params, ctx).to(b.dtype)
    assert_bit_identical(tmp_path / "full", expected)

    part = merge(config=str(cfg), out=str(tmp_path / "part"), budget="30%", catalog=session_catalog)
    assert part["expert_bytes_read"] <= 0.3 * part["full_expert_bytes"]
    assert torch.isfinite(
        torch.cat([t.reshape(-1) for t in load_model(tmp_path / "part").values() if t.is_floating_point()])
    ).all()
    # The manifest replays the partial merge to the same digest.
    again = replay(
        manifest=str(tmp_path / "part" / MANIFEST_FILE), out=str(tmp_path / "again"), catalog=session_catalog
    )
    assert again["digest"] == part["digest"] and verify_output(tmp_path / "again").ok
