"""LoRA adapters as inputs (issue 48): MODEL+ADAPTER and {model, lora} references, read as the
factor rows each planned block needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mergepipe.config.spec import load_spec
from mergepipe.devtools.synthetic import make_family, write_adapter
from mergepipe.errors import BadInput
from mergepipe.storage.adapters import ADAPTER_WEIGHTS, LoraTensor, adapter_targets, changed_rows
from mergepipe.storage.model_files import MANIFEST_FILE
from mergepipe.storage.safetensors_format import encode, parse_header

from .helpers import assert_bit_identical, frobenius_diff
from .reference import load_model


@pytest.fixture(scope="module")
def lora_family(tmp_path_factory):
    """A bf16 base, one dense expert, and adapters: rank 4 on q and v (fp32 factors), rank 8 with
    rsLoRA and a rank pattern on the MLP and the embedding (bf16 factors)."""
    root = tmp_path_factory.mktemp("lora")
    fam = make_family(root / "fam", experts=("dense",), n_layers=2, hidden=64, intermediate=96, vocab=256, shards=2)
    base = load_model(fam.base)
    first = write_adapter(root / "qv", base, 7, rank=4, alpha=16)
    second = write_adapter(
        root / "mlp",
        base,
        8,
        rank=8,
        targets=("gate_proj", "down_proj"),
        alpha=4,
        dtype=torch.bfloat16,
        embedding=True,
        rank_pattern={"down_proj": 8},
        alpha_pattern={"layers.1.mlp.gate_proj": 12},
    )
    return fam, base, first, second


def _config(path: Path, fam, models: list, **extra) -> Path:
    cfg = {"merge_method": "task_arithmetic", "base_model": str(fam.base), "models": models, "block_size": "4KiB"}
    path.write_text(yaml.safe_dump({**cfg, **extra}, sort_keys=False))
    return path


def _materialized(folder: Path, base: dict, adapter: Path) -> Path:
    """The model the adapter makes of the base, written whole: each changed weight from
    changed_rows over all its rows (no reader, no plan)."""
    raw = (adapter / ADAPTER_WEIGHTS).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    factors, _ = parse_header(raw[8 : 8 + n], len(raw), str(adapter))
    config = json.loads((adapter / "adapter_config.json").read_text())
    from mergepipe.storage.safetensors_format import TensorPlace

    weights = {
        k: TensorPlace("w", {"bfloat16": "BF16", "float32": "F32"}[str(v.dtype)[6:]], tuple(v.shape), 0, 0)
        for k, v in base.items()
        if v.is_floating_point()
    }
    out = dict(base)
    for name, (a, b, scale, transposed) in adapter_targets(str(adapter), config, factors, weights).items():
        t = LoraTensor("", weights[name], "", a, b, scale, transposed)
        home = bytearray(encode(base[name]))
        rows = base[name].shape[0]
        factor = [memoryview(bytearray(raw[s:e])) for s, e in t.factor_ranges(0, rows)]
        w = t.whole
        whole_t = torch.frombuffer(
            bytearray(raw[w.start : w.end]),
            dtype=load_file(adapter / ADAPTER_WEIGHTS)[next(k for k in factors if factors[k] == w)].dtype,
        ).reshape(w.shape)
        out[name] = changed_rows(t, memoryview(home), factor, whole_t, 0, rows)
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(folder / "model.safetensors"))
    return folder


def test_reference_forms(lora_family, tmp_path):
    fam, _, first, _ = lora_family
    plus = load_spec(_config(tmp_path / "a.yml", fam, [{"model": f"{fam.base}+{first}"}]))
    mapping = load_spec(_config(tmp_path / "b.yml", fam, [{"model": {"model": str(fam.base), "lora": str(first)}}]))
    assert plus.expert_uris == mapping.expert_uris == [f"{fam.base}+{first}"]
    for models, needle in (
        ([{"model": str(fam.base), "lora": str(first)}], "lora: belongs inside the model reference"),
        ([{"model": f"{fam.base}+{first}+{first}"}], "one +"),
        ([{"model": {"model": str(fam.base), "override_architecture": "X"}}], "'override_architecture'"),
    ):
        with pytest.raises(BadInput, match=needle):
            load_spec(_config(tmp_path / "bad.yml", fam, models))
    sliced = {
        "merge_method": "passthrough",
        "slices": [{"sources": [{"model": f"{fam.base}+{first}", "layer_range": [0, 2]}]}],
    }
    (tmp_path / "s.yml").write_text(yaml.safe_dump(sliced))
    with pytest.raises(BadInput, match="not in slices"):
        load_spec(tmp_path / "s.yml")


def test_changed_rows_is_peft_formula(lora_family):
    """rows + scale·B·A (and its transpose), as PEFT's merge computes it with a matmul: within
    the rounding of the one sum whose order differs."""
    fam, base, _, second = lora_family
    factors = load_file(second / ADAPTER_WEIGHTS)
    ref = {}
    for key in factors:
        if key.endswith("lora_A.weight") or key.endswith("lora_embedding_A"):
            module = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
            a = factors[key].float()
            b = factors[key.replace("_A", "_B")].float()
            scale = (12 if module == "model.layers.1.mlp.gate_proj" else 4) / 8
            delta = (b @ a).T if "embedding" in key else b @ a
            ref[module + ".weight"] = (base[module + ".weight"].float() + delta * scale).to(torch.bfloat16)
    got = load_model(_materialized(Path(str(second) + "-whole"), base, second))
    assert set(ref) == {n for n in base if not torch.equal(got[n], base[n])}
    for name, want in ref.items():
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs()
        assert ((got[name].float() - want.float()).abs() <= ulp).all(), name


def test_lora_experts_merge_as_their_models_and_read_their_factors(lora_family, tmp_path, session_catalog):
    """At 100% the output is that of merging the adapted models written whole, and the experts'
    bytes read are the adapters' tensors, each once; at 30% bytes read = plan, the bound holds,
    and a replay gives the digest."""
    from mergepipe.flows.merge import merge
    from mergepipe.flows.replay import replay

    fam, base, first, second = lora_family
    weights = [0.5, 0.7, 0.4]
    lora = _config(
        tmp_path / "lora.yml",
        fam,
        [
            {"model": str(fam.experts[0]), "parameters": {"weight": weights[0]}},
            {"model": f"{fam.base}+{first}", "parameters": {"weight": weights[1]}},
            {"model": {"model": str(fam.base), "lora": str(second)}, "parameters": {"weight": weights[2]}},
        ],
    )
    whole = [_materialized(tmp_path / f"whole-{i}", base, a) for i, a in enumerate((first, second))]
    dense = _config(
        tmp_path / "dense.yml",
        fam,
        [{"model": str(m), "parameters": {"weight": w}} for m, w in zip([fam.experts[0], *whole], weights)],
    )
    full = merge(config=str(lora), out=str(tmp_path / "full"), catalog=session_catalog)
    merge(config=str(dense), out=str(tmp_path / "dense"), catalog=session_catalog)
    assert_bit_identical(tmp_path / "full", load_model(tmp_path / "dense"))

    manifest = json.loads((tmp_path / "full" / MANIFEST_FILE).read_text())
    by_model: dict[str, int] = {}
    for row in manifest["run"]["ledger"]:
        if row["role"] == "expert":
            by_model[row["model"]] = by_model.get(row["model"], 0) + row["bytes"]
    for adapter, label in ((first, "expert-1"), (second, "expert-2")):
        raw = (adapter / ADAPTER_WEIGHTS).read_bytes()
        assert by_model[label] == len(raw) - 8 - int.from_bytes(raw[:8], "little"), label  # every factor, once
    assert full["expert_bytes_read"] == full["expert_bytes_planned"]
    card = yaml.safe_load((tmp_path / "full" / "README.md").read_text().split("---")[1])
    assert card["base_model"] == [str(fam.base), str(fam.experts[0]), str(first), str(second)]  # adapters named

    # fp32 output: the bound is on the merged values before a cast to a narrower dtype.
    wide = _config(tmp_path / "wide.yml", fam, yaml.safe_load(lora.read_text())["models"], out_dtype="float32")
    merge(config=str(wide), out=str(tmp_path / "wide"), catalog=session_catalog)
    part = merge(config=str(wide), out=str(tmp_path / "part"), budget="30%", catalog=session_catalog)
    assert part["expert_bytes_read"] == part["expert_bytes_planned"] <= part["budget_bytes"]
    assert part["bound_guaranteed"]
    err = frobenius_diff(load_model(tmp_path / "part"), load_model(tmp_path / "wide"))
    assert 0 < err <= part["error_bound"] * (1 + 1e-5) + 1e-6
    again = replay(
        manifest=str(tmp_path / "part" / MANIFEST_FILE), out=str(tmp_path / "again"), catalog=session_catalog
    )
    assert again["digest"] == part["digest"]
    assert_bit_identical(tmp_path / "again", load_model(tmp_path / "part"))


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"use_dora": True}, "use_dora: not supported"),
        ({"r": 5}, "factors of rank 4, the config says r = 5"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save: not supported"),
    ],
)
def test_bad_adapters_are_named(lora_family, tmp_path, session_catalog, change, needle):
    from mergepipe.flows.merge import merge

    fam, base, first, _ = lora_family
    bad = write_adapter(tmp_path / "bad", base, 7, rank=4, **change)
    cfg = _config(tmp_path / "c.yml", fam, [{"model": f"{fam.base}+{bad}"}])
    with pytest.raises(BadInput, match=needle):
        merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)


def test_adapter_that_does_not_fit_its_model(lora_family, tmp_path, session_catalog):
    from mergepipe.flows.merge import merge

    fam, base, _, _ = lora_family
    other = {**base, "model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 64, dtype=torch.bfloat16)}
    bad = write_adapter(tmp_path / "bad", other, 7, rank=4)
    cfg = _config(tmp_path / "c.yml", fam, [{"model": f"{fam.base}+{bad}"}])
    with pytest.raises(BadInput, match=r"q_proj: B·A has shape \[32, 64\], the model's .* has \[64, 64\]"):
        merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    alone = _config(tmp_path / "d.yml", fam, [{"model": str(bad)}])
    with pytest.raises(BadInput, match="is a LoRA adapter, not a model"):
        merge(config=str(alone), out=str(tmp_path / "out"), catalog=session_catalog)


@pytest.mark.parametrize("method", ["task_arithmetic", "ties"])
def test_lora_experts_in_streamed_and_windowed_forms(lora_family, tmp_path, session_catalog, monkeypatch, method):
    """Under a memory budget that streams (task arithmetic: runs of elements, pieces of rows)
    or windows (TIES: rows read in passes) the changed weights, the output and the expert bytes
    are those of merging each tensor whole."""
    from mergepipe.execute import memory, streamed, windowed
    from mergepipe.flows.merge import merge
    from mergepipe.operators import slabs

    from .helpers import saved_plan

    fam, _, first, second = lora_family
    models = [
        {"model": f"{fam.base}+{first}", "parameters": {"weight": 0.6, "density": 0.5}},
        {"model": f"{fam.base}+{second}", "parameters": {"weight": 0.4, "density": 0.5}},
        {"model": str(fam.experts[0]), "parameters": {"weight": 0.3, "density": 0.5}},
    ]
    cfg = _config(tmp_path / "c.yml", fam, models, merge_method=method, budget="70%")
    whole = merge(config=str(cfg), out=str(tmp_path / "whole"), catalog=session_catalog)
    monkeypatch.setattr(slabs, "SLAB_ELEMENTS", 256)
    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    monkeypatch.setattr(memory, "MIN_SLAB_ELEMENTS", 48)  # pieces of 64-wide rows
    needs = memory.tensor_needs(*saved_plan(whole, session_catalog))
    seen = []
    for module, name in ((streamed, "merge_streamed"), (windowed, "merge_windows")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda g, reads, real=real: seen.append(reads.name) or real(g, reads))
    small = merge(
        config=str(cfg),
        out=str(tmp_path / "small"),
        catalog=session_catalog,
        memory=str(2 * 2 * max(n.least for n in needs)),
    )
    assert small["digest"] == whole["digest"]
    assert small["expert_bytes_read"] == whole["expert_bytes_read"] == small["expert_bytes_planned"]
    changed = {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
    }
    assert changed <= set(seen)


def test_one_adapter_on_two_inputs_is_read_for_each(lora_family, tmp_path, session_catalog):
    """The same adapter on the base and on another model, and listed twice: each input reads
    its factors, as planned."""
    from mergepipe.flows.merge import merge

    fam, _, first, _ = lora_family
    models = [
        {"model": f"{fam.base}+{first}", "parameters": {"weight": 0.5}},
        {"model": f"{fam.experts[0]}+{first}", "parameters": {"weight": 0.3}},
        {"model": f"{fam.base}+{first}", "parameters": {"weight": 0.2}},
    ]
    r = merge(config=str(_config(tmp_path / "c.yml", fam, models)), out=str(tmp_path / "out"), catalog=session_catalog)
    assert r["expert_bytes_read"] == r["expert_bytes_planned"]
