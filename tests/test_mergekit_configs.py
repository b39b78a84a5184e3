"""mergekit configs as they are: filters and gradients resolved per tensor, the base listed among
the models, linear without a base, and the keys mergepipe refuses by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mergepipe.config.settings import evaluate, parse_setting
from mergepipe.config.spec import load_spec
from mergepipe.errors import BadInput
from mergepipe.index.blocks import layer_count, layer_position
from mergepipe.plan.params import resolve_params, resolve_tensor_params


def test_gradient_is_piecewise_linear_over_layer_position():
    s = parse_setting([0, 0.3, 0.7, 1], "float")
    assert s == [0.0, 0.3, 0.7, 1.0]
    # Four layers: t = 0, 1/3, 2/3, 1 land on the entries.
    assert [evaluate(s, "x", i / 3) for i in range(4)] == [0.0, 0.3, 0.7, 1.0]
    # Between entries: (1 - frac) * v[i0] + frac * v[i1], as mergekit computes it in float64.
    assert evaluate([1.0, 0.7, 0.1], "x", 0.25) == (1 - 0.5) * 1.0 + 0.5 * 0.7
    t = 0.9
    scaled = t * 2
    assert evaluate([1.0, 0.7, 0.1], "x", t) == (1 - (scaled - 1)) * 0.7 + (scaled - 1) * 0.1
    # A list of booleans selects values[int(t * (n - 1))].
    assert [evaluate([True, False, True], "x", t) for t in (0, 0.49, 0.5, 0.99, 1)] == [True, True, False, False, True]


def test_filters_first_match_catch_all_and_fall_through():
    s = parse_setting([{"filter": "mlp", "value": 0.5}, {"filter": "self_attn", "value": [0, 1]}], "float")
    assert evaluate(s, "model.layers.3.mlp.up_proj.weight", 0.3) == 0.5
    assert evaluate(s, "model.layers.3.self_attn.q_proj.weight", 0.25) == 0.25
    assert evaluate(s, "model.norm.weight", 0.0) is None  # no match: the caller falls through
    s = parse_setting([{"filter": "mlp", "value": 0.5}, {"filter": "*", "value": 2}, {"value": 3}], "float")
    assert evaluate(s, "lm_head.weight", 0) == 2.0
    assert evaluate(parse_setting({"value": 7}, "float"), "a", 0) == 7.0  # a single condition
    # Substring, not regex: "layers.1." hits layer 1 only.
    s = parse_setting([{"filter": "layers.1.", "value": 1}, {"value": 0}], "float")
    assert [evaluate(s, f"model.layers.{i}.mlp.w", 0) for i in (1, 10, 11)] == [1.0, 0.0, 0.0]
    # An empty tensor name matches only catch-alls (mergekit's `tensor_name and ...`).
    assert evaluate(parse_setting([{"filter": "", "value": 1}], "float"), "", 0) is None


def test_settings_are_checked_leaf_by_leaf():
    assert parse_setting("1e-3", "float") == 0.001  # YAML reads 1e-3 as a string
    for raw, kind, msg in [
        (True, "float", "expected a number"),
        ("x", "float", "expected a number"),
        (0.5, "bool", "expected true or false"),
        ([], "float", "empty list"),
        ([0.5, {"value": 1}], "float", "mixes conditions"),
        ([{"filter": 3, "value": 1}], "float", "filter"),
        ([{"filter": "a"}], "float", "value: required"),
        (float("nan"), "float", "finite"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_setting(raw, kind)


def test_layer_position_as_mergekit():
    names = [f"model.layers.{i}.mlp.w" for i in range(4)] + ["model.embed_tokens.weight", "lm_head.weight"]
    n = layer_count(names)
    assert n == 4
    assert [layer_position(f"model.layers.{i}.mlp.w", n) for i in range(4)] == [0, 1 / 3, 2 / 3, 1]
    assert layer_position("model.embed_tokens.weight", n) == layer_position("lm_head.weight", n) == 0
    assert layer_position("model.layers.0.mlp.w", 1) == 1.0  # one layer: t = 1


def _spec(tmp_path, doc: dict):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(doc))
    return load_spec(p)


def test_precedence_model_then_global_then_default(tmp_path):
    spec = _spec(
        tmp_path,
        {
            "merge_method": "ties",
            "base_model": "b",
            "models": [
                {"model": "e0", "parameters": {"weight": [{"filter": "mlp", "value": 0.5}], "density": [1, 0.5]}},
                {"model": "e1", "parameters": {"weight": 1.0}},
            ],
            "parameters": {"weight": 0.25, "normalize": [{"filter": "norm", "value": False}], "lambda": [1, 2]},
        },
    )
    mlp = resolve_params(spec, "model.layers.1.mlp.up_proj.weight", 1.0)
    attn = resolve_params(spec, "model.layers.1.self_attn.q_proj.weight", 0.5)
    norm = resolve_params(spec, "model.norm.weight", 0.0)
    assert mlp["weight"] == (0.5, 1.0) and attn["weight"] == (0.25, 1.0)  # no match: the global weight
    assert mlp["density"] == (0.5, 1.0) and attn["density"] == (0.75, 1.0) and norm["density"] == (1.0, 1.0)
    assert mlp["lambda"] == 2.0 and attn["lambda"] == 1.5 and norm["lambda"] == 1.0
    assert mlp["normalize"] is True and norm["normalize"] is False  # ties' default, then the filter


def test_param_table_lists_only_exceptions(tmp_path):
    spec = _spec(
        tmp_path,
        {
            "merge_method": "task_arithmetic",
            "base_model": "b",
            "models": [{"model": "e0", "parameters": {"weight": [{"filter": "layers.1.", "value": 2}, {"value": 1}]}}],
        },
    )
    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.mlp.w" for i in range(3)]
    table = resolve_tensor_params(spec, names)
    assert [p["weight"] for p in table.sets] == [(1.0,), (2.0,)]
    assert table.by_tensor == {"model.layers.1.mlp.w": 1}
    assert table.for_tensor("model.layers.1.mlp.w")["weight"] == (2.0,)
    assert type(table).from_json(table.as_json()) == table


def test_base_among_models(tmp_path):
    base_and_two = [
        {"model": "b", "parameters": {"weight": 0.2}},
        {"model": "e0", "parameters": {"weight": 0.5}},
        {"model": "e1", "parameters": {"weight": 0.3}},
    ]
    # GTA: the base's entry is not an expert and its parameters do not count.
    spec = _spec(tmp_path, {"merge_method": "task_arithmetic", "base_model": "b", "models": base_and_two})
    assert spec.expert_uris == [str(tmp_path / "e0"), str(tmp_path / "e1")]
    assert resolve_params(spec)["weight"] == (0.5, 0.3) and resolve_params(spec).base_value("weight") is None
    assert [m["model"] for m in spec.content()["models"]] == ["base", "expert-0", "expert-1"]
    # linear: the base is a weighted input.
    spec = _spec(tmp_path, {"merge_method": "linear", "base_model": "b", "models": base_and_two})
    assert resolve_params(spec).base_value("weight") == 0.2
    # linear, base not listed: weighted by a global weight if there is one (mergekit adds it as
    # an input), otherwise not an input.
    two = base_and_two[1:]
    assert (
        resolve_params(_spec(tmp_path, {"merge_method": "linear", "base_model": "b", "models": two})).base_value(
            "weight"
        )
        is None
    )
    spec = _spec(tmp_path, {"merge_method": "linear", "base_model": "b", "models": two, "parameters": {"weight": 0.1}})
    assert resolve_params(spec).base_value("weight") == 0.1
    # linear without a base: the first model is the reference, with its own weight.
    spec = _spec(
        tmp_path,
        {"merge_method": "linear", "models": base_and_two[1:] + [{"model": "e2", "parameters": {"weight": 1}}]},
    )
    assert spec.base_model == str(tmp_path / "e0") and len(spec.expert_uris) == 2
    p = resolve_params(spec)
    assert p.base_value("weight") == 0.5 and p["weight"] == (0.3, 1.0)
    with pytest.raises(BadInput, match="base_model"):
        _spec(tmp_path, {"merge_method": "ties", "models": two})


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("modules", {"text": {}}, "modules: not supported"),
        ("tokenizer_source", "org/other-model", "tokenizer_source: 'org/other-model' is not among the merge's models"),
        ("tokenizer", {"source": "org/x"}, "tokenizer.source: 'org/x' is not among the merge's models"),
        (
            "tokenizer",
            {"source": "union", "tokens": {"<t>": {"source": "org/x"}}},
            "tokenizer.tokens.<t>.source: 'org/x'",
        ),
        ("tokenizer", {"source": "union", "pad_to_multiple_of": 0}, "pad_to_multiple_of"),
        (
            "tokenizer",
            {"source": "union", "tokens": {"<t>": {"source": {"kind": "one"}}}},
            "kind: `zero` or `model_token`",
        ),
        ("tokenizer", {"source": "union", "extra": 1}, "extra"),
    ],
)
def test_unsupported_mergekit_keys_are_refused_by_name(tmp_path, key, value, match):
    doc = {
        "merge_method": "task_arithmetic",
        "base_model": "b",
        "models": [{"model": "e", "parameters": {"weight": 1}}],
    }
    _spec(tmp_path, {**doc, "tokenizer_source": "base"})  # accepted
    with pytest.raises(BadInput, match=match):
        _spec(tmp_path, {**doc, key: value})


def _expected_per_tensor(spec, base_dir, expert_dirs, block_size):
    """The operator applied to whole tensors, with each tensor's own resolved parameters."""
    from mergepipe.index.blocks import block_rows
    from mergepipe.operators import OPERATORS, TensorContext

    from .reference import load_model

    op = OPERATORS[spec.merge_method]
    base, experts = load_model(base_dir), [load_model(e) for e in expert_dirs]
    n = layer_count(base)
    out = {}
    for name, b in base.items():
        if not b.is_floating_point():
            out[name] = b
            continue
        params = resolve_params(spec, name, layer_position(name, n))
        ctx = TensorContext(name, tuple(block_rows(tuple(b.shape), b.element_size(), block_size)), spec.seed)
        out[name] = op.merge(b.float(), [e[name].float() for e in experts], params, ctx)
    return out


