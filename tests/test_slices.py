"""`slices:` configs: frankenmerges by passthrough, slices merged with their own layer pairings
and parameters, what they read, and what they refuse. mergekit's own outputs for three such
configs are checked in test_mergekit_configs (the end-to-end cases)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from mergepipe.cli import app
from mergepipe.config.spec import check_parameters, load_spec
from mergepipe.errors import BadInput
from mergepipe.storage.model_files import MANIFEST_FILE

from .helpers import assert_bit_identical, frobenius_diff
from .reference import load_model

E2E = Path(__file__).parent / "data" / "mergekit_e2e"
BASE = str(E2E / "TheBloke" / "Llama-2-13B-fp16")
ORCA = str(E2E / "psmathur" / "orca_mini_v3_13b")
PLATYPUS = str(E2E / "garage-bAInd" / "Platypus2-13B")
WIZARD = str(E2E / "WizardLM" / "WizardMath-13B-V1.0")


def _config(tmp_path: Path, doc: dict, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def _src(model: str, start: int, end: int, **parameters) -> dict:
    return {"model": model, "layer_range": [start, end], **({"parameters": parameters} if parameters else {})}


FRANKEN = {
    "slices": [
        {"sources": [_src(ORCA, 0, 2)]},
        {"sources": [_src(PLATYPUS, 1, 3)]},
        {"sources": [_src(ORCA, 2, 4, scale=[{"filter": "o_proj", "value": 0.5}, {"value": 1.0}])]},
    ],
    "merge_method": "passthrough",
    "dtype": "float32",
}

# Each slice its own sources (expert 0 is orca's layers 0-1, then wizard's 1-2 paired with the
# base's 2-3), the base at another place in the second slice, and slice-level parameters.
PAIRED = {
    "slices": [
        {"sources": [_src(BASE, 0, 2), _src(ORCA, 0, 2, weight=0.7), _src(PLATYPUS, 0, 2, weight=[0.2, 0.6])]},
        {
            "sources": [_src(WIZARD, 1, 3), _src(BASE, 2, 4), _src(PLATYPUS, 2, 4)],
            "parameters": {"weight": 0.4, "lambda": 0.8},
        },
    ],
    "merge_method": "task_arithmetic",
    "base_model": BASE,
    "parameters": {"weight": 0.5},
    "dtype": "float32",
}


def _tensor_bytes(model: str) -> dict[str, int]:
    with safe_open(str(Path(model) / "model.safetensors"), "pt") as f:
        return {n: f.get_tensor(n).nbytes for n in f.keys()}


def test_passthrough_frankenmerge_reads_exactly_what_it_copies(tmp_path, session_catalog):
    """Six layers from two four-layer models: each output tensor is its source's (o_proj of the
    last slice scaled), the config says six layers, and the merge reads the copied tensors and
    nothing else, at any budget."""
    from mergepipe.flows.merge import merge

    cfg = _config(tmp_path, FRANKEN)
    orca, platypus = load_file(Path(ORCA) / "model.safetensors"), load_file(Path(PLATYPUS) / "model.safetensors")
    want = {n: t for n, t in orca.items() if ".layers." not in n}
    sources = [(orca, 0), (orca, 1), (platypus, 1), (platypus, 2), (orca, 2), (orca, 3)]
    for j, (model, i) in enumerate(sources):
        for name, t in model.items():
            if name.startswith(f"model.layers.{i}."):
                scaled = j >= 4 and "o_proj" in name
                want[name.replace(f".layers.{i}.", f".layers.{j}.")] = t * 0.5 if scaled else t
    sizes = {ORCA: _tensor_bytes(ORCA), PLATYPUS: _tensor_bytes(PLATYPUS)}
    copied = {  # orca: everything (layers 0-3 and the rest); platypus: layers 1 and 2
        ORCA: sum(sizes[ORCA].values()),
        PLATYPUS: sum(n for name, n in sizes[PLATYPUS].items() if ".layers.1." in name or ".layers.2." in name),
    }
    for budget in ("5%", None):
        out = tmp_path / f"out-{budget}"
        r = merge(config=str(cfg), out=str(out), budget=budget, catalog=session_catalog)
        assert_bit_identical(out, want)
        assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 6
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(want)
        assert r["expert_bytes_planned"] == 0 and r["error_bound"] == 0
        run = json.loads((out / MANIFEST_FILE).read_text())["run"]
        read = {row["file"]: row["bytes"] for row in run["ledger"] if row["role"] == "base"}
        # The base's view names its home model's (orca's) files as they are, others' in full.
        assert read == {"model.safetensors": copied[ORCA], str(Path(PLATYPUS) / "model.safetensors"): copied[PLATYPUS]}
    assert sum(copied.values()) == sum(t.nbytes for t in want.values())


def test_slices_pair_layers_plan_under_a_budget_and_replay(tmp_path, session_catalog):
    """Each expert's pairing of layers with the base's is indexed once, as its own pair of
    models: a budgeted merge keeps its bound against the full merge (mergekit's bytes), and
    replays to the same digest."""
    from mergepipe.flows.merge import merge
    from mergepipe.flows.replay import replay

    cfg = _config(tmp_path, PAIRED)
    merge(config=str(cfg), out=str(tmp_path / "full"), catalog=session_catalog)
    assert_bit_identical(tmp_path / "full", load_file(E2E / "expected" / "task_arithmetic_slices.safetensors"))
    inputs = json.loads((tmp_path / "full" / MANIFEST_FILE).read_text())["run"]["inputs"]
    assert inputs[0]["uri"] == BASE  # the base's view renames nothing: it is the base itself
    assert inputs[1]["uri"].startswith(ORCA + "#layers=0-2,") and "WizardMath-13B-V1.0:1-3" in inputs[1]["uri"]
    part = merge(config=str(cfg), out=str(tmp_path / "part"), budget="40%", catalog=session_catalog)
    run = json.loads((tmp_path / "part" / MANIFEST_FILE).read_text())["run"]
    assert run["index_bytes"]["index"] == 0 and run["index_bytes"]["expert"] == 0  # indexed once, by the first
    assert 0 < part["expert_bytes_planned"] <= 0.4 * part["full_expert_bytes"]
    err = frobenius_diff(load_model(tmp_path / "part"), load_model(tmp_path / "full"))
    assert 0 < err <= part["error_bound"] * (1 + 1e-5) + 1e-6
    again = replay(
        manifest=str(tmp_path / "part" / MANIFEST_FILE), out=str(tmp_path / "again"), catalog=session_catalog
    )
    assert again["digest"] == part["digest"]
    assert_bit_identical(tmp_path / "again", load_model(tmp_path / "part"))


def test_a_models_config_digests_as_before_slices():
    """The slices key stays out of a `models:` spec's content and record, so its digests hold."""
    from mergepipe.config.spec import validate_spec

    spec = validate_spec(
        {"merge_method": "task_arithmetic", "base_model": "b", "models": [{"model": "e", "parameters": {"weight": 1}}]},
        source="c",
    )
    assert "slices" not in spec.content() and "slices" not in spec.recorded()
    sliced = validate_spec({**PAIRED}, source="c")
    assert "models" not in sliced.content() and sliced.content()["slices"][1]["sources"][1]["model"] == "base"


def _without(doc: dict, key: str) -> dict:
    return {k: v for k, v in doc.items() if k != key}


@pytest.mark.parametrize(
    "doc,match",
    [
        ({**PAIRED, "models": [{"model": ORCA}]}, "either models or slices"),
        (
            {**FRANKEN, "slices": [{"sources": [_src(ORCA, 0, 2)], "residual_weight": 0.5}]},
            "residual_weight: not supported",
        ),
        ({**FRANKEN, "slices": [{"sources": [_src(ORCA, 2, 2)]}]}, "layer_range must be"),
        ({**PAIRED, "slices": [{"sources": [_src(BASE, 0, 2), _src(ORCA, 0, 3)]}]}, "same number of layers"),
        ({**PAIRED, "slices": [{"sources": [_src(BASE, 0, 2), _src(BASE, 2, 4)]}]}, "is a source of this slice twice"),
        (
            {**PAIRED, "slices": [PAIRED["slices"][0], {"sources": [_src(ORCA, 2, 4), _src(PLATYPUS, 2, 4)]}]},
            r"slices\[1\]: its base model .* is not among its sources",
        ),
        ({**FRANKEN, "slices": [{"sources": [_src(ORCA, 0, 2), _src(PLATYPUS, 0, 2)]}]}, "copies one source per slice"),
        (
            {**PAIRED, "slices": [PAIRED["slices"][0], {"sources": [_src(BASE, 2, 4), _src(ORCA, 2, 4)]}]},
            r"slices\[1\]: 1 source\(s\) besides its base, slices\[0\] has 2",
        ),
        (
            {**PAIRED, "slices": [{**PAIRED["slices"][1], "parameters": {"t": 0.5}}]},
            r"slices\[0\]\.parameters\.t: not a parameter of merge_method 'task_arithmetic'",
        ),
        (
            {**PAIRED, "slices": [{"sources": [_src(BASE, 0, 2), _src(ORCA, 0, 2, gamma=0.1)]}]},
            r"slices\[0\]\.sources\[1\]\.parameters\.gamma: not a parameter",
        ),
        (
            {**_without(PAIRED, "parameters"), "slices": [{"sources": [_src(BASE, 0, 2), _src(ORCA, 0, 2)]}]},
            r"slices\[0\]\.sources\[1\]\.parameters\.weight: required",
        ),
    ],
    ids=[
        "both-forms",
        "residual-weight",
        "empty-range",
        "uneven-lengths",
        "model-twice",
        "base-missing",
        "passthrough-two-sources",
        "expert-count",
        "slice-parameter",
        "source-parameter",
        "weight-missing",
    ],
)
def test_slices_refused_naming_the_slice(tmp_path, doc, match):
    from mergepipe.plan.params import resolve_tensor_params

    with pytest.raises(BadInput, match=match):
        spec = load_spec(_config(tmp_path, doc))
        check_parameters(spec)
        resolve_tensor_params(spec, ["model.layers.0.mlp.up_proj.weight"])


def test_a_layer_range_past_the_model_exits_2_naming_it(tmp_path):
    doc = {**FRANKEN, "slices": [{"sources": [_src(ORCA, 0, 2)]}, {"sources": [_src(PLATYPUS, 3, 6)]}]}
    r = CliRunner().invoke(app, ["merge", str(_config(tmp_path, doc)), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    assert "Platypus2-13B" in r.output and "layer_range [3, 6)" in r.output and "4 layers" in r.output
    assert not (tmp_path / "o").exists()


# Output layers 2-3 pair the base's layers 1-2 with the experts' 2-3, and the experts differ by slice.
SHIFTED = [
    {"sources": [_src(BASE, 0, 2), _src(ORCA, 0, 2), _src(PLATYPUS, 0, 2)]},
    {"sources": [_src(ORCA, 2, 4), _src(BASE, 1, 3), _src(WIZARD, 2, 4)], "base_model": BASE},
]
METHODS = {
    "linear": {"weight": 0.6},
    "ties": {"weight": 0.8, "density": 0.5},
    "dare_ties": {"weight": 0.8, "density": 0.7},
    "della": {"weight": 0.7, "density": 0.6, "epsilon": 0.1},
    "breadcrumbs": {"weight": 0.8, "density": 0.8, "gamma": 0.05},
    "model_stock": {},
    "karcher": {},
    "multislerp": {"weight": 0.5},
    "ram": {},
    "sce": {"select_topk": 0.5},
}


def _whole_tensor_merge(spec, block_size: int) -> dict:
    """The operator on whole tensors, each output tensor from its slice's sources at the paired
    layers: the full read the budgeted pipeline must equal at 100%."""
    from mergepipe.index.blocks import block_rows, layer_index, with_layer
    from mergepipe.operators import OPERATORS, TensorContext
    from mergepipe.plan.params import resolve_tensor_params

    op = OPERATORS[spec.merge_method]
    loaded = {m: load_file(Path(m) / "model.safetensors") for m in spec.model_uris}
    roles = spec.slice_roles()
    names, source_of = [], {}
    for name in loaded[BASE]:  # before and after the layers: the first and the last slice
        if layer_index(name) is None:
            s = 0 if "embed" in name else len(spec.slices) - 1
            names.append(name)
            source_of[name] = [(src.model, name) for src in spec.slices[s].sources], roles[s]
    out = 0
    for sl, r in zip(spec.slices, roles):
        for j in range(sl.length):
            for name in loaded[BASE]:
                if layer_index(name) == 0:
                    as_name = with_layer(name, out)
                    names.append(as_name)
                    source_of[as_name] = [(s.model, with_layer(name, s.layer_range[0] + j)) for s in sl.sources], r
            out += 1
    table = resolve_tensor_params(spec, names)
    result = {}
    for name in names:
        sources, r = source_of[name]
        tensors = [loaded[m][n] for m, n in sources]
        base = tensors[r.base]
        ctx = TensorContext(name, tuple(block_rows(tuple(base.shape), base.element_size(), block_size)), spec.seed)
        result[name] = op.merge(base, [tensors[e] for e in r.experts], table.for_tensor(name), ctx)
    return result


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_over_slices_equals_its_full_read_and_replays(method, tmp_path, session_catalog):
    from mergepipe.flows.merge import merge
    from mergepipe.flows.replay import replay

    per_model = METHODS[method]
    shared = {"select_topk": per_model.pop("select_topk")} if "select_topk" in (per_model := dict(per_model)) else {}
    slices = [
        {
            **sl,
            "sources": [
                {**s, "parameters": per_model} if per_model and (s["model"] != BASE or method == "linear") else s
                for s in sl["sources"]
            ],
        }
        for sl in SHIFTED
    ]
    doc = {"slices": slices, "merge_method": method, "base_model": BASE, "block_size": "1KiB", "dtype": "float32"}
    cfg = _config(tmp_path, {**doc, **({"parameters": shared} if shared else {})})
    merge(config=str(cfg), out=str(tmp_path / "full"), catalog=session_catalog)
    assert_bit_identical(tmp_path / "full", _whole_tensor_merge(load_spec(cfg), 1024))
    part = merge(config=str(cfg), out=str(tmp_path / "part"), budget="30%", catalog=session_catalog)
    assert part["expert_bytes_read"] <= 0.3 * part["full_expert_bytes"]
    again = replay(
        manifest=str(tmp_path / "part" / MANIFEST_FILE), out=str(tmp_path / "again"), catalog=session_catalog
    )
    assert again["digest"] == part["digest"]


def test_passthrough_of_one_model_scales_it_and_keeps_its_files(tmp_path, session_catalog):
    """The `models:` form: the one model is the base (no base_model needed), times its scale;
    a second model is refused, as mergekit fails on two inputs."""
    from mergepipe.flows.merge import merge

    doc = {"merge_method": "passthrough", "models": [{"model": ORCA, "parameters": {"scale": 2.0}}]}
    merge(config=str(_config(tmp_path, doc)), out=str(tmp_path / "out"), catalog=session_catalog)
    orca = load_file(Path(ORCA) / "model.safetensors")
    assert_bit_identical(tmp_path / "out", {n: t * 2.0 for n, t in orca.items()})
    assert (tmp_path / "out" / "config.json").read_bytes() == (Path(ORCA) / "config.json").read_bytes()
    with pytest.raises(BadInput, match="takes 0 model"):
        check_parameters(load_spec(_config(tmp_path, {**doc, "base_model": BASE}, "two.yaml")))


def test_a_sweep_of_slices_measures_against_the_base_where_the_output_has_it(tmp_path, session_catalog):
    """`sweep` over slices: each output against the full one, and the full one's distance from the
    base as the merge read it (the base's layers 0-1 in the output's layers 0-1 and 2-3 here),
    not from the base model as it is, whose layers are elsewhere."""
    from mergepipe.flows.sweep import budget_sweep

    doc = {
        "slices": [
            {"sources": [_src(BASE, 0, 2), _src(ORCA, 0, 2, weight=0.7)]},
            {"sources": [_src(BASE, 0, 2), _src(ORCA, 2, 4, weight=0.7)]},
        ],
        "merge_method": "task_arithmetic",
        "base_model": BASE,
        "dtype": "float32",
    }
    rows = budget_sweep(
        config=str(_config(tmp_path, doc)), out=str(tmp_path / "sweep"), budgets=["30%"], catalog=session_catalog
    )
    full = load_model(tmp_path / "sweep" / "budget-100pct")
    base = load_file(Path(BASE) / "model.safetensors")
    again = {
        n.replace(".layers.0.", ".layers.2.").replace(".layers.1.", ".layers.3."): t
        for n, t in base.items()
        if ".layers.0." in n or ".layers.1." in n
    }
    view = {n: again[n] if ".layers.2." in n or ".layers.3." in n else base[n] for n in full}
    assert [r["budget"] for r in rows] == ["30%", "100%"]
    assert rows[1]["deviation"] == 0.0 < rows[0]["deviation"]
    for r in rows:
        assert r["full_delta_norm"] == pytest.approx(frobenius_diff(full, view), rel=1e-12)
        measured = frobenius_diff(load_model(Path(r["out"])), full)
        assert r["deviation"] == pytest.approx(measured, rel=1e-12, abs=1e-30)


def test_a_sweep_of_a_frankenmerge_deviates_nowhere(tmp_path, session_catalog):
    """A frankenmerge reads no expert: every budget gives the full output, and its distance from
    its one source (the view of the slices' models) is the last slice's o_proj scaling."""
    from mergepipe.flows.sweep import budget_sweep

    rows = budget_sweep(
        config=str(_config(tmp_path, FRANKEN)), out=str(tmp_path / "sweep"), budgets=["10%"], catalog=session_catalog
    )
    orca = load_file(Path(ORCA) / "model.safetensors")
    scaled = [t for n, t in orca.items() if "o_proj" in n and (".layers.2." in n or ".layers.3." in n)]
    assert len(scaled) == 2 and all(r["deviation"] == 0.0 for r in rows)
    want = sum(float(((0.5 * t.double() - t.double()) ** 2).sum()) for t in scaled) ** 0.5
    assert rows[0]["full_delta_norm"] == pytest.approx(want, rel=1e-12)


def test_a_first_frankenmerge_reads_its_sources_once(tmp_path):
    """With an empty catalog, the merge hashes the base's view from the bytes it copies (its
    content digest, which the catalog keeps): no index pass reads them first, and the next
    merge, on that catalog, has the same plan digest."""
    from mergepipe.flows.merge import merge

    cfg, catalog = _config(tmp_path, FRANKEN), str(tmp_path / "catalog.duckdb")
    first = merge(config=str(cfg), out=str(tmp_path / "first"), catalog=catalog)
    copied = sum(t.nbytes for t in load_model(tmp_path / "first").values())  # float32 in, float32 out
    assert first["index_bytes"]["base"] == 0 and first["bytes"]["base"] == copied
    again = merge(config=str(cfg), out=str(tmp_path / "again"), catalog=catalog)
    assert again["index_bytes"]["base"] == 0 and again["plan_digest"] == first["plan_digest"]
    assert again["digest"] == first["digest"]
