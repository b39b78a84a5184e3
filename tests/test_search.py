"""Merge search (`mergepipe search`): trials scored by a command, failures recorded, the best
merged again and published with its record, bad ranges refused before any merge, a killed
search resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import pytest
import yaml
from typer.testing import CliRunner

from mergepipe.cli import app
from mergepipe.config.search import load_search
from mergepipe.devtools.synthetic import make_family
from mergepipe.errors import BadInput
from mergepipe.publish.manifest import load_manifest, verify_output

from .helpers import EVENT_S, wait_until

runner = CliRunner()

# Scores a candidate by its distance to the first expert (lower is better); appends each folder
# it scores to LOG; fails (exit 1, a message on stderr) for the trial folders named in FAIL.
SCORER = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    import numpy as np
    from safetensors.numpy import load_file

    model, target = Path(sys.argv[1]), Path(sys.argv[2])
    with open(os.environ["SCORER_LOG"], "a") as f:
        f.write(str(model) + "\\n")
    for bad in filter(None, os.environ.get("SCORER_FAIL", "").split(",")):
        if f"/{bad}/" in str(model) + "/":
            print(f"refusing {bad}: synthetic failure", file=sys.stderr)
            sys.exit(1)

    def load(folder):
        out = {}
        for p in sorted(folder.glob("*.safetensors")):
            out.update(load_file(str(p)))
        return out

    a, b = load(model), load(target)
    d = sum(float(np.sum((a[k].astype(np.float64) - b[k].astype(np.float64)) ** 2)) for k in b)
    print("scored", file=sys.stderr)
    print(json.dumps({"score": d ** 0.5, "tensors": len(a)}))
    """
)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("search-family")
    fam = make_family(
        root, experts=("dense", "dense"), n_layers=2, hidden=32, intermediate=64, vocab=64, dtype="float32", shards=1
    )
    scorer = root / "scorer.py"
    scorer.write_text(SCORER)
    return fam, scorer