def test_filters_and_gradients_end_to_end_with_a_bound_that_holds(bf16_family, tmp_path, session_catalog):
    import pyarrow.parquet as pq

    from mergepipe.flows.merge import merge
    from mergepipe.flows.replay import replay
    from mergepipe.publish.manifest import MANIFEST_FILE

    from .helpers import assert_bit_identical, frobenius_diff
    from .reference import load_model

    e0, e1, e2 = map(str, bf16_family.experts)
    doc = {
        "merge_method": "task_arithmetic",
        "base_model": str(bf16_family.base),
        "models": [
            {"model": str(bf16_family.base)},  # as mergekit's examples list it: no effect here
            {"model": e0, "parameters": {"weight": [0.2, 1.0]}},
            {
                "model": e1,
                "parameters": {"weight": [{"filter": "mlp", "value": 0}, {"filter": "self_attn", "value": [1, 0.5]}]},
            },
            {"model": e2, "parameters": {"weight": 0.8}},
        ],
        "parameters": {"weight": 0.4, "lambda": [1, 0.5]},
        "out_dtype": "float32",
        "block_size": "4KiB",
        "out_shard_size": "64KB",
    }
    cfg = tmp_path / "m.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    spec = load_spec(cfg)
    full = merge(config=str(cfg), out=str(tmp_path / "full"), budget="100%", catalog=session_catalog)
    assert full["error_bound"] == 0.0
    expected = _expected_per_tensor(spec, bf16_family.base, bf16_family.experts, 4096)
    assert_bit_identical(tmp_path / "full", expected)
    # The filters and gradients made the parameters differ across tensors.
    assert len(resolve_tensor_params(spec, expected).sets) > 3

    part = merge(config=str(cfg), out=str(tmp_path / "part"), budget="25%", catalog=session_catalog)
    assert part["bound_guaranteed"] and part["expert_bytes_read"] <= part["budget_bytes"]
    err = frobenius_diff(load_model(tmp_path / "part"), load_model(tmp_path / "full"))
    assert 0 < err <= part["error_bound"] * (1 + 1e-5) + 1e-6
    # Expert 1 weighs 0 on the MLPs: those pairs cannot change the output, so not even the full
    # budget reads them (and the full merge above is still bit-identical).
    for out in ("full", "part"):
        access = pq.read_table(tmp_path / out / "mergepipe-access.parquet").to_pylist()
        assert any(a["expert"] == 1 for a in access)
        assert not [a for a in access if a["expert"] == 1 and ".mlp." in a["tensor"]], out
    assert full["expert_bytes_planned"] < full["full_expert_bytes"]
    # The manifest replays the per-tensor parameters bit for bit.
    again = replay(
        manifest=str(tmp_path / "part" / MANIFEST_FILE), out=str(tmp_path / "again"), catalog=session_catalog
    )
    assert again["digest"] == part["digest"]
    assert_bit_identical(tmp_path / "again", load_model(tmp_path / "part"))


