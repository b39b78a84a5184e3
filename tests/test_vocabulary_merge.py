"""Merges whose models' vocabularies differ (issue 48): the output's tokenizer and every model's
embedding and head on its rows, against mergekit-yaml 0.1.5 (scripts/mergekit_vocab_e2e.py
wrote the fixtures), and the usual promises under a budget."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mergepipe.devtools.synthetic import tokenizer_meaning as meaning
from mergepipe.errors import BadInput
from mergepipe.publish.manifest import verify_output
from mergepipe.storage.model_files import MANIFEST_FILE

from .helpers import assert_close_to_mergekit, frobenius_diff
from .reference import load_model

pytest.importorskip("transformers")

E2E = Path(__file__).parent / "data" / "vocab_e2e"
CASES = json.loads((E2E / "cases.json").read_text())["cases"]
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def _config(case: str, path: Path, **extra) -> Path:
    """A fixture config (each of its documents) with its models' locations made absolute."""
    docs = list(yaml.safe_load_all((E2E / f"{case}.yml").read_text()))
    stages = {d["name"] for d in docs if "name" in d}
    for doc in docs:
        _absolute(doc, stages)
    docs[-1].update(extra)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def _absolute(doc: dict, stages: set[str]) -> None:
    at = lambda m: m if m in stages else str(E2E / m)  # noqa: E731
    if "base_model" in doc:
        doc["base_model"] = at(doc["base_model"])
    for m in doc["models"]:
        m["model"] = at(m["model"])
    if "tokenizer_source" in doc and doc["tokenizer_source"] not in ("union", "base"):
        doc["tokenizer_source"] = at(doc["tokenizer_source"])
    for entry in (doc.get("tokenizer") or {}).get("tokens", {}).values():
        source = entry.get("source")
        if isinstance(source, str):
            entry["source"] = at(source)
        elif isinstance(source, dict) and "model" in source:
            source["model"] = at(source["model"])


def assert_as_mergekit(case: str, out: Path) -> None:
    """Tensors equal mergekit's within MERGEKIT_ULPS (its bits depend on the CPU's kernels),
    row by row on the same tokens (mergekit numbers a union's new tokens in a hash map's order,
    another in each process); padding rows (each model's mean row) to a few fp32 ulps, as
    mergekit's torch.mean sums in another order; the tokenizer equal in meaning."""
    want = CASES[case]
    mine = meaning(out)
    assert sorted(mine["tokens"]) == sorted(want["tokens"])
    if case not in ("union", "tokens", "chat_auto", "two_stages"):  # a union's new ids are mergekit's chance
        assert mine["tokens"] == want["tokens"]
    by_content = lambda added: {v["content"]: v for v in added.values()}  # noqa: E731
    assert by_content(mine["added"]) == by_content(want["added"])
    for key in ("special", "chat_template", "vocab_size"):
        assert mine[key] == want[key], key
    got, theirs = load_model(out), load_file(E2E / "expected" / f"{case}.safetensors")
    assert sorted(got) == sorted(theirs)
    n = len(want["tokens"])
    at = {t: i for i, t in enumerate(mine["tokens"])}
    order = torch.tensor([at[t] for t in want["tokens"]])
    for name, expected in theirs.items():
        assert got[name].dtype == expected.dtype and got[name].shape == expected.shape, name
        if name in VOCAB_TENSORS:
            assert_close_to_mergekit(got[name][order], expected[:n], name)
            assert torch.allclose(got[name][n:], expected[n:], rtol=1e-6, atol=1e-8), name
        else:
            assert_close_to_mergekit(got[name], expected, name)


HAS_MERGEKIT = importlib.util.find_spec("mergekit") is not None


@pytest.mark.parametrize(
    "case",
    ["union", "tokens"]
    + [
        pytest.param(c, marks=pytest.mark.slow)
        for c in ("base_source", "model_source", "padded_union", "chat_auto", "chat_jinja")
    ]
    + [
        pytest.param(
            "chat_named",
            marks=[pytest.mark.slow, pytest.mark.skipif(not HAS_MERGEKIT, reason="a template's name needs mergekit")],
        )
    ],
)
def test_vocabularies_as_mergekit_merges_them(case, tmp_path, session_catalog):
    from mergepipe.flows.merge import merge

    out = tmp_path / "out"
    merge(config=str(_config(case, tmp_path / "c.yml")), out=str(out), catalog=session_catalog)
    assert_as_mergekit(case, out)
    if case.startswith("chat_") and case != "chat_auto":
        return  # the tokenizer is the base's, with its template: no vocabulary is built
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    names = {e["file"] for e in manifest["run"]["tokenizer_files"]}
    assert "tokenizer.json" in names and not names & {e["file"] for e in manifest["content"]["output"]["files"]}
    assert manifest["run"]["versions"]["transformers"]
    assert verify_output(out).ok
    (out / "tokenizer.json").write_text((out / "tokenizer.json").read_text().replace('"<unk>"', '"<unK>"', 1))
    assert not verify_output(out).ok


