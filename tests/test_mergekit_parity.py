"""mergepipe's operators against mergekit 0.1.5's outputs (tests/data/mergekit_parity.*, made
by scripts/mergekit_parity.py with mergekit's in-memory API in its own venv).

mergekit's bits depend on the CPU's float kernels (it uses torch's as they come: fused
multiply-adds in addcmul on AVX, reductions grouped by SIMD width, SLEEF's or the C library's exp
and sin); mergepipe's do not (operators/reductions.py, operators/elementary.py). So each output
is compared with mergekit's within PARITY_ULPS ulps of the case's magnitude (DARE and DELLA with
mergekit's own masks replayed), and mergepipe's own bytes are pinned by digests
(tests/data/pinned_digests.json, recorded under every kernel set this machine has by
scripts/pin_digests.py, which refuses to write them unless all agree). arcee_fusion's
keep decision hangs on a KL divergence of two nearly equal softmaxes, which a last-bit change
moves by percents: its decisions must agree with mergekit's wherever the score lies clear of the
threshold."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mergepipe.operators import OPERATORS, MergeParams, TensorContext
from mergepipe.operators.arcee_fusion import threshold
from mergepipe.operators.nuslerp import nuslerp, nuslerp_t
from mergepipe.operators.sparsify import della_keep_probs

DATA = Path(__file__).parent / "data"
RECORDS = json.loads((DATA / "mergekit_parity.json").read_text())
CASES = [c for c in RECORDS if not c.get("sampled")]  # inputs and output stored
SAMPLED = [c for c in RECORDS if c.get("sampled")]  # made again from a seed, output as a digest
TENSORS = load_file(str(DATA / "mergekit_parity.safetensors"))


def bits_sha256(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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


def merged(case: dict) -> torch.Tensor:
    """mergepipe's output for a stored case (the same call for the parity and the digests)."""
    name = case["case"]
    experts = [TENSORS[f"{name}/x{i}"] for i in range(case["n_experts"])]
    op = OPERATORS[case["method"]]
    params = _params(case, op)
    if case["method"] == "nuslerp" and case["base_index"] is None:
        # mergepipe always has a base; the kernel is the same one.
        return nuslerp(
            nuslerp_t(params["weight"]),
            experts[0],
            experts[1],
            flatten=params["nuslerp_flatten"],
            row_wise=params["nuslerp_row_wise"],
        )
    base = TENSORS[f"{name}/base"]
    ctx = TensorContext(name, ((0, base.shape[0] if base.dim() else 1),), seed=0)
    if case["masks"]:
        ctx = TensorContext(name, ctx.block_rows, 0, keep=_replay(case))
    return op.merge(base, experts, params, ctx)


PARITY_ULPS = 4
DIGESTS_FILE = DATA / "pinned_digests.json"  # read by the tests, written by scripts/pin_digests.py


def pinned(case: str, part: str = "operators") -> str:
    return json.loads(DIGESTS_FILE.read_text())[part][case]


def _scale(case: dict, expected: torch.Tensor) -> float:
    """The case's magnitude: the largest input or output element (an output may cancel to much
    less than its inputs, so the tolerance is not relative per element)."""
    name = case["case"]
    inputs = [TENSORS[f"{name}/x{i}"] for i in range(case["n_experts"])]
    if f"{name}/base" in TENSORS:
        inputs.append(TENSORS[f"{name}/base"])
    return max([float(t.abs().max()) for t in [*inputs, expected] if t.numel()] or [1.0])


def mergekit_arcee_importance(params: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """mergekit 0.1.5's arcee_fusion importance, in its torch operations (this machine's kernels)."""
    diff = (params - base).abs()
    p = torch.nn.functional.softmax(params, dim=-1) + 1e-8
    q = torch.nn.functional.softmax(base, dim=-1) + 1e-8
    return diff * torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)


def assert_arcee_decisions_agree(got, theirs, base, x, scores, threshold, margin=0.25):
    """Each element is the base's or the expert's, and the choice is mergekit's wherever the
    score (mergekit's, as torch computes it here) lies more than `margin` of the threshold
    away from it."""
    assert bool(((got == base) | (got == x)).all())
    clear = (scores - threshold).abs() > margin * threshold.abs()
    assert bool(clear.float().mean() > 0.75)  # most decisions are checked
    assert torch.equal((got == x)[clear], (theirs == x)[clear])


@pytest.mark.parametrize("case", CASES, ids=[c["case"] for c in CASES])
def test_operator_matches_mergekit(case):
    name = case["case"]
    expected = TENSORS[f"{name}/out"]
    got = merged(case)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if case["method"] == "arcee_fusion":
        base, x = TENSORS[f"{name}/base"], TENSORS[f"{name}/x0"]
        scores = mergekit_arcee_importance(x, base)
        ctx = TensorContext(name, ((0, base.shape[0]),), seed=0)
        assert_arcee_decisions_agree(got, expected, base, x, scores, threshold(scores, ctx))
        return
    limit = PARITY_ULPS * torch.finfo(torch.float32).eps * _scale(case, expected)
    assert float((got - expected).abs().max()) <= limit if got.numel() else True, name


@pytest.mark.parametrize("case", CASES, ids=[c["case"] for c in CASES])
def test_operator_bytes_are_pinned(case):
    """mergepipe's own output, as recorded under every kernel set: the same bits on any CPU."""
    assert bits_sha256(merged(case)) == pinned(case["case"])


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


def sampled_inputs(shape: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A base and an expert above a million elements, the same bits under every kernel set
    (torch.rand is; torch.randn is not)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(shape, generator=g) * 2 - 1
    return base, base + (torch.rand(shape, generator=g) - 0.5) * 0.02


@pytest.mark.parametrize("case", SAMPLED, ids=[c["case"] for c in SAMPLED])
def test_arcee_fusion_above_a_million_elements_matches_mergekit_with_its_draws_replayed(case):
    """mergekit reads the quartiles off positions drawn from torch's global generator right
    after the seed it ran under; with the same draw replayed, mergepipe decides as mergekit's
    formula (run here) does wherever the score is clear of the threshold. The seeded draw
    mergepipe makes itself repeats from merge to merge, with pinned bits."""
    base, x = sampled_inputs(tuple(case["shape"]), case["inputs_seed"])
    op = OPERATORS[case["method"]]

    def mergekits_draw(n: int, size: int, ctx: TensorContext) -> torch.Tensor:
        torch.manual_seed(case["rng_seed"])
        return torch.randint(n, (size,))

    ctx = TensorContext("model.layers.0.mlp.up_proj.weight", ((0, case["shape"][0]),), seed=0)
    replayed = dataclasses.replace(ctx, sample=mergekits_draw)
    scores = mergekit_arcee_importance(x, base)
    cut = threshold(scores, replayed)
    theirs = base + (x - base) * (scores >= cut).float()
    assert_arcee_decisions_agree(op.merge(base, [x], op.params(1), replayed), theirs, base, x, scores, cut)
    ours = op.merge(base, [x], op.params(1), ctx)
    assert torch.equal(ours, op.merge(base, [x], op.params(1), ctx))
    assert bits_sha256(ours) == pinned(case["case"])