E2E = Path(__file__).parent / "data" / "mergekit_e2e"
E2E_CASES = json.loads((E2E / "cases.json").read_text())["cases"]


@pytest.mark.parametrize("case", [c for c in E2E_CASES if c["case"] != "ties"], ids=lambda c: c["case"])
def test_mergekit_configs_run_unchanged_and_give_mergekit_bytes(case, tmp_path, session_catalog):
    """mergekit-yaml's own outputs (scripts/mergekit_e2e.py) on a tiny Llama family whose
    models sit at the Hugging Face ids of mergekit's examples, relative to the configs: fp32,
    filters, gradients, the base listed among the models, linear with and without a base.
    mergekit's bits depend on the CPU's kernels and mergepipe's do not: each tensor within
    MERGEKIT_ULPS of mergekit's (LoRA too: PEFT's B @ A sums in the order torch's kernel picks,
    mergepipe rank by rank), and mergepipe's own output pinned by its digest."""
    from mergepipe.flows.merge import merge

    from .helpers import assert_close_to_mergekit
    from .reference import load_model
    from .test_mergekit_parity import pinned

    done = merge(config=str(E2E / case["config"]), out=str(tmp_path / "out"), catalog=session_catalog)
    assert done["digest"] == pinned(case["case"], "mergekit_e2e")
    want, got = load_file(E2E / case["expected"]), load_model(tmp_path / "out")
    assert sorted(got) == sorted(want)
    if case["case"] == "arcee_fusion":
        # These deltas are a fine-tune's: mergekit's fp32 KL divergence lies below fp32's
        # resolution, so its keep decisions are rounding noise, which changes with the CPU
        # (operators/arcee_fusion.py). Each element is the base's or the expert's; the
        # decisions are compared with mergekit's where the divergence is resolved, in
        # test_mergekit_parity; the bytes are pinned above.
        config = yaml.safe_load((E2E / case["config"]).read_text())
        base, x = (load_model(E2E / m) for m in (config["base_model"], config["models"][0]["model"]))
        for name, w in want.items():
            assert bool(((got[name] == base[name]) | (got[name] == x[name])).all()), name
        return
    for name, w in want.items():
        assert_close_to_mergekit(got[name], w, name)