def search_config(path: Path, family, *, trials=6, sampler="random", **search) -> Path:
    fam, scorer = family
    cfg = {
        "merge_method": "task_arithmetic",
        "base_model": str(fam.base),
        "block_size": "4KiB",
        "models": [{"model": str(e), "parameters": {"weight": {"search": [0.0, 1.0]}}} for e in fam.experts],
        "search": {
            "trials": trials,
            "budget": "50%",
            "top_k": 2,
            "sampler": sampler,
            "seed": 3,
            "evaluate": {"command": f"{sys.executable} {scorer} {{model}} {fam.experts[0]}", "timeout": 300},
            **search,
        },
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_search(cfg: Path, out: Path, catalog: Path, *args: str):
    return runner.invoke(app, ["search", str(cfg), "--out", str(out), "--catalog", str(catalog), "--json", *args])


def rows(catalog: Path, query: str) -> list[tuple]:
    with duckdb.connect(str(catalog), read_only=True) as con:
        return con.execute(query).fetchall()


@pytest.mark.slow
def test_search_scores_trials_and_publishes_the_best(family, tmp_path, monkeypatch):
    monkeypatch.setenv("SCORER_LOG", str(tmp_path / "scored.log"))
    monkeypatch.setenv("SCORER_FAIL", "trial-2")  # one trial's evaluation fails: the search goes on
    cfg, out, catalog = search_config(tmp_path / "s.yml", family), tmp_path / "best", tmp_path / "c.duckdb"
    r = run_search(cfg, out, catalog, "--scratch", str(tmp_path / "scratch"))
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)

    trials, finals = result["trials"], result["finals"]
    assert sorted(t["trial"] for t in trials) == list(range(6))
    failed = [t for t in trials if t["state"] != "complete"]
    assert [t["trial"] for t in failed] == [2]
    assert "exit" in failed[0]["error"] and "synthetic failure" in failed[0]["error"]
    for t in trials:
        if t["state"] == "complete":
            assert 0 < t["expert_bytes_read"] <= t["budget_bytes"] < 2 * t["expert_bytes_read"] + 8192
    # The top 2 by budgeted score were merged again at 100%, and the better of those published.
    done = sorted((t for t in trials if t["state"] == "complete"), key=lambda t: (t["score"], t["trial"]))
    assert sorted(f["trial"] for f in finals) == sorted(t["trial"] for t in done[:2])
    best = min(finals, key=lambda f: (f["score"], f["trial"]))
    assert result["best"]["trial"] == best["trial"] and result["best"]["final_score"] == best["score"]
    read = {t["trial"]: t["expert_bytes_read"] for t in trials}
    assert all(read[f["trial"]] < f["expert_bytes_read"] <= f["budget_bytes"] for f in finals)

    check = verify_output(out)
    assert check.ok and check.digest == result["digest"] == best["merge_digest"]
    recorded = load_manifest(out)["run"]["search"]
    assert recorded["study"] == result["search"] and recorded["trial"] == best["trial"]
    assert recorded["score"] == next(t["score"] for t in trials if t["trial"] == best["trial"])
    assert recorded["final_score"] == best["score"]

    # The catalog holds every trial and final, readable with `catalog sql`; scratch is empty.
    assert rows(catalog, "SELECT final, count(*) FROM search_trials GROUP BY final ORDER BY final") == [
        (False, 6),
        (True, 2),
    ]
    q = runner.invoke(app, ["catalog", "sql", "SELECT trial, state FROM search_trials", "--catalog", str(catalog)])
    assert q.exit_code == 0 and "failed" in q.stdout
    schema = runner.invoke(app, ["catalog", "schema", "--catalog", str(catalog), "--json"])
    assert "search_trials" in schema.stdout
    assert not (tmp_path / "scratch" / result["search"]).exists()

    report = Path(result["report"])
    assert report == tmp_path / "best-search"
    data = json.loads((report / "search.json").read_text())
    assert data["agreement"]["trials_compared"] == sorted(f["trial"] for f in finals)
    assert (report / "search.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Rank agreement" in (report / "search.md").read_text()

    # The same command again: the study is complete and the output published; nothing is merged.
    again = run_search(cfg, out, catalog, "--scratch", str(tmp_path / "scratch"))
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["digest"] == result["digest"]
    assert rows(catalog, "SELECT count(*) FROM search_trials") == [(8,)]


def test_a_command_failing_on_the_base_stops_the_search(family, tmp_path, monkeypatch):
    monkeypatch.setenv("SCORER_LOG", str(tmp_path / "scored.log"))
    cfg = search_config(tmp_path / "s.yml", family)
    doc = yaml.safe_load(cfg.read_text())
    doc["search"]["evaluate"] = {"command": f"{sys.executable} -c 'import sys; sys.exit(\"no such metric\")' {{model}}"}
    cfg.write_text(yaml.safe_dump(doc))
    catalog = tmp_path / "c.duckdb"
    r = run_search(cfg, tmp_path / "best", catalog)
    assert r.exit_code == 2, r.output
    assert "base model" in r.output and "no such metric" in r.output
    assert not (tmp_path / "best").exists()
    assert rows(catalog, "SELECT count(*) FROM runs") == [(0,)] if catalog.exists() else True


BAD = [
    (
        {"models[0]": {"weight": {"search": [0.9, 0.1]}}},
        "models[0].parameters.weight: search: low 0.9 is above high 0.1",
    ),
    ({"models[0]": {"weight": {"choice": []}}}, "models[0].parameters.weight: choice: give a non-empty list"),
    (
        {"top": {"merge_method": "linear", "parameters": {"density": {"search": [0.1, 0.9]}}}},
        "parameters.density: not a parameter of merge_method 'linear'",
    ),
    ({"top": {"dtype": {"search": [1, 2]}}}, "dtype: a range is for a numeric merge parameter"),
    (
        {"top": {"parameters": {"normalize": {"search": [0, 1]}}}},
        "parameters.normalize: normalize of task_arithmetic is not numeric",
    ),
    ({"models[0]": {"weight": {"search": [0.1, 0.9], "log": True, "step": 0.1}}}, "log and step: give one"),
    ({"models[0]": {"weight": {"search": [0.0, 0.9], "log": True}}}, "log: true needs a low above 0"),
    ({"search": {"sampler": "grid"}}, "sampler grid needs a step on every range"),
    ({"search": {"sampler": "anneal"}}, "search.sampler: unknown 'anneal'"),
    ({"search": {"trails": 5}}, "search.trails: unknown key"),
    ({"search": {"evaluate": {"command": "score.sh"}}}, "name the candidate's folder as {model}"),
    ({"top": {"merge_method": {"choice": ["task_arithmetic", "slerp"]}}}, "merge_method = 'slerp'"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_ranges_and_choices_are_refused_before_any_merge(family, tmp_path, change, message):
    cfg = search_config(tmp_path / "s.yml", family)
    doc = yaml.safe_load(cfg.read_text())
    for where, value in change.items():
        if where == "search":
            doc["search"].update(value)
        elif where == "top":
            doc.update(value)
        else:
            doc["models"][int(where[-2])]["parameters"].update(value)
    cfg.write_text(yaml.safe_dump(doc))
    with pytest.raises(BadInput) as err:
        load_search(cfg)
    assert message in str(err.value) and str(cfg) in str(err.value)


def test_bad_ranges_exit_2_naming_the_key(family, tmp_path):
    cfg = search_config(tmp_path / "s.yml", family)
    doc = yaml.safe_load(cfg.read_text())
    doc["models"][1]["parameters"]["weight"] = {"search": [1, 0]}
    cfg.write_text(yaml.safe_dump(doc))
    r = run_search(cfg, tmp_path / "best", tmp_path / "c.duckdb")
    assert r.exit_code == 2 and "models[1].parameters.weight" in r.output
    assert not (tmp_path / "c.duckdb").exists() and not (tmp_path / "best").exists()


@pytest.mark.slow
def test_choices_and_grid_cover_the_space(family, tmp_path, monkeypatch):
    """A grid over a stepped range and a choice of method runs each point once."""
    monkeypatch.setenv("SCORER_LOG", str(tmp_path / "scored.log"))
    cfg = search_config(tmp_path / "s.yml", family, trials=4, sampler="grid")
    doc = yaml.safe_load(cfg.read_text())
    doc["merge_method"] = {"choice": ["task_arithmetic", "linear"]}
    doc["models"][0]["parameters"]["weight"] = {"search": [0.25, 0.75], "step": 0.5}
    doc["models"][1]["parameters"]["weight"] = 0.5
    doc["search"]["budget"] = "100%"  # the trials' merges are the final ones: not merged again
    cfg.write_text(yaml.safe_dump(doc))
    r = run_search(cfg, tmp_path / "best", tmp_path / "c.duckdb")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    trials = {t["trial"]: t for t in result["trials"]}
    assert len(result["finals"]) == 2
    assert all(f["score"] == trials[f["trial"]]["score"] for f in result["finals"])
    assert len((tmp_path / "scored.log").read_text().splitlines()) == 1 + 4  # the base and each trial, once
    seen = {
        (t["params"]["merge_method"], t["params"]["models[0].parameters.weight"])
        for t in json.loads(r.stdout)["trials"]
    }
    assert seen == {(m, w) for m in ("task_arithmetic", "linear") for w in (0.25, 0.75)}


@pytest.mark.slow
def test_a_killed_search_resumes_with_its_finished_trials(family, tmp_path):
    """SIGKILLed after some trials, run again: the finished trials are kept, the one that was
    running is run again, the total is `trials`, and the published output verifies."""
    log = tmp_path / "scored.log"
    cfg = search_config(tmp_path / "s.yml", family, trials=6)
    out, catalog = tmp_path / "best", tmp_path / "c.duckdb"
    env = {**os.environ, "SCORER_LOG": str(log), "MERGEPIPE_ORCHESTRATION": "local"}
    cmd = [sys.executable, "-m", "mergepipe.cli", "search", str(cfg), "--out", str(out), "--catalog", str(catalog)]
    proc = subprocess.Popen(cmd + ["--json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # The base's evaluation and three trials' scored: the fourth trial is on its way.
        wait_until(lambda: log.exists() and len(log.read_text().splitlines()) >= 4, EVENT_S, "three trials scored")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    first = [t for (t,) in rows(catalog, "SELECT trial FROM search_trials WHERE NOT final ORDER BY trial")]
    assert len(first) >= 2  # the third may have been scored but not yet recorded
    again = subprocess.run(cmd + ["--json"], env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout)
    recorded = [t for (t,) in rows(catalog, "SELECT trial FROM search_trials WHERE NOT final ORDER BY trial")]
    assert len(recorded) == len(result["trials"]) == 6
    scored = log.read_text()
    for t in first:  # the finished trials were kept, not run again
        assert scored.count(f"/trial-{t}/") == 1, scored
    assert verify_output(out).ok


@pytest.mark.slow
def test_a_search_over_a_real_language_model_beats_the_uniform_merge(tmp_path):
    """A tiny Llama family (a base and an expert per text domain), the built-in loss evaluator on
    held-out text of both domains: a 12-trial search at 10% over the experts' weights finds a
    final score at least as good as the uniform-weight merge's, and no trial reads more expert
    bytes than its budget."""
    from .llama_family import make_llama_family

    fam = make_llama_family(tmp_path / "llama")
    evaluate = {"perplexity": {"data": fam["heldout_mixed"], "field": "text", "max_length": 64}}
    common = {"merge_method": "task_arithmetic", "base_model": fam["base"], "block_size": "1KiB"}
    uniform = tmp_path / "uniform.yml"
    uniform.write_text(
        yaml.safe_dump({**common, "models": [{"model": e, "parameters": {"weight": 0.5}} for e in fam["experts"]]})
    )
    catalog = tmp_path / "c.duckdb"
    merged = runner.invoke(app, ["merge", str(uniform), "--out", str(tmp_path / "uniform"), "--catalog", str(catalog)])
    assert merged.exit_code == 0, merged.output
    from mergepipe.config.search import PerplexityEvaluation
    from mergepipe.evaluate import evaluate as score_of

    setting = PerplexityEvaluation(fam["heldout_mixed"], "text", None, 64)
    uniform_score = score_of(setting, str(tmp_path / "uniform"))
    assert uniform_score.ok, uniform_score.error

    cfg = tmp_path / "search.yml"
    models = [{"model": e, "parameters": {"weight": {"search": [0.0, 1.0]}}} for e in fam["experts"]]
    cfg.write_text(
        yaml.safe_dump(
            {**common, "models": models, "search": {"trials": 12, "budget": "10%", "seed": 0, "evaluate": evaluate}}
        )
    )
    r = run_search(cfg, tmp_path / "best", catalog)
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert len(result["trials"]) == 12 and all(t["state"] == "complete" for t in result["trials"])
    assert all(t["expert_bytes_read"] <= t["budget_bytes"] for t in result["trials"])
    assert result["best"]["final_score"] <= uniform_score.score
    assert result["best"]["final_score"] < result["base_score"]
    # The published output scores as its final merge did (the same bytes, loaded again).
    assert score_of(setting, str(tmp_path / "best")).score == result["best"]["final_score"]


@pytest.mark.slow
def test_a_search_as_a_prefect_flow_runs_trials_in_parallel(family, tmp_path, monkeypatch, prefect_flows):
    """On a Prefect API, two trials at a time: each trial's merge a subflow run and its evaluation
    a task run; the final merges' table is an artifact keyed by the output."""
    monkeypatch.setenv("SCORER_LOG", str(tmp_path / "scored.log"))
    from mergepipe.flows.artifacts import artifact_key
    from mergepipe.flows.search import SEARCH_KEY, merge_search

    cfg = search_config(tmp_path / "s.yml", family, trials=4, parallel=2)
    out = str(tmp_path / "best")
    result = merge_search(config=str(cfg), out=out, catalog=str(tmp_path / "c.duckdb"))
    assert len(result["trials"]) == 4 and verify_output(tmp_path / "best").ok
    workers = {t["worker"] for t in result["trials"]}
    assert len(workers) == 1  # one process, two threads

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(SEARCH_KEY, out)]))
        )
        assert found


@pytest.mark.slow
def test_trials_run_on_dask_workers(family, tmp_path, monkeypatch, prefect_flows):
    """With runner "dask", each trial (its merge and its evaluation) is one task run on a worker
    of a local cluster of `parallel` processes; the study stays in the search's process, which
    publishes what the thread runner would."""
    monkeypatch.setenv("SCORER_LOG", str(tmp_path / "scored.log"))
    from mergepipe.flows.search import merge_search

    cfg = search_config(tmp_path / "s.yml", family, trials=4, parallel=2)
    result = merge_search(
        config=str(cfg), out=str(tmp_path / "dask"), catalog=str(tmp_path / "c.duckdb"), runner="dask"
    )
    assert sorted(t["trial"] for t in result["trials"]) == list(range(4))
    assert all(t["state"] == "complete" for t in result["trials"] + result["finals"])
    here = f":{os.getpid()}"
    workers = {r["worker"] for r in result["trials"] + result["finals"]}
    assert workers and not any(w.endswith(here) for w in workers)  # none ran in this process
    scored = (tmp_path / "scored.log").read_text().splitlines()
    assert len(scored) == 1 + 4 + 2  # the base, each trial, each final: once each

    threads = merge_search(config=str(cfg), out=str(tmp_path / "threads"), catalog=str(tmp_path / "t.duckdb"))
    assert [t["merge_digest"] for t in threads["trials"]] == [t["merge_digest"] for t in result["trials"]]
    assert threads["digest"] == result["digest"] and verify_output(tmp_path / "dask").ok


@pytest.mark.slow
def test_two_processes_share_one_search_over_s3_and_a_shared_catalog(family, s3, pg_catalog, tmp_path):
    """Two processes with homes of their own, one PostgreSQL catalog (where the study lives) and
    a family on S3 run one search: every trial runs once, one of them publishes, and the experts'
    bytes fetched from S3 over the whole search are at most the union of the access sets of its
    merges (the block cache serves a block one trial read to every later one)."""
    from mergepipe.catalog import db
    from mergepipe.config.environment import catalog_location
    from mergepipe.plan import saved

    from .test_s3 import BUCKET, upload_folder

    fam, scorer = family
    base = upload_folder(s3, fam.base, "search/base")
    experts = [upload_folder(s3, e, f"search/expert-{i}") for i, e in enumerate(fam.experts)]
    doc = {
        "merge_method": "task_arithmetic",
        "base_model": base,
        "block_size": "2KiB",
        "models": [{"model": e, "parameters": {"weight": {"search": [0.0, 1.0]}}} for e in experts],
    }
    env = {**os.environ, "SCORER_LOG": str(tmp_path / "scored.log"), "MERGEPIPE_ORCHESTRATION": "local"}

    def cli(*args: str, home: str = "home-0"):
        return [sys.executable, "-m", "mergepipe.cli", *args, "--catalog", pg_catalog], {
            **env,
            "MERGEPIPE_HOME": str(tmp_path / home),
        }

    indexed = tmp_path / "index.yml"
    indexed.write_text(
        yaml.safe_dump({**doc, "models": [{"model": e, "parameters": {"weight": 0.5}} for e in experts]})
    )
    cmd, e = cli("index", str(indexed))
    assert subprocess.run(cmd, env=e, capture_output=True, text=True).returncode == 0  # the index pass, not counted
    s3.proxy.reset()

    cfg = tmp_path / "search.yml"
    search = {
        "trials": 8,
        "budget": "20%",
        "final_budget": "40%",
        "top_k": 2,
        "sampler": "random",
        "seed": 5,
        "evaluate": {"command": f"{sys.executable} {scorer} {{model}} {fam.experts[0]}"},
    }
    cfg.write_text(yaml.safe_dump({**doc, "search": search}))
    out = f"s3://{BUCKET}/search/best"
    procs = []
    for i in range(2):
        cmd, e = cli(
            "search", str(cfg), "--out", out, "--cache", str(tmp_path / "cache"), "--scratch", str(tmp_path / f"scratch-{i}"),
            "--report", str(tmp_path / f"report-{i}"), "--json", home=f"home-{i}",
        )  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    results = [json.loads(o) for o, _ in outs]
    assert results[0]["digest"] == results[1]["digest"]

    with db.connect(pg_catalog, read_only=True) as con:
        trials = con.execute("SELECT trial, plan_key FROM search_trials WHERE NOT final ORDER BY trial").fetchall()
        finals = con.execute("SELECT trial, plan_key FROM search_trials WHERE final").fetchall()
        published = con.execute("SELECT plan_digest FROM runs WHERE out_uri = ?", [out]).fetchall()
    assert [t for t, _ in trials] == list(range(8))  # each trial once
    assert len(finals) == 2 and len(published) == 1

    location = catalog_location(pg_catalog)
    blocks, header_room, planned = set(), 0, 0
    for _, key in trials + finals:
        plan = saved.load(saved.PlanRef(key, location))[0]
        planned += plan.expert_bytes_planned
        for row in plan.access.to_pylist():
            blocks.add((row["expert"], row["tensor"], row["block"], row["bytes"]))
    union = sum(b for *_, b in blocks)
    # Each process reads each expert file's header (a few KiB) at most once more than the cache
    # holds it: what the bound allows beside the blocks.
    for e in fam.experts:
        header_room += 2 * (8 + int.from_bytes((e / "model.safetensors").read_bytes()[:8], "little"))
    fetched = sum(
        x.body_bytes for x in s3.proxy.taken() if x.method == "GET" and "/search/expert-" in x.key and x.range
    )
    assert 0 < fetched <= union + header_room < planned  # the trials' plans overlap: the cache paid
    assert sum(t["cache_bytes"] for t in results[0]["trials"]) > 0  # shown as the cache role


def test_an_output_already_there_is_refused_before_any_trial(family, tmp_path):
    cfg = search_config(tmp_path / "s.yml", family)
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "weights.bin").write_bytes(b"someone else's")
    r = run_search(cfg, tmp_path / "best", tmp_path / "c.duckdb")
    assert r.exit_code == 2 and "best" in r.output and "overwrite" in r.output
    assert not (tmp_path / "c.duckdb").exists()


