"""mergepipe's operators against mergekit 0.1.5's outputs (tests/data/mergekit_parity.*, made
by scripts/mergekit_parity.py with mergekit's in-memory API in its own venv).

Bit-identical in fp32, including DARE and DELLA with mergekit's own masks replayed, except
where an L1 rescale runs: mergepipe sums the norms in fp64 (thread-count independent), mergekit
in fp32, so outputs may differ there by a few ulps of the tensor's magnitude (at most 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mergepipe.operators import OPERATORS, MergeParams, TensorContext
from mergepipe.operators.nuslerp import nuslerp, nuslerp_t
from mergepipe.operators.sparsify import della_keep_probs

DATA = Path(__file__).parent / "data"
CASES = json.loads((DATA / "mergekit_parity.json").read_text())
TENSORS = load_file(str(DATA / "mergekit_parity.safetensors"))


def _params(case: dict, op) -> MergeParams:
    p = case["resolved_parameters"]
    k = case["n_experts"]
    weights = list(p.get("weight", [1.0] * k))
    base_weight = None
    if case["method"] == "linear" and "base" in case["inputs"]:  # the base as a weighted input
        base_weight = weights.pop(case["inputs"].index("base"))
    values = {
        "weight": tuple(weights),
        "density": tuple(p.get("density", [1.0] * k)),
        "lambda_": p.get("lambda", 1.0),
        "gamma": tuple(p.get("gamma", [])),
        "epsilon": tuple(p.get("epsilon", [])),
        **{
            name: p[name]
            for name in ("normalize", "rescale", "t", "filter_wise", "nuslerp_flatten", "nuslerp_row_wise")
            if name in p
        },
    }
    # Each operator takes what it declares; the declared defaults fill the rest.
    return op.params(
        k,
        {"weight": base_weight} if base_weight is not None else None,
        **{n: v for n, v in values.items() if op.declared(n.rstrip("_")) is not None},
    )


def _replay(case: dict):
    masks = {i: TENSORS[f"{case['case']}/mask{i}"].bool() for i in case["mask_experts"]}

    def keep(expert: int, probs: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
        assert probs.shape == masks[expert].shape
        return masks[expert]

    return keep


def _rescaled(case: dict, params: MergeParams, op) -> bool:
    return op.declared("rescale") is not None and params["rescale"] and any(d < 1 for d in params["density"])


@pytest.mark.parametrize("case", CASES, ids=[c["case"] for c in CASES])
def test_operator_matches_mergekit(case):
    name = case["case"]
    expected = TENSORS[f"{name}/out"]
    experts = [TENSORS[f"{name}/x{i}"] for i in range(case["n_experts"])]
    op = OPERATORS[case["method"]]
    params = _params(case, op)
    if case["method"] == "nuslerp" and case["base_index"] is None:
        # mergepipe always has a base; the kernel is the same one.
        got = nuslerp(
            nuslerp_t(params["weight"]),
            experts[0],
            experts[1],
            flatten=params["nuslerp_flatten"],
            row_wise=params["nuslerp_row_wise"],
        )
    else:
        base = TENSORS[f"{name}/base"]
        ctx = TensorContext(name, ((0, base.shape[0] if base.dim() else 1),), seed=0)
        if case["masks"]:
            ctx = TensorContext(name, ctx.block_rows, 0, keep=_replay(case))
        got = op.merge(base, experts, params, ctx)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if _rescaled(case, params, op):
        # Only the rescale factor's rounding differs: a few ulps at the tensor's magnitude
        # (base + delta may cancel to a much smaller output, so not relative per element).
        base = TENSORS[f"{name}/base"]
        scale = float(base.abs().max() + (expected - base).abs().max())
        assert float((got - expected).abs().max()) <= 4 * torch.finfo(torch.float32).eps * scale, name
    else:
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (
            f"{name}: max difference {float((got - expected).abs().max())}"
        )


@pytest.mark.parametrize("case", [c for c in CASES if c["probs"]], ids=lambda c: c["case"])
def test_della_keep_probabilities_match_mergekit(case):
    name = case["case"]
    base = TENSORS[f"{name}/base"]
    for i in case["mask_experts"]:
        tau = TENSORS[f"{name}/x{i}"] - base
        p = case["resolved_parameters"]
        ours = della_keep_probs(tau, p["density"][i], p["epsilon"][i])
        theirs = TENSORS[f"{name}/probs{i}"]
        # mergekit's unstable sort ranks equal magnitudes arbitrarily: compare where no two
        # entries of a row tie (here, wherever the delta is not zero).
        moved = tau != 0
        assert torch.equal(ours[moved], theirs[moved]), name
