"""Multi-document configs (mergekit-multi's stages): run in the order they need each other, each
stage a merge, a named stage's output under --intermediate-dir an input of the later ones; a stage
whose output verifies is skipped, so a run killed in a later stage resumes there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from mergepipe.cli import app
from mergepipe.devtools.synthetic import make_family
from mergepipe.errors import BadInput
from mergepipe.flows.merge import merge
from mergepipe.flows.replay import replay
from mergepipe.flows.stages import merge_stages
from mergepipe.storage.model_files import MANIFEST_FILE

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_family(
        tmp_path_factory.mktemp("stagefam"),
        experts=("dense", "dense", "lora"),
        n_layers=2,
        hidden=64,
        intermediate=128,
        vocab=128,
        dtype="bfloat16",
        shards=1,
        seed=4,
    )


def _soup(family) -> dict:
    return {
        "merge_method": "linear",
        "base_model": str(family.base),
        "models": [
            {"model": str(family.base), "parameters": {"weight": 0.5}},
            {"model": str(family.experts[0]), "parameters": {"weight": 0.5}},
        ],
        "block_size": "4KiB",
    }


def _final(family, soup: str) -> dict:
    return {
        "merge_method": "ties",
        "base_model": str(family.base),
        "models": [
            {"model": soup, "parameters": {"weight": 0.7, "density": 0.6}},
            {"model": str(family.experts[1]), "parameters": {"weight": 0.3, "density": 0.6}},
            {"model": str(family.experts[2]), "parameters": {"weight": 0.4, "density": 0.6}},
        ],
        "block_size": "4KiB",
        "budget": "50%",
    }


def _write(path: Path, *docs: dict) -> Path:
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def by_hand(family, tmp_path_factory):
    """The two stages merged one after the other, by hand."""
    tmp = tmp_path_factory.mktemp("byhand")
    soup = merge(config=str(_write(tmp / "soup.yaml", _soup(family))), out=str(tmp / "soup"), catalog=str(tmp / "c"))
    final = merge(
        config=str(_write(tmp / "final.yaml", _final(family, str(tmp / "soup")))),
        out=str(tmp / "final"),
        catalog=str(tmp / "c"),
    )
    return soup["digest"], final["digest"]


def _staged(tmp_path: Path, family) -> Path:
    return _write(tmp_path / "multi.yaml", {"name": "soup", **_soup(family)}, _final(family, "soup"))


def test_stages_give_the_digests_of_merging_them_by_hand(family, by_hand, tmp_path):
    cfg = _staged(tmp_path, family)
    inter, out, catalog = tmp_path / "inter", tmp_path / "out", str(tmp_path / "c.duckdb")
    r = merge_stages(config=str(cfg), out=str(out), intermediate_dir=str(inter), catalog=catalog)
    assert [(s["stage"], s["skipped"]) for s in r["stages"]] == [("soup", False), (None, False)]
    assert (r["stages"][0]["digest"], r["digest"]) == by_hand
    # The final manifest names the stage's manifest, and the model card its location.
    run = json.loads((out / MANIFEST_FILE).read_text())["run"]
    assert run["stages"] == [{"stage": "soup", "manifest": str(inter / "soup" / MANIFEST_FILE), "digest": by_hand[0]}]
    assert str(inter / "soup") in (out / "README.md").read_text()
    # Run again: the stage whose output verifies is skipped.
    again = merge_stages(config=str(cfg), out=str(out), intermediate_dir=str(inter), catalog=catalog, overwrite=True)
    assert [(s["stage"], s["skipped"]) for s in again["stages"]] == [("soup", True), (None, False)]
    assert again["digest"] == by_hand[1]
    # An intermediate output that no longer verifies is merged again.
    shard = inter / "soup" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    third = merge_stages(config=str(cfg), out=str(out), intermediate_dir=str(inter), catalog=catalog, overwrite=True)
    assert [(s["stage"], s["skipped"]) for s in third["stages"]] == [("soup", False), (None, False)]
    assert (third["stages"][0]["digest"], third["digest"]) == by_hand


def test_the_cli_runs_stages_and_refuses_them_without_an_intermediate_dir(family, by_hand, tmp_path):
    cfg = _staged(tmp_path, family)
    r = CliRunner().invoke(app, ["merge", str(cfg), "--out", str(tmp_path / "out")])
    assert r.exit_code == 2 and "--intermediate-dir" in r.output, r.output
    r = CliRunner().invoke(
        app,
        ["merge", str(cfg), "--out", str(tmp_path / "out"), "--intermediate-dir", str(tmp_path / "i")]
        + ["--catalog", str(tmp_path / "c.duckdb"), "--json"],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.output[r.output.index("{") :])["digest"] == by_hand[1]


@pytest.mark.parametrize(
    "docs,match",
    [
        (
            lambda f: [{"name": "a", **_final(f, "b")}, {"name": "b", **_final(f, "a")}, _final(f, "a")],
            "cycle: a -> b -> a",
        ),
        (lambda f: [_soup(f), _final(f, "soup")], "two documents have no name"),
        (lambda f: [{"name": "s", **_soup(f)}, {"name": "s", **_soup(f)}, _final(f, "s")], "stage 's' is named twice"),
        (lambda f: [{"name": "s", **_soup(f)}, {"name": "t", **_final(f, "s")}], "final stage"),
        (
            lambda f: [
                {"name": "s", **_soup(f), "storage_options": {"anon": True}},
                {**_final(f, "s"), "storage_options": {"anon": False}},
            ],
            "storage_options: the stages give different ones",
        ),
    ],
    ids=["cycle", "two-finals", "same-name", "no-final", "storage-options"],
)
def test_bad_stages_are_refused_by_name(family, tmp_path, docs, match):
    cfg = _write(tmp_path / "bad.yaml", *docs(family))
    r = CliRunner().invoke(
        app, ["merge", str(cfg), "--out", str(tmp_path / "out"), "--intermediate-dir", str(tmp_path / "i")]
    )
    assert r.exit_code == 2, r.output
    assert match in r.output and not (tmp_path / "out").exists() and not (tmp_path / "i").exists()


@pytest.mark.slow
def test_killed_in_the_second_stage_resumes_there(family, by_hand, tmp_path):
    cfg = _staged(tmp_path, family)
    inter, out, catalog = tmp_path / "inter", tmp_path / "out", tmp_path / "c.duckdb"
    args = ["merge", str(cfg), "--out", str(out), "--intermediate-dir", str(inter), "--catalog", str(catalog)]
    # The soup has 4 layer groups: the 6th merged is the final stage's second.
    env = dict(
        os.environ,
        KILL_AT="mergepipe.tasks.merge:merge_group:6",
        MERGEPIPE_WORKERS="1",
        MERGEPIPE_ORCHESTRATION="local",
    )
    killed = subprocess.run(
        [sys.executable, str(HERE / "kill_at.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert (inter / "soup" / MANIFEST_FILE).exists() and not out.exists()
    r = merge_stages(config=str(cfg), out=str(out), intermediate_dir=str(inter), catalog=str(catalog))
    assert [(s["stage"], s["skipped"]) for s in r["stages"]] == [("soup", True), (None, False)]
    assert r["digest"] == by_hand[1]


@pytest.mark.slow
def test_stages_as_prefect_subflows(family, by_hand, tmp_path, prefect_flows):
    cfg = _staged(tmp_path, family)
    r = merge_stages(
        config=str(cfg), out=str(tmp_path / "out"), intermediate_dir=str(tmp_path / "i"), catalog=str(tmp_path / "c")
    )
    assert r["digest"] == by_hand[1] and r["flow_run_id"]


def test_a_replay_of_the_final_output_replays_the_chain(family, by_hand, tmp_path):
    cfg = _staged(tmp_path, family)
    inter, out, catalog = tmp_path / "inter", tmp_path / "out", str(tmp_path / "c.duckdb")
    merge_stages(config=str(cfg), out=str(out), intermediate_dir=str(inter), catalog=catalog)
    same = replay(manifest=str(out), out=str(tmp_path / "again"), catalog=catalog)
    assert same["digest"] == by_hand[1] and same["stages"][0]["replayed"] is False
    shard = inter / "soup" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = replay(manifest=str(out), out=str(tmp_path / "replayed"), catalog=catalog)
    assert r["stages"] == [{"stage": "soup", "out": str(inter / "soup"), "digest": by_hand[0], "replayed": True}]
    assert r["digest"] == by_hand[1]
    for p in (inter / "soup").iterdir():
        if p.is_file():
            p.unlink()
    with pytest.raises(BadInput, match="stage 'soup' is gone with its manifest"):
        replay(manifest=str(out), out=str(tmp_path / "gone"), catalog=catalog)