def test_rank_agreement_by_hand():
    from mergepipe.publish.search_report import ranks, spearman

    assert ranks([3.0, 1.0, 1.0, 2.0]) == [4.0, 1.5, 1.5, 3.0]
    assert spearman([1, 2, 3], [10, 20, 30]) == 1.0
    assert spearman([1, 2, 3], [3, 2, 1]) == -1.0
    # Pearson's correlation of the ranks [1..5] and [1, 2, 3.5, 5, 3.5]: 0.82078…
    assert abs(spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) - 0.8207826816681233) < 1e-12
    assert spearman([1, 2], [4, 4]) is None and spearman([1], [2]) is None


def test_the_block_cache_keeps_an_object_by_its_version_and_trims_the_least_recently_read(tmp_path):
    """An S3 object's cached bytes are those of the ETag last seen (a new ETag: a new entry); a
    trim drops what was read least recently, and waits for no reader (it gives up instead)."""
    import time

    from mergepipe.storage import cache

    uri = "s3://bucket/model/model.safetensors"
    cache.pin(uri, "etag-1")
    assert cache.cacheable(uri) and not cache.cacheable("s3://bucket/other.safetensors")
    old = cache.Entry(tmp_path, uri)
    old.add([(0, b"a" * 100)])
    cache.pin(uri, "etag-2")  # the object changed
    new = cache.Entry(tmp_path, uri)
    assert new.data != old.data and new.held() == [] and old.held() == [[0, 100]]
    new.add([(0, b"b" * 300)])
    time.sleep(0.01)
    cache.pin(uri, "etag-1")
    assert cache.Entry(tmp_path, uri).read(0, 100) == b"a" * 100  # read now: the most recent
    assert cache.held_bytes(tmp_path) == 400
    with cache.reading(tmp_path):
        assert cache.trim(tmp_path, 150) is None  # a reader holds it: not now
    assert cache.trim(tmp_path, 150) == 100
    assert old.held() == [[0, 100]] and new.held() == [] and not new.data.exists()


