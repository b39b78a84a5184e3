"""Every output gets a README.md model card: Hugging Face metadata and how the merge was made. It
is in the manifest (outside the digest) and verified like the other files."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from mergepipe.cli import app
from mergepipe.flows.merge import merge
from mergepipe.publish.manifest import verify_output
from mergepipe.storage.model_files import MANIFEST_FILE

from .helpers import config_for


def _front_matter(text: str) -> dict:
    head, sep, _ = text.removeprefix("---\n").partition("\n---\n")
    assert sep, text[:200]
    return yaml.safe_load(head)


def test_the_card_says_how_the_merge_was_made_and_is_verified(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic", budget="25%")
    r = merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    card = (tmp_path / "out" / "README.md").read_text()
    meta = _front_matter(card)
    assert meta["base_model"] == [str(bf16_family.base), *map(str, bf16_family.experts)]
    assert meta["library_name"] == "transformers" and {"merge", "mergepipe"} <= set(meta["tags"])
    assert "`task_arithmetic` method" in card and r["plan_digest"] in card
    assert f"≤ {r['error_bound']:.6g}" in card and "(guaranteed)" in card
    assert "## Configuration" in card and "merge_method: task_arithmetic" in card
    manifest = json.loads((tmp_path / "out" / MANIFEST_FILE).read_text())
    assert manifest["run"]["model_card"]["file"] == "README.md"
    assert verify_output(tmp_path / "out").ok
    (tmp_path / "out" / "README.md").write_text(card.replace("Merged model", "My model"))
    check = verify_output(tmp_path / "out")
    assert not check.ok and any("README.md" in p for p in check.problems)
    r2 = CliRunner().invoke(app, ["verify", str(tmp_path / "out")])
    assert r2.exit_code != 0 and "README.md" in r2.output


def test_no_card_when_turned_off_and_the_same_digest(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "linear")
    with_card = merge(config=str(cfg), out=str(tmp_path / "card"), catalog=session_catalog)
    r = CliRunner().invoke(
        app, ["merge", str(cfg), "--out", str(tmp_path / "flag"), "--catalog", session_catalog, "--no-model-card"]
    )
    assert r.exit_code == 0, r.output
    off = config_for(tmp_path, bf16_family, "linear", name="off.yaml", write_model_card=False)
    by_config = merge(config=str(off), out=str(tmp_path / "config"), catalog=session_catalog)
    for out in ("flag", "config"):
        assert not (tmp_path / out / "README.md").exists()
        manifest = json.loads((tmp_path / out / MANIFEST_FILE).read_text())
        assert manifest["run"]["model_card"] is None and manifest["digest"] == with_card["digest"]
        assert verify_output(tmp_path / out).ok
    assert by_config["digest"] == with_card["digest"]
