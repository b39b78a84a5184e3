"""What the stages do once per family instead of once per tensor (or per model) gives what doing
it each time gives: parameters per kind of tensor, headers parsed once, one tensor table per
layout, the access set's hash in Arrow, the catalog's schema written once."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pickle
import random

import duckdb
import pyarrow as pa
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mergepipe.catalog import db
from mergepipe.config.environment import catalog_location
from mergepipe.config.spec import load_spec
from mergepipe.devtools.synthetic import make_family, write_model
from mergepipe.errors import BadInput
from mergepipe.flows.merge import plan as plan_flow
from mergepipe.index.blocks import layer_count, layer_position
from mergepipe.index.family import load_family
from mergepipe.index.stats import content_digest
from mergepipe.operators.base import MergeParams
from mergepipe.plan import saved
from mergepipe.plan.output import output_layout_of
from mergepipe.plan.params import resolve_params, resolve_tensor_params
from mergepipe.plan.record import ACCESS_SCHEMA, Plan, access_set_sha256
from mergepipe.storage import model_files, plans
from mergepipe.storage.canonical import json_bytes, sha256_hex
from mergepipe.storage.reader import RangeReader
from mergepipe.storage.safetensors_format import DTYPES, build_header

from .helpers import saved_plan


def test_parameters_resolved_per_kind_equal_each_tensor_resolved_alone(tmp_path):
    """Filters at every level and gradients: the table resolves each distinct (layer position,
    filters matched) once, and every tensor gets what resolving it alone gives."""
    names = [f"model.layers.{i}.{part}.weight" for i in range(5) for part in ("mlp.up_proj", "self_attn.q_proj")]
    names += ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    cfg = {
        "merge_method": "ties",
        "base_model": "b",
        "parameters": {"density": [{"filter": "self_attn", "value": [0.2, 0.9]}, {"value": 0.5}]},
        "models": [
            {"model": "e0", "parameters": {"weight": [{"filter": "mlp", "value": [1.0, 0.0, 0.5]}, {"value": 0.3}]}},
            {"model": "e1", "parameters": {"weight": 0.7, "density": [{"filter": "lm_head", "value": 1.0}]}},
        ],
    }
    path = tmp_path / "merge.yaml"
    path.write_text(yaml.safe_dump(cfg))
    spec = load_spec(path)
    table = resolve_tensor_params(spec, {n: None for n in names})
    layers = layer_count(names)
    for n in names:
        assert table.for_tensor(n) == resolve_params(spec, n, layer_position(n, layers)), n
    assert len(table.sets) > 3  # the filters and gradients did make sets differ


def test_resolving_per_kind_names_the_first_tensor_a_refusal_concerns(tmp_path):
    cfg = {
        "merge_method": "task_arithmetic",
        "base_model": "b",
        "models": [{"model": "e0", "parameters": {"weight": [{"filter": "mlp", "value": 0.5}]}}],
    }
    path = tmp_path / "merge.yaml"
    path.write_text(yaml.safe_dump(cfg))
    names = ["model.layers.0.mlp.up.weight", "model.layers.0.attn.q.weight", "model.layers.1.attn.q.weight"]
    with pytest.raises(BadInput, match=r"models\[0\]\.parameters\.weight.*'model\.layers\.0\.attn\.q\.weight'"):
        resolve_tensor_params(load_spec(path), {n: None for n in names})


def test_merge_params_survive_pickling_with_their_hash():
    p = MergeParams.of(2, {"weight": [0.5, 0.25], "normalize": True})
    q = pickle.loads(pickle.dumps(p))
    assert q == p and hash(q) == hash(p) and {p: 1}[q] == 1 and q["weight"] == (0.5, 0.25)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(4, 3, generator=g).to(torch.bfloat16) for i in range(6)}


def test_a_header_the_models_share_is_parsed_once_and_each_file_still_checked(tmp_path, monkeypatch):
    base = write_model(tmp_path / "base", _tensors(0), 1, sidecars=False)
    same = write_model(tmp_path / "same", _tensors(1), 1, sidecars=False)  # same names, dtypes, shapes
    other = write_model(tmp_path / "other", {k: v.float() for k, v in _tensors(2).items()}, 1, sidecars=False)
    calls = []
    parse = model_files.parse_header
    monkeypatch.setattr(
        model_files, "parse_header", lambda raw, size, path, file: calls.append(path) or parse(raw, size, path, file)
    )
    with RangeReader() as reader:
        family = load_family(str(base), [str(same), str(other), str(same)], reader)
    assert len(calls) == 2  # the base's header (shared by `same`) and `other`'s
    assert family.experts[0].layout is family.base.layout and family.experts[2].layout is family.base.layout
    assert family.experts[1].layout is not family.base.layout
    assert {n: loc.dtype for n, loc in family.experts[1].tensors.items()} == {f"t{i}": "F32" for i in range(6)}
    # A file with the same header bytes but cut short is checked against its own size.
    shard = same / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-2])
    with RangeReader() as reader, pytest.raises(BadInput, match=f"{shard}.*run past the end"):
        load_family(str(base), [str(same)], reader)


def test_a_plan_records_a_layout_its_models_share_once(tmp_path):
    fam = make_family(tmp_path / "fam", experts=("dense", "dense"), n_layers=1, hidden=16, intermediate=32, vocab=32)
    cfg = tmp_path / "merge.yaml"
    models = [{"model": str(e), "parameters": {"weight": 0.5}} for e in fam.experts]
    cfg.write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": str(fam.base), "models": models}))
    catalog = str(tmp_path / "catalog.duckdb")
    result = plan_flow(config=str(cfg), catalog=catalog)
    with duckdb.connect(catalog, read_only=True) as con:
        stored = con.execute(
            "SELECT record, access FROM saved_plans WHERE plan_key = ?", [result["plan_key"]]
        ).fetchall()
    record, _ = plans.decode_plan(*stored[0])
    assert [("tensors_as" in i, "tensors" in i) for i in record["inputs"]] == [
        (False, True),
        (True, False),
        (True, False),
    ]
    saved.forget()
    plan, _ = saved_plan(result, catalog)
    assert plan.inputs[1].layout is plan.inputs[0].layout
    with RangeReader() as reader:
        family = load_family(str(fam.base), [str(e) for e in fam.experts], reader)
    for inp, model in zip(plan.inputs, [family.base, *family.experts]):
        assert {n: (t.file, t.dtype, t.shape, t.start) for n, t in inp.tensors.items()} == {
            n: (loc.file, loc.dtype, loc.shape, loc.start) for n, loc in model.tensors.items()
        }
    again = Plan.from_json(plan.as_json(), plan.access)
    assert again.as_json() == plan.as_json() and again.inputs[2].layout is again.inputs[0].layout


def test_an_output_layout_is_laid_out_once_per_input_layout_and_a_saved_plan_kept_as_is(tmp_path):
    fam = make_family(tmp_path / "fam", experts=("dense",), n_layers=1, hidden=16, intermediate=32, vocab=32)
    cfg = tmp_path / "merge.yaml"
    models = [{"model": str(e), "parameters": {"weight": 0.5}} for e in fam.experts]
    cfg.write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": str(fam.base), "models": models}))
    catalog = str(tmp_path / "catalog.duckdb")
    result = plan_flow(config=str(cfg), catalog=catalog)
    saved.forget()
    plan, layout = saved_plan(result, catalog)
    assert saved_plan(result, catalog)[0] is plan  # read once per process
    # Another plan of this Layout object (as a first merge's recorded plan is) takes its layout
    # as it is; other settings, or an equal Layout read again, are laid out anew.
    assert output_layout_of(dataclasses.replace(plan, plan_digest="x", budget_bytes=1)) is layout
    smaller = output_layout_of(dataclasses.replace(plan, out_shard_size=1))
    assert smaller is not layout and len(smaller.shards) == len(layout.tensors) > 1
    again = Plan.from_json(plan.as_json(), plan.access)
    assert again.inputs[0].layout is not plan.inputs[0].layout
    assert again.inputs[0].tensors == plan.inputs[0].tensors
    assert output_layout_of(again) is not layout and output_layout_of(again) == layout
    # Saving keeps the plan as it was made; read back, it is the same record.
    kept = saved.save(again, catalog_location(str(tmp_path / "other.duckdb")))
    assert saved.load(kept)[0] is again
    saved.forget()
    assert saved.load(kept)[0] is not again and saved.load(kept)[0].as_json() == again.as_json()


def _line_by_line_sha256(access: pa.Table) -> str:
    h = hashlib.sha256()
    for e, t, b in sorted(zip(*(access[c].to_pylist() for c in ("expert", "tensor", "block")))):
        h.update(f"{e}\t{t}\t{b}\n".encode())
    return h.hexdigest()


@pytest.mark.parametrize("n", [0, 1, 7, 2000])
def test_access_set_hash_is_the_sorted_lines_hash(n):
    rng = random.Random(n)
    names = ["a", "a.b", "ab", "B", "é.w", "z\u4e2d", "\U0001f600", ""]
    cols = {
        "expert": [rng.randrange(12) for _ in range(n)],
        "tensor": [rng.choice(names) for _ in range(n)],
        "block": [rng.randrange(300) for _ in range(n)],
    }
    access = pa.table({**cols, "row_start": [0] * n, "row_end": [1] * n, "bytes": [1] * n}, schema=ACCESS_SCHEMA)
    chunked = pa.concat_tables([access.slice(0, n // 3), access.slice(n // 3)])
    expected = _line_by_line_sha256(access)
    assert access_set_sha256(access) == access_set_sha256(chunked) == expected
    assert access_set_sha256(access.slice(1)) == _line_by_line_sha256(access.slice(1))
    large = pa.schema([f.with_type(pa.large_string()) if f.name == "tensor" else f for f in ACCESS_SCHEMA])
    assert access_set_sha256(access.cast(large)) == expected


def test_catalog_schema_is_written_once_and_again_when_it_changed(tmp_path):
    path = tmp_path / "catalog.duckdb"
    with db.connect(path):
        pass
    con = duckdb.connect(str(path))
    con.execute("DROP VIEW merge_history")
    con.close()
    with db.connect(path) as con:  # the schema recorded is this one: nothing is written again
        views = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
        assert "merge_history" not in views
    con = duckdb.connect(str(path))
    con.execute("UPDATE catalog_meta SET value = 'an older schema' WHERE key = 'schema_sha256'")
    con.close()
    with db.connect(path) as con:
        views = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
        assert "merge_history" in views
        meta = dict(con.execute("SELECT key, value FROM catalog_meta").fetchall())
        assert meta["schema_version"] == db.SCHEMA_VERSION and meta["schema_sha256"] != "an older schema"


def test_built_header_text_is_what_json_writes_for_its_dict():
    names = ["a", "é", 'q"uote', "back\\slash", "tab\t", "\U0001f600", "z\u4e2d", "ctl\x01", "model.layers.0.w"]
    rng = random.Random(3)
    entries = [
        (n, rng.choice(["BF16", "F32", "I64", "BOOL"]), tuple(rng.randrange(5) for _ in range(i % 4)))
        for i, n in enumerate(names)
    ]
    prefix, ranges = build_header(entries)
    body, offset = {"__metadata__": {"format": "pt"}}, 0
    for (name, dtype, shape), (start, end) in zip(entries, ranges):
        n = math.prod(shape) * DTYPES[dtype].itemsize
        body[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        assert end - start == n and start == len(prefix) + offset
        offset += n
    text = json.dumps(body, separators=(",", ":")).encode()
    assert prefix[8:] == text + b" " * (-len(text) % 8)
    with pytest.raises(ValueError, match="twice"):
        build_header([("a", "F32", (1,)), ("a", "F32", (2,))])


def _plain(value) -> bytes:
    """The definition's text, written by the standard library alone."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