@pytest.mark.slow
def test_a_search_leaves_the_process_without_its_block_cache(family, tmp_path, monkeypatch):
    """The cache a search makes for itself is the search's only: later merges in the process
    read without it."""
    from mergepipe.storage import cache

    monkeypatch.setenv("SCORER_LOG", str(tmp_path / "scored.log"))
    monkeypatch.delenv(cache.ENV, raising=False)
    cfg = search_config(tmp_path / "s.yml", family, trials=2, top_k=1)
    r = run_search(cfg, tmp_path / "best", tmp_path / "c.duckdb", "--scratch", str(tmp_path / "scratch"))
    assert r.exit_code == 0, r.output
    assert cache.ENV not in os.environ and (tmp_path / "scratch" / "cache").is_dir()


def test_ranges_anywhere_a_parameter_is_set(family, tmp_path):
    """A range per slice source, in a gradient's entries and in a filter's value: each place is
    searched under its own dotted name, and a candidate puts each value back in its place."""
    fam, _ = family
    cfg = tmp_path / "s.yml"
    doc = {
        "merge_method": "task_arithmetic",
        "slices": [
            {
                "sources": [
                    {"model": str(fam.base), "layer_range": [0, 2]},
                    {
                        "model": str(fam.experts[0]),
                        "layer_range": [0, 2],
                        "parameters": {"weight": [0.1, {"search": [0.2, 0.8]}, 0.9]},
                    },
                    {
                        "model": str(fam.experts[1]),
                        "layer_range": [0, 2],
                        "parameters": {"weight": [{"filter": "mlp", "value": {"search": [0.0, 1.0]}}, {"value": 0.5}]},
                    },
                ]
            }
        ],
        "base_model": str(fam.base),
        "search": {"evaluate": {"command": "true {model}"}},
    }
    cfg.write_text(yaml.safe_dump(doc))
    spec = load_search(cfg)
    names = [p.name for p in spec.params]
    assert names == [
        "slices[0].sources[1].parameters.weight[1]",
        "slices[0].sources[2].parameters.weight[0].value",
    ]
    values = dict(zip(names, (0.25, 0.75)))
    got = spec.candidate_spec(values).slices[0].sources
    assert got[1].parameters.weight == [0.1, 0.25, 0.9]
    assert spec.candidate(values)["slices"][0]["sources"][2]["parameters"]["weight"][0]["value"] == 0.75


