"""Bad input, case by case: `mergepipe merge` exits 2 with one line naming the file, tensor or
key at fault; nothing is published and the catalog is unchanged. Plus a fuzz of the header
parser: only clean errors."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import duckdb
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mergepipe.cli import app
from mergepipe.devtools.synthetic import make_family, write_config, write_model
from mergepipe.errors import BadInput
from mergepipe.storage.safetensors_format import header_length, parse_header

from .reference import load_model

runner = CliRunner()


def read_st(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_st(path: Path, header: dict | bytes, data: bytes, declared: int | None = None) -> None:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if declared is None else declared) + body + data)


def first_shard(model: Path) -> Path:
    return sorted(model.glob("*.safetensors"))[0]


def a_matrix(header: dict) -> str:
    return next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2)


# Each case damages a fresh family (base + 1 dense expert, 2 shards with an index) or its
# config, and names what the error message must contain.
def truncated(fam, cfg):
    p = first_shard(fam.experts[0])
    p.write_bytes(p.read_bytes()[:-100])
    return p.name


def shorter_than_8_bytes(fam, cfg):
    p = first_shard(fam.experts[0])
    p.write_bytes(b"\x01\x02")
    return "truncated safetensors file"


def header_longer_than_file(fam, cfg):
    p = first_shard(fam.experts[0])
    h, d = read_st(p)
    write_st(p, h, d, declared=10**6)
    return "runs past the end of the file"


def header_of_100_mb(fam, cfg):
    p = first_shard(fam.experts[0])
    h, d = read_st(p)
    write_st(p, h, d, declared=100 * 1024 * 1024)
    return "at or over the 104857600-byte limit"


def header_not_json(fam, cfg):
    p = first_shard(fam.experts[0])
    _, d = read_st(p)
    write_st(p, b"{not json", d)
    return "header is not valid JSON"


def header_not_an_object(fam, cfg):
    p = first_shard(fam.experts[0])
    _, d = read_st(p)
    write_st(p, b"[1, 2, 3]", d)
    return "not a JSON object"


def _edit_matrix_entry(fam, edit) -> str:
    """Apply edit(header, data, name) to the header entry of a matrix in the expert's first
    shard; returns the tensor's name."""
    p = first_shard(fam.experts[0])
    h, d = read_st(p)
    name = a_matrix(h)
    edit(h, d, name)
    write_st(p, h, d)
    return name


def offsets_out_of_bounds(fam, cfg):
    def edit(h, d, name):
        s, e = h[name]["data_offsets"]
        h[name]["data_offsets"] = [s + len(d), e + len(d)]

    return _edit_matrix_entry(fam, edit)


def offsets_overlapping(fam, cfg):
    p = first_shard(fam.experts[0])
    h, d = read_st(p)
    names = [k for k in h if k != "__metadata__" and h[k]["shape"]]
    a, b = names[0], names[1]
    size = h[a]["data_offsets"][1] - h[a]["data_offsets"][0]
    h[a]["data_offsets"] = [0, size]
    h[b]["data_offsets"] = [1, 1 + h[b]["data_offsets"][1] - h[b]["data_offsets"][0]]
    write_st(p, h, d)
    return "overlap"


def offsets_not_matching_shape(fam, cfg):
    return _edit_matrix_entry(
        fam, lambda h, d, name: h[name]["data_offsets"].__setitem__(1, h[name]["data_offsets"][1] - 2)
    )


def unsupported_dtype(fam, cfg):
    _edit_matrix_entry(fam, lambda h, d, name: h[name].__setitem__("dtype", "Q4_K"))
    return "unsupported dtype 'Q4_K'"


def entry_missing_offsets(fam, cfg):
    return _edit_matrix_entry(fam, lambda h, d, name: h[name].pop("data_offsets"))


def negative_shape(fam, cfg):
    _edit_matrix_entry(fam, lambda h, d, name: h[name].__setitem__("shape", [-1, 4]))
    return "shape must be a list of non-negative integers"


def duplicate_tensor_name(fam, cfg):
    p = first_shard(fam.experts[0])
    h, d = read_st(p)
    name = a_matrix(h)
    body = json.dumps(h)
    entry = json.dumps({name: h[name]})[1:-1]
    write_st(p, ("{" + entry + ", " + body[1:]).encode(), d)
    return f"{name!r} appears twice"


