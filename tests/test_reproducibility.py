"""Same inputs, same digest and bytes; replay reproduces; verify catches corruption."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from mergepipe.cli import app
from mergepipe.devtools.synthetic import FamilyPaths, dense_expert
from mergepipe.errors import BadInput
from mergepipe.flows.merge import merge
from mergepipe.flows.replay import replay
from mergepipe.publish.manifest import MANIFEST_FILE, load_manifest, verify_output

from .helpers import config_for, replace_model
from .reference import load_model


def _shards(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("method,budget", [("task_arithmetic", "25%"), ("dare_ties", "40%")])
def test_same_merge_twice_same_digest_and_bytes_and_replay_reproduces(
    method, budget, bf16_family, tmp_path, session_catalog
):
    cfg = config_for(tmp_path, bf16_family, method, density=0.6 if method == "dare_ties" else None, seed=11)
    a = merge(config=str(cfg), out=str(tmp_path / "a"), budget=budget, catalog=session_catalog)
    b = merge(config=str(cfg), out=str(tmp_path / "b"), budget=budget, catalog=session_catalog)
    assert a["digest"] == b["digest"]
    assert _shards(tmp_path / "a") == _shards(tmp_path / "b")
    assert len(_shards(tmp_path / "a")) > 1  # the output is sharded
    c = replay(manifest=str(tmp_path / "a" / MANIFEST_FILE), out=str(tmp_path / "c"), catalog=session_catalog)
    assert c["digest"] == a["digest"]
    assert _shards(tmp_path / "c") == _shards(tmp_path / "a")
    assert c["expert_bytes_read"] == a["expert_bytes_planned"]
    # The run section differs (times), the content does not.
    ma, mc = load_manifest(tmp_path / "a"), load_manifest(tmp_path / "c")
    assert ma["content"] == mc["content"] and mc["run"]["kind"] == "replay"
    # Side files are copied byte for byte.
    for name in ("config.json", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (bf16_family.base / name).read_bytes()


def test_digest_ignores_location_and_depends_on_budget(bf16_family, tmp_path, session_catalog):
    moved = tmp_path / "moved"
    shutil.copytree(bf16_family.base.parent, moved)
    fam2 = FamilyPaths(moved / "base", [moved / e.name for e in bf16_family.experts])
    a = merge(
        config=str(config_for(tmp_path, bf16_family, "task_arithmetic", name="a.yaml")),
        out=str(tmp_path / "a"),
        budget="30%",
        catalog=session_catalog,
    )
    b = merge(
        config=str(config_for(tmp_path, fam2, "task_arithmetic", name="b.yaml")),
        out=str(tmp_path / "b"),
        budget="30%",
        catalog=session_catalog,
    )
    c = merge(
        config=str(config_for(tmp_path, fam2, "task_arithmetic", name="b.yaml")),
        out=str(tmp_path / "c"),
        budget="31%",
        catalog=session_catalog,
    )
    assert a["digest"] == b["digest"] != c["digest"]


def test_verify_catches_one_flipped_byte(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "ties", density=0.5)
    merge(config=str(cfg), out=str(tmp_path / "out"), budget="50%", catalog=session_catalog)
    assert verify_output(tmp_path / "out").ok
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", str(tmp_path / "out"), "--json"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["ok"] is True
    shard = sorted((tmp_path / "out").glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    result = verify_output(tmp_path / "out")
    assert not result.ok and shard.name in result.problems[0]
    bad = runner.invoke(app, ["verify", str(tmp_path / "out")])
    assert bad.exit_code == 1


def test_hand_edited_manifest_is_refused(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    merge(config=str(cfg), out=str(tmp_path / "out"), budget="20%", catalog=session_catalog)
    path = tmp_path / "out" / MANIFEST_FILE
    m = json.loads(path.read_text())
    m["content"]["plan"]["error_bound"] = 0.0
    path.write_text(json.dumps(m))
    with pytest.raises(BadInput, match="does not match its digest"):
        verify_output(tmp_path / "out")
    verified = CliRunner().invoke(app, ["verify", str(tmp_path / "out")])
    assert verified.exit_code == 2 and "edited by hand" in verified.output
    result = CliRunner().invoke(
        app, ["replay", str(path), "--out", str(tmp_path / "again"), "--catalog", session_catalog]
    )
    assert result.exit_code == 2
    assert not (tmp_path / "again").exists()


def test_replay_refuses_a_changed_input(bf16_family, tmp_path, session_catalog):
    family_copy = tmp_path / "family"
    shutil.copytree(bf16_family.base.parent, family_copy)
    fam = FamilyPaths(family_copy / "base", [family_copy / e.name for e in bf16_family.experts])
    cfg = config_for(tmp_path, fam, "task_arithmetic")
    merge(config=str(cfg), out=str(tmp_path / "out"), budget="20%", catalog=session_catalog)
    # Rewrite expert 1 with different content (same names and shapes).
    changed = dense_expert(load_model(fam.base), seed=999)
    replace_model(fam.experts[1], changed, shards=2)
    result = CliRunner().invoke(
        app,
        [
            "replay",
            str(tmp_path / "out" / MANIFEST_FILE),
            "--out",
            str(tmp_path / "again"),
            "--catalog",
            session_catalog,
        ],
    )
    assert result.exit_code == 2, result.output
    assert "expert-1" in result.output and "changed" in result.output
    assert not (tmp_path / "again").exists()


def test_merge_artifacts_can_be_read_back_from_the_api(bf16_family, tmp_path, session_catalog, prefect_flows):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from mergepipe.flows.artifacts import PLAN_KEY, SUMMARY_KEY, artifact_key

    cfg = config_for(tmp_path, bf16_family, "task_arithmetic", budget="30%")
    result = merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    assert result["flow_run_id"]
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[result["flow_run_id"]]))
        )
    by_key = {a.key: a for a in found}
    out = str(tmp_path / "out")
    plan_key, summary_key = artifact_key(PLAN_KEY, out), artifact_key(SUMMARY_KEY, out)
    assert set(by_key) == {plan_key, summary_key}
    assert plan_key.startswith("merge-plan-") and plan_key.split("-")[-2] == "out"
    table = json.loads(by_key[plan_key].data)
    assert sum(r["selected_bytes"] for r in table) == result["expert_bytes_planned"]
    assert {r["position"] for r in table} == {0, 1, 2}
    assert {r["expert"] for r in table} == {e.name for e in bf16_family.experts}  # display names
    summary = by_key[summary_key].data
    assert result["digest"] in summary and str(result["expert_bytes_read"]) in summary
    assert f"file://{tmp_path / 'out'}" in summary and "| resumed layer groups | none |" in summary