def test_trials_left_running_are_told_or_queued_again():
    """A trial whose process died: told its recorded result when it has one, else queued again
    with its values; one asked but never claimed (its process died in between) too."""
    import optuna

    from mergepipe.catalog import study as studies

    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), sampler=optuna.samplers.RandomSampler(0))
    dead = "no-such-host:1"
    recorded, lost, unclaimed = study.ask(), study.ask(), study.ask()
    for t in (recorded, lost):
        t.suggest_float("w", 0.0, 1.0)
        t.set_user_attr(studies.OWNER, dead)
        t.set_user_attr(studies.HEARTBEAT, 0.0)
    rows = {recorded.number: {"state": "complete", "score": 0.5}}
    assert studies.requeue_stale(study, rows.get, stale_after=3600) == [lost.number]  # the unclaimed one is young
    assert studies.requeue_stale(study, rows.get, stale_after=0) == [unclaimed.number]
    states = {t.number: t.state.name for t in study.trials}
    assert states[recorded.number] == "COMPLETE" and study.trials[recorded.number].value == 0.5
    assert states[lost.number] == "FAIL" and states[unclaimed.number] == "FAIL"
    waiting = [t for t in study.trials if t.state.name == "WAITING"]
    queued = [t.system_attrs.get("fixed_params", {}) for t in waiting]  # Optuna's record of enqueued values
    assert queued == [study.trials[lost.number].params, {}]
    assert len(studies.counted(study)) == 3  # the told one and the two queued again
