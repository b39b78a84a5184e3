"""mergepipe's operators against mergekit 0.1.5's outputs (tests/data/mergekit_parity.*, made
by scripts/mergekit_parity.py with mergekit's in-memory API in its own venv).

Bit-identical in fp32, including DARE and DELLA with mergekit's own masks replayed, except
where an L1 rescale runs: mergepipe sums the norms in fp64 (thread-count independent), mergekit
in fp32, so outputs may differ there by a few ulps of the tensor's magnitude (at most 4)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mergepipe.operators import OPERATORS, MergeParams, TensorContext
from mergepipe.operators.nuslerp import nuslerp, nuslerp_t
from mergepipe.operators.sparsify import della_keep_probs

DATA = Path(__file__).parent / "data"
RECORDS = json.loads((DATA / "mergekit_parity.json").read_text())
CASES = [c for c in RECORDS if not c.get("sampled")]  # inputs and output stored
SAMPLED = [c for c in RECORDS if c.get("sampled")]  # made again from a seed, output as a digest
TENSORS = load_file(str(DATA / "mergekit_parity.safetensors"))


def _params(case: dict, op) -> MergeParams:
    p = case["resolved_parameters"]
    k = case["n_experts"]
    weights = list(p.get("weight", [1.0] * k))
    base_weight = None
    if case["method"] == "linear" and "base" in case["inputs"]:  # the base as a weighted input
        base_weight = weights.pop(case["inputs"].index("base"))
    if case["method"] == "passthrough":  # the base is the one input, with its own scale
        scale = p["scale"][0]
        return op.params(0, None if scale is None else {"scale": scale})
    values = {
        "weight": tuple(weights),
        "density": tuple(p.get("density", [1.0] * k)),
        "lambda_": p.get("lambda", 1.0),
        "gamma": tuple(p.get("gamma", [])),
        # per model for della (a list), one value for ram and ramplus_tl
        "epsilon": p["epsilon"] if isinstance(p.get("epsilon"), float) else tuple(p.get("epsilon", [])),
        **{
            name: p[name]
            for name in (
                "normalize",
                "rescale",
                "t",
                "filter_wise",
                "nuslerp_flatten",
                "nuslerp_row_wise",
                "r",
                "alpha",
                "max_iter",
                "tol",
                "normalize_weights",
                "eps",
                "select_topk",
            )
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


def test_multislerp_where_no_expert_changed_the_tensor_is_the_base():
    """Deliberately unlike mergekit, which stops with an error there (three or more experts);
    directions that cancel out while the deltas do not are still refused, naming the tensor."""
    from mergepipe.errors import BadInput

    op = OPERATORS["multislerp"]
    base = torch.randn(4, 6)
    params = op.params(3, weight=(1.0, 1.0, 1.0))
    ctx = TensorContext("model.norm.weight", ((0, 4),), seed=0)
    got = op.merge(base, [base.clone(), base.clone(), base.clone()], params, ctx)
    assert torch.equal(got, base)
    zero, delta = torch.zeros(4, 6), torch.randn(4, 6)  # a zero base: the deltas are exact
    with pytest.raises(BadInput, match="model.norm.weight: multislerp: .* cancel out"):
        op.merge(zero, [delta, -delta, zero.clone()], op.params(3, weight=(1.0, 1.0, 0.5)), ctx)


def test_karcher_max_iter_is_a_whole_number(tmp_path):
    from mergepipe.config.spec import load_spec
    from mergepipe.errors import BadInput

    cfg = tmp_path / "k.yaml"
    cfg.write_text("merge_method: karcher\nbase_model: b\nmodels: [{model: a}]\nparameters: {max_iter: 2.5}\n")
    with pytest.raises(BadInput, match="max_iter.*whole number"):
        load_spec(cfg)


def _parity_script():
    """scripts/mergekit_parity.py as a module, for the inputs it makes from a seed (it imports
    mergekit only inside the functions that run it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "mergekit_parity", Path(__file__).parent.parent / "scripts" / "mergekit_parity.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", SAMPLED, ids=[c["case"] for c in SAMPLED])
def test_arcee_fusion_above_a_million_elements_matches_mergekit_with_its_draws_replayed(case):
    """mergekit reads the quartiles off positions drawn from torch's global generator right
    after the seed it ran under; the same draw, replayed, gives its output bit for bit. The
    seeded draw mergepipe makes itself repeats from merge to merge."""
    script = _parity_script()
    base, x = script.sampled_inputs(tuple(case["shape"]), case["inputs_seed"])
    assert script.bits_sha256(base, x) == case["inputs_sha256"]
    op = OPERATORS[case["method"]]

    def mergekits_draw(n: int, size: int, ctx: TensorContext) -> torch.Tensor:
        torch.manual_seed(case["rng_seed"])
        return torch.randint(n, (size,))

    ctx = TensorContext("model.layers.0.mlp.up_proj.weight", ((0, case["shape"][0]),), seed=0)
    replayed = dataclasses.replace(ctx, sample=mergekits_draw)
    assert script.bits_sha256(op.merge(base, [x], op.params(1), replayed)) == case["out_sha256"]
    ours = op.merge(base, [x], op.params(1), ctx)
    assert torch.equal(ours, op.merge(base, [x], op.params(1), ctx))