@pytest.mark.parametrize("ascii_names", [False, True])
def test_content_digest_is_the_digest_of_the_plain_json_entries(tmp_path, ascii_names):
    names = ["a.weight", "é.weight", 'q"uote', "z\u4e2d", "\U0001f600", "scalar", "B"]
    if ascii_names:  # orjson's text, not json's fallback
        names = ["a.weight", "e.weight", 'q"uote', "back\\slash", "ctl\x01", "scalar", "B"]
    tensors = {n: torch.ones(i % 3 + 1, 2).to(torch.bfloat16) for i, n in enumerate(names)}
    tensors["scalar"] = torch.tensor(1.5)
    folder = write_model(tmp_path / "m", tensors, 1, sidecars=False)
    with RangeReader() as reader:
        model = load_family(str(folder), [], reader).base
    hashes = {n: hashlib.sha256(n.encode()).hexdigest() for n in names}
    entries = {n: [loc.dtype, list(loc.shape), hashes[n]] for n, loc in model.tensors.items()}
    expected = sha256_hex(_plain(entries))
    assert content_digest(hashes, model) == expected
    # Entry texts are kept for the next model of the same layout; another layout, and other
    # hashes, give their own digest.
    other = write_model(tmp_path / "o", {**tensors, "B": torch.ones(3, 3).to(torch.bfloat16)}, 1, sidecars=False)
    with RangeReader() as reader:
        model_b = load_family(str(other), [], reader).base
        empty = load_family(str(write_model(tmp_path / "e", {}, 1, sidecars=False)), [], reader).base
    assert content_digest(hashes, model_b) == sha256_hex(_plain({**entries, "B": ["BF16", [3, 3], hashes["B"]]}))
    hashes["a.weight"] = "0" * 64
    entries["a.weight"][2] = hashes["a.weight"]
    assert content_digest(hashes, model) == sha256_hex(_plain(entries))
    assert content_digest({}, empty) == sha256_hex(_plain({}))


_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=500, deadline=None)
@given(value=_values, sort_keys=st.booleans())
def test_json_bytes_of_float_free_values_is_what_json_writes(value, sort_keys):
    """orjson's text where it applies (ASCII, ints in 64 bits), json's otherwise: the bytes of
    Python's json either way."""
    want = json.dumps(value, sort_keys=sort_keys, separators=(",", ":")).encode()
    assert json_bytes(value, sort_keys=sort_keys, floats=False) == want
    assert json_bytes(value, sort_keys=sort_keys) == want