def index_names_missing_shard(fam, cfg):
    first_shard(fam.experts[0]).unlink()
    return "is missing"


def index_tensor_missing_from_shard(fam, cfg):
    idx = fam.experts[0] / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"]["model.layers.0.ghost.weight"] = sorted(set(doc["weight_map"].values()))[0]
    idx.write_text(json.dumps(doc))
    return "model.layers.0.ghost.weight"


def _point_weight_map(fam, target: str):
    idx = fam.experts[0] / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    victim = sorted(set(doc["weight_map"].values()))[0]
    doc["weight_map"] = {k: (target if v == victim else v) for k, v in doc["weight_map"].items()}
    idx.write_text(json.dumps(doc))


def weight_map_escapes_with_dotdot(fam, cfg):
    _point_weight_map(fam, "../base/model-00001-of-00002.safetensors")
    return "escapes the model folder"


def weight_map_absolute_path(fam, cfg):
    _point_weight_map(fam, str(first_shard(fam.base)))
    return "escapes the model folder"


def weight_map_symlink_outside(fam, cfg):
    link = fam.experts[0] / "linked.safetensors"
    os.symlink(first_shard(fam.base), link)
    _point_weight_map(fam, "linked.safetensors")
    return "resolves outside the model folder"


def shape_mismatch(fam, cfg):
    t = load_model(fam.experts[0])
    name = next(k for k, v in t.items() if v.dim() == 2)
    t[name] = t[name][:-1].clone()
    _rewrite(fam.experts[0], t)
    return name