def test_union_under_a_budget(tmp_path, session_catalog, monkeypatch):
    """At 25% and at 100% of the experts' bytes on the output's rows: bytes read = plan, the
    bound holds, and a replay gives the digest. The padding's mean row is the same however many
    rows are read at once to make it."""
    from mergepipe.flows.merge import merge
    from mergepipe.flows.replay import replay
    from mergepipe.storage import vocab_rows

    cfg = _config("tokens", tmp_path / "c.yml", block_size="256B")
    full = merge(config=str(cfg), out=str(tmp_path / "full"), catalog=session_catalog)
    assert full["expert_bytes_read"] == full["expert_bytes_planned"] <= full["budget_bytes"]
    assert_as_mergekit("tokens", tmp_path / "full")
    monkeypatch.setattr(vocab_rows, "SLAB_BYTES", 100)  # a row or so at a time
    slabbed = merge(config=str(cfg), out=str(tmp_path / "slabbed"), catalog=session_catalog)
    assert slabbed["digest"] == full["digest"] and slabbed["expert_bytes_read"] == full["expert_bytes_read"]
    monkeypatch.undo()
    part = merge(config=str(cfg), out=str(tmp_path / "part"), budget="25%", catalog=session_catalog)
    assert part["expert_bytes_read"] == part["expert_bytes_planned"] <= part["budget_bytes"]
    assert part["bound_guaranteed"]
    err = frobenius_diff(load_model(tmp_path / "part"), load_model(tmp_path / "full"))
    assert 0 < err <= part["error_bound"] * (1 + 1e-5) + 1e-6
    again = replay(
        manifest=str(tmp_path / "part" / MANIFEST_FILE), out=str(tmp_path / "again"), catalog=session_catalog
    )
    assert again["digest"] == part["digest"]
    assert meaning(tmp_path / "again") == meaning(tmp_path / "part")


def test_a_model_without_vocab_size_is_named(tmp_path, session_catalog):
    """Which tensors are indexed by token is told from config.json's vocab_size."""
    import shutil

    from mergepipe.flows.merge import merge

    other = tmp_path / "other"
    shutil.copytree(E2E / "other", other)
    config = json.loads((other / "config.json").read_text())
    del config["vocab_size"]
    (other / "config.json").write_text(json.dumps(config))
    cfg = _config("union", tmp_path / "c.yml")
    cfg.write_text(cfg.read_text().replace(str(E2E / "other"), str(other)))
    with pytest.raises(BadInput, match=f"{other}: its config.json states no vocab_size"):
        merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)


def test_a_chat_template_goes_with_a_built_tokenizer(tmp_path, session_catalog):
    """chat_template with a built vocabulary: saved by transformers with the tokenizer (as
    mergekit sets it on the tokenizer it saves), which loads with it."""
    from mergepipe.flows.merge import merge

    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    cfg = _config("union", tmp_path / "c.yml", chat_template=template)
    merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    assert meaning(tmp_path / "out")["chat_template"] == template
    assert verify_output(tmp_path / "out").ok


@pytest.mark.slow
def test_two_stages_as_mergekit_multi_merges_them(tmp_path):
    """A first stage's union is an input of the final stage, whose vocabulary is built from its
    tokenizer: the final output as mergekit-multi's."""
    from mergepipe.flows.stages import merge_stages

    cfg = _config("two_stages", tmp_path / "c.yml")
    out, inter = tmp_path / "out", tmp_path / "inter"
    r = merge_stages(config=str(cfg), out=str(out), intermediate_dir=str(inter), catalog=str(tmp_path / "c.duckdb"))
    assert [s["stage"] for s in r["stages"]] == ["first", None]
    assert_as_mergekit("two_stages", out)
    assert verify_output(inter / "first").ok and verify_output(out).ok