def test_multislerp_without_a_base_merges_every_model_and_replays(tmp_path, session_catalog):
    """mergekit's multislerp base is optional: without one the first model is an input too and
    nothing is subtracted (the fixture above pins the bytes). That is recorded with the spec, so
    it is not the digest of naming the first model as the base, and a replay merges the same way."""
    from mergepipe.flows.merge import merge
    from mergepipe.flows.replay import replay
    from mergepipe.storage.model_files import MANIFEST_FILE

    from .helpers import assert_bit_identical, assert_close_to_mergekit
    from .reference import load_model

    config = yaml.safe_load((E2E / "multislerp_no_base.yml").read_text())
    for entry in config["models"]:
        entry["model"] = str(E2E / entry["model"])
    (tmp_path / "implicit.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "named.yml").write_text(yaml.safe_dump({**config, "base_model": config["models"][0]["model"]}))
    implicit, named = load_spec(tmp_path / "implicit.yml"), load_spec(tmp_path / "named.yml")
    assert implicit.implicit_base and implicit.base_model == named.base_model and not named.implicit_base
    assert implicit.content() != named.content()
    a = merge(config=str(tmp_path / "implicit.yml"), out=str(tmp_path / "a"), catalog=session_catalog)
    again = replay(manifest=str(tmp_path / "a" / MANIFEST_FILE), out=str(tmp_path / "b"), catalog=session_catalog)
    assert again["digest"] == a["digest"]
    assert_bit_identical(tmp_path / "b", load_model(tmp_path / "a"))
    want = load_file(E2E / "expected" / "multislerp_no_base.safetensors")
    for name, w in want.items():
        assert_close_to_mergekit(load_model(tmp_path / "b")[name], w, name)


def test_mergekit_ties_example_verbatim(tmp_path, session_catalog):
    """mergekit's examples/ties.yml as published (dtype float16). mergekit computes in float16;
    mergepipe rounds the inputs to float16 and computes in fp32. Most elements agree to within a
    few float16 ulps; where the rounded deltas move an element across TIES' magnitude threshold
    it is kept by one and dropped by the other (measured: 29 of 12432 elements, a relative
    deviation of 2.7e-4 of the weights)."""
    from mergepipe.flows.merge import merge

    from .helpers import frobenius_diff
    from .reference import load_model

    r = merge(config=str(E2E / "ties.yml"), out=str(tmp_path / "out"), catalog=session_catalog)
    got, want = load_model(tmp_path / "out"), load_file(E2E / "expected" / "ties.safetensors")
    assert sorted(got) == sorted(want)
    far, total = 0, 0
    for name, w in want.items():
        assert got[name].dtype == w.dtype == torch.float16, name
        ulp = torch.finfo(torch.float16).eps * w.float().abs().clamp(min=2.0**-14)
        far += int(((got[name].float() - w.float()).abs() > 4 * ulp).sum())
        total += w.numel()
    assert far <= 0.005 * total, (far, total)
    norm = frobenius_diff(want, {n: torch.zeros_like(w) for n, w in want.items()})
    assert frobenius_diff(got, want) <= 1e-3 * norm
    # Weight 0 (WizardMath outside the MLPs; Platypus at layer 0 and outside the layers) means
    # those blocks are never read, even at full budget.
    assert r["expert_bytes_planned"] < r["full_expert_bytes"]


ROOT = Path(__file__).parent.parent


def test_docs_match_the_code(tmp_path):
    """README's config and search examples are valid, and docs/operators.md lists every
    operator with the bound the code reports for it."""
    import re

    from mergepipe.config.spec import check_parameters
    from mergepipe.operators import OPERATORS

    readme = (ROOT / "README.md").read_text()
    example = re.search(r"```yaml\n(merge_method:.*?)```", readme, re.S).group(1)
    (tmp_path / "c.yaml").write_text(example)
    check_parameters(load_spec(tmp_path / "c.yaml"))
    # and the merge search's example (config.search.load_search checks each end of each range)
    from mergepipe.config.search import load_search

    search = re.search(r"```yaml\n# search\.yml\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "search.yml").write_text(search)
    assert len(load_search(tmp_path / "search.yml").params) == 4

    rows = re.findall(
        r"^\| `(\w+)` \|.*\| (guaranteed|heuristic|none claimed) \|$",
        (ROOT / "docs" / "operators.md").read_text(),
        re.M,
    )
    assert sorted(name for name, _ in rows) == sorted(OPERATORS)
    for name, bound in rows:
        assert (bound == "guaranteed") == OPERATORS[name].additive, name