def tensor_only_in_expert(fam, cfg):
    t = load_model(fam.experts[0])
    t["model.extra.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    _rewrite(fam.experts[0], t)
    return "'model.extra.weight' is not in the base model"


def tensor_only_in_base(fam, cfg):
    t = load_model(fam.experts[0])
    gone = sorted(t)[0]
    del t[gone]
    _rewrite(fam.experts[0], t)
    return f"{gone!r} of the base model is missing"


def _poison(fam, value: float) -> str:
    t = load_model(fam.experts[0])
    name = next(k for k, v in sorted(t.items()) if v.dim() == 2)
    t[name] = t[name].clone()
    t[name][0, 0] = value
    _rewrite(fam.experts[0], t)
    return f"{name!r} block 0 has a non-finite delta"


def nan_in_delta(fam, cfg):
    return _poison(fam, float("nan"))


def inf_in_delta(fam, cfg):
    return _poison(fam, float("inf"))


def _rewrite(folder: Path, tensors: dict) -> None:
    for p in folder.iterdir():
        p.unlink()
    write_model(folder, tensors, shards=2, sidecars=False)


def _edit_config(cfg: Path, **changes) -> None:
    import yaml

    doc = yaml.safe_load(cfg.read_text())
    for k, v in changes.items():
        if v is None:
            doc.pop(k, None)
        else:
            doc[k] = v
    cfg.write_text(yaml.safe_dump(doc))


def _edit_first_model(cfg: Path, model: str | None = None, **parameters) -> None:
    import yaml

    doc = yaml.safe_load(cfg.read_text())
    if model is not None:
        doc["models"][0]["model"] = model
    doc["models"][0]["parameters"].update(parameters)
    cfg.write_text(yaml.safe_dump(doc))


def budget_negative(fam, cfg):
    _edit_config(cfg, budget=-5)
    return "budget"


def budget_without_unit(fam, cfg):
    _edit_config(cfg, budget=25)
    return "budget: 25 has no unit; write 25%"


def budget_admits_no_block(fam, cfg):
    _edit_config(cfg, budget="0%")
    return "budget: 0% (0 bytes) admits no expert block"


def budget_over_100_percent(fam, cfg):
    _edit_config(cfg, budget="150%")
    return "budget"


def budget_not_a_size(fam, cfg):
    _edit_config(cfg, budget="lots")
    return "budget"


def unknown_operator(fam, cfg):
    _edit_config(cfg, merge_method="frankenmerge")
    return "unknown merge_method 'frankenmerge'"


def unknown_parameter(fam, cfg):
    _edit_first_model(cfg, strength=2)
    return "models.0.parameters.strength: unknown key"


def density_outside_range(fam, cfg):
    _edit_config(cfg, parameters={"density": 1.5})
    return "density must be in (0, 1]"


def unknown_yaml_key(fam, cfg):
    _edit_config(cfg, merge_methd="ties")
    return "merge_methd: unknown key"


def misspelled_required_key(fam, cfg):
    import yaml

    doc = yaml.safe_load(cfg.read_text())
    doc["merge_methd"] = doc.pop("merge_method")
    cfg.write_text(yaml.safe_dump(doc))
    return "merge_methd: unknown key (did you mean merge_method?)"


def shard_as_base(fam, cfg):
    shard = sorted(fam.base.glob("*.safetensors"))[0]
    _edit_config(cfg, base_model=str(shard))
    return "is one shard of a sharded model; a model location is a folder"


def partial_single_file_as_base(fam, cfg):
    # One shard copied out alone: a single file, but not the whole model.
    import shutil

    alone = fam.base.parent / "alone"
    alone.mkdir()
    shard = sorted(fam.base.glob("*.safetensors"))[0]
    shutil.copy(shard, alone / "model.safetensors")
    _edit_config(cfg, base_model=str(alone / "model.safetensors"))
    return "(a model location is a folder (local or s3://) holding model.safetensors"


def empty_expert_list(fam, cfg):
    _edit_config(cfg, models=[])
    return "models"


def config_not_yaml(fam, cfg):
    cfg.write_text("merge_method: [unclosed\n")
    return "not valid YAML"


def config_not_a_mapping(fam, cfg):
    cfg.write_text("- just\n- a list\n")
    return "expected a mapping"


def missing_expert_folder(fam, cfg):
    import shutil

    shutil.rmtree(fam.experts[0])
    return f"{fam.experts[0]}: model not found"


def mergekit_slices(fam, cfg):
    """A slice past the model's last layer, found once the headers are read."""
    sources = [{"model": str(m), "layer_range": [0, 99]} for m in (fam.base, fam.experts[0])]
    _edit_config(cfg, models=[], slices=[{"sources": sources}])
    return f"{fam.base}: layer_range [0, 99) but the model has"


def tokenizer_source_elsewhere(fam, cfg):
    """A tokenizer source that is not among the merge's models."""
    _edit_config(cfg, tokenizer_source="org/other-model")
    return "tokenizer_source: 'org/other-model' is not among the merge's models"


def lora_reference(fam, cfg):
    """A LoRA reference (model+adapter) whose adapter is not there: named, resolved beside the config."""
    _edit_first_model(cfg, model=f"{fam.experts[0]}+adapters/my-lora")
    return f"{cfg.parent / 'adapters' / 'my-lora'}: model not found"


def condition_with_unknown_key(fam, cfg):
    # mergekit's own gradient-slerp example writes `pattern:`, which mergekit silently ignores
    # (making that condition match every tensor).
    _edit_first_model(cfg, weight=[{"pattern": "mlp", "value": 0.5}, {"value": 0.1}])
    return "models.0.parameters.weight: [0].pattern: unknown key"


def weight_filter_misses_a_tensor(fam, cfg):
    # No condition matches the embeddings and there is no global weight: named per tensor,
    # before any statistics are taken.
    _edit_first_model(cfg, weight=[{"filter": "layers.", "value": 0.5}])
    return (
        "models[0].parameters.weight: required by merge_method 'task_arithmetic' for tensor 'model.embed_tokens.weight'"
    )


CASES = [
    truncated,
    shorter_than_8_bytes,
    header_longer_than_file,
    header_of_100_mb,
    header_not_json,
    header_not_an_object,
    offsets_out_of_bounds,
    offsets_overlapping,
    offsets_not_matching_shape,
    unsupported_dtype,
    entry_missing_offsets,
    negative_shape,
    duplicate_tensor_name,
    index_names_missing_shard,
    index_tensor_missing_from_shard,
    weight_map_escapes_with_dotdot,
    weight_map_absolute_path,
    weight_map_symlink_outside,
    shape_mismatch,
    tensor_only_in_expert,
    tensor_only_in_base,
    nan_in_delta,
    inf_in_delta,
    budget_negative,
    budget_without_unit,
    budget_admits_no_block,
    budget_over_100_percent,
    budget_not_a_size,
    unknown_operator,
    unknown_parameter,
    density_outside_range,
    unknown_yaml_key,
    misspelled_required_key,
    shard_as_base,
    partial_single_file_as_base,
    empty_expert_list,
    config_not_yaml,
    config_not_a_mapping,
    missing_expert_folder,
    mergekit_slices,
    tokenizer_source_elsewhere,
    lora_reference,
    condition_with_unknown_key,
    weight_filter_misses_a_tensor,
]


def catalog_rows(path: Path) -> dict:
    """Every table's rows but saved_plans': a plan saved for its layer tasks before they ran
    stays (keyed by its content and inputs, another run of the same plan may be using it)."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        tables = [
            r[0]
            for r in con.execute(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_type = 'BASE TABLE' AND table_name <> 'saved_plans'"
            ).fetchall()
        ]
        return {t: sorted(map(repr, con.execute(f'SELECT * FROM "{t}"').fetchall())) for t in tables}
    finally:
        con.close()


@pytest.fixture
def family_and_catalog(tmp_path):
    """A family already indexed into a catalog (so "unchanged" means something)."""
    fam = make_family(tmp_path / "fam", experts=("dense",), n_layers=1, hidden=32, intermediate=64, vocab=64, shards=2)
    cfg = write_config(tmp_path / "merge.yaml", fam, "task_arithmetic", weights=[0.5], block_size="4KiB")
    catalog = tmp_path / "catalog.duckdb"
    ok = runner.invoke(app, ["index", str(cfg), "--catalog", str(catalog)])
    assert ok.exit_code == 0, ok.output
    return fam, cfg, catalog


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_exits_2_naming_the_culprit(case, family_and_catalog, tmp_path):
    fam, cfg, catalog = family_and_catalog
    before = catalog_rows(catalog)
    culprit = case(fam, cfg)
    out = tmp_path / "out"
    result = runner.invoke(app, ["merge", str(cfg), "--out", str(out), "--catalog", str(catalog)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and culprit in errors[0], result.output
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "staging" in p.name]
    assert catalog_rows(catalog) == before


def test_existing_output_and_output_inside_an_input(family_and_catalog, tmp_path):
    fam, cfg, catalog = family_and_catalog
    (tmp_path / "taken").mkdir()
    for out, culprit in [(tmp_path / "taken", "already exists"), (fam.base / "merged", "lies inside the input")]:
        result = runner.invoke(app, ["merge", str(cfg), "--out", str(out), "--catalog", str(catalog)])
        assert result.exit_code == 2 and culprit in result.output, result.output


@pytest.fixture(scope="module")
def no_prefect_services():
    """Hypothesis compares the global random state before and after every draw, and Prefect's
    background services (events, API logs), started by the flow runs of the tests before, may
    draw from it meanwhile: that was the deprecation warning these fuzzers raised. They are
    drained first; a later flow run starts them again."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    EventsWorker.drain_all()
    APILogWorker.drain_all()
    yield


@pytest.mark.slow
@pytest.mark.usefixtures("no_prefect_services")
@settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=256), size=st.integers(min_value=0, max_value=1 << 40))
def test_fuzz_header_bytes_give_clean_errors(raw, size):
    try:
        n = header_length(raw[:8], size, "f")
        parse_header(raw[8 : 8 + n], size, "f")
    except BadInput:
        pass


def _containers(inner):
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)


# A named extension function: hypothesis reads a lambda's source to check that it recurses, and a
# lambda the formatter put on its own line reads as one that does not.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    _containers,
    max_leaves=20,
)
entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "BF16", "F16", "I64", "U8", "X9"]) | json_values,
        "shape": st.lists(st.integers(-2, 2**40), max_size=4) | json_values,
        "data_offsets": st.lists(st.integers(-2, 2**41), max_size=3) | json_values,
    },
    optional={"extra": json_values},
)


@pytest.mark.slow
@pytest.mark.usefixtures("no_prefect_services")
@settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    header=st.dictionaries(st.text(max_size=12), entries | json_values, max_size=5),
    size=st.integers(min_value=0, max_value=1 << 42),
)
def test_fuzz_structured_headers_give_clean_errors(header, size):
    try:
        tensors, _ = parse_header(json.dumps(header).encode(), size, "f")
    except BadInput:
        return
    for t in tensors.values():  # accepted: every tensor lies inside the file and matches its shape
        assert 8 <= t.start <= t.end <= size
