"""Models read straight from a Hub-shaped server (tests/hub_server.py) on loopback: hf://
locations pinned to commits, https:// folders, exact ranged reads counted by the server, a
branch that moves, a flaky server, and tokens."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from mergepipe.cli import app
from mergepipe.devtools.synthetic import make_family
from mergepipe.errors import BadInput
from mergepipe.execute import memory, streamed, windowed
from mergepipe.flows.index_family import index_family
from mergepipe.flows.merge import merge
from mergepipe.flows.replay import replay
from mergepipe.operators import slabs
from mergepipe.storage import hub as hub_module
from mergepipe.storage import remote
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.model_files import MANIFEST_FILE
from mergepipe.storage.reader import RangeReader, ReadRequest

from .helpers import EVENT_S, assert_bit_identical, saved_plan, wait_until
from .hub_server import TOKEN, HubServer
from .reference import load_model

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("huggingface_hub") is None, reason="needs mergepipe[hub]"
)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    server = HubServer()
    with pytest.MonkeyPatch.context() as env:  # the module's environment, undone after it
        env.setenv("HF_ENDPOINT", server.endpoint)
        env.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf-home")))  # no saved login
        env.delenv("HF_TOKEN", raising=False)
        try:
            yield server
        finally:
            server.close()


@pytest.fixture(scope="module")
def family(hub, tmp_path_factory):
    """One family on local disk and on the server, as org/base and org/e0..e2."""
    local = make_family(
        tmp_path_factory.mktemp("hubfam"),
        experts=("dense", "dense", "lora"),
        n_layers=2,
        hidden=128,
        intermediate=256,
        vocab=512,
        dtype="bfloat16",
        shards=2,
        seed=11,
    )
    hub.publish("org/base", local.base)
    for i, e in enumerate(local.experts):
        hub.publish(f"org/e{i}", e)
    return local


def _config(tmp_path: Path, base: str, experts: list[str], name: str, **extra) -> Path:
    doc = {
        "merge_method": "task_arithmetic",
        "base_model": base,
        "models": [{"model": e, "parameters": {"weight": w}} for e, w in zip(experts, (0.6, 0.9, 0.4))],
        "block_size": "16KiB",
        **extra,
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def _hub_config(tmp_path: Path, name: str = "hub.yaml", **extra) -> Path:
    return _config(tmp_path, "hf://org/base", [f"hf://org/e{i}" for i in range(3)], name, **extra)


@pytest.fixture(scope="module")
def local_reference(family, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hubref")
    cfg = _config(tmp, str(family.base), [str(e) for e in family.experts], "local.yaml")
    catalog = str(tmp / "catalog.duckdb")
    budgets = {"10%": "10%", "25%": "25%", "100%": None}  # the hub merges give no budget for a full one
    return {k: merge(config=str(cfg), out=str(tmp / k), budget=b, catalog=catalog) for k, b in budgets.items()}


def test_hub_and_https_folders_give_the_local_digest(hub, family, local_reference, tmp_path):
    catalog = str(tmp_path / "catalog.duckdb")
    r = merge(config=str(_hub_config(tmp_path)), out=str(tmp_path / "hub"), catalog=catalog)
    assert r["digest"] == local_reference["100%"]["digest"]
    mirror = _config(
        tmp_path,
        f"{hub.endpoint}/mirror/org/base",
        [f"{hub.endpoint}/mirror/org/e{i}" for i in range(3)],
        "mirror.yaml",
    )
    m = merge(config=str(mirror), out=str(tmp_path / "mirror"), catalog=str(tmp_path / "catalog2.duckdb"))
    assert m["digest"] == local_reference["100%"]["digest"]
    # Every input records the commit it was read at, and the model card names them.
    inputs = json.loads((tmp_path / "hub" / MANIFEST_FILE).read_text())["run"]["inputs"]
    assert all(re.search(r"/resolve/[0-9a-f]{40}$", i["root"]) for i in inputs)
    card = (tmp_path / "hub" / "README.md").read_text()
    assert "base_model:\n- org/base\n- org/e0\n- org/e1\n- org/e2\n" in card
    assert f"- base: `hf://org/base` at commit `{hub.repos['org/base'].refs['main']}`" in card


def test_a_ten_percent_merge_puts_its_plan_on_the_wire(hub, family, local_reference, tmp_path):
    """Counted by the server: the expert files' bytes sent for a merge of an indexed family are
    the plan's bytes (each block run one GET for exactly its bytes) plus the headers."""
    catalog = str(tmp_path / "catalog.duckdb")
    cfg = _hub_config(tmp_path)
    index_family(config=str(cfg), catalog=catalog)
    hub.reset_log()
    r = merge(config=str(cfg), out=str(tmp_path / "out"), budget="10%", catalog=catalog)
    assert r["digest"] == local_reference["10%"]["digest"]
    headers = sum(
        8 + int.from_bytes((p).read_bytes()[:8], "little")
        for e in family.experts
        for p in sorted(e.glob("*.safetensors"))
    )
    sent = hub.wire_bytes(r"^/org/e\d/resolve/.*\.safetensors$")
    assert sent <= 1.05 * r["budget_bytes"] + headers, (sent, r["budget_bytes"], headers)
    assert sent - headers == r["expert_bytes_read"] == r["expert_bytes_planned"]
    assert all(
        s.range and re.match(r"^bytes=\d+-\d+$", s.range)
        for s in hub.log
        if s.path.endswith(".safetensors") and s.method == "GET"
    )


def test_a_moved_branch_stops_replay_naming_the_commits(hub, family, tmp_path):
    catalog = str(tmp_path / "catalog.duckdb")
    hub.publish("org/moving", family.experts[0])
    cfg = _config(tmp_path, "hf://org/base", ["hf://org/moving", "hf://org/e1"], "moving.yaml")
    merge(config=str(cfg), out=str(tmp_path / "out"), catalog=catalog)
    before = hub.repos["org/moving"].refs["main"]
    after = hub.publish("org/moving", family.experts[2])
    with pytest.raises(BadInput, match=rf"hf://org/moving: .*{before}.*{after}"):
        replay(manifest=str(tmp_path / "out" / MANIFEST_FILE), out=str(tmp_path / "again"), catalog=catalog)
    # Pinned to the old commit, the config still reads the bytes it read.
    pinned = _config(tmp_path, "hf://org/base", [f"hf://org/moving@{before}", "hf://org/e1"], "pinned.yaml")
    again = merge(config=str(pinned), out=str(tmp_path / "pinned"), catalog=catalog)
    assert_bit_identical(tmp_path / "pinned", load_model(tmp_path / "out"))
    assert again["digest"]


def test_a_flaky_server_gives_the_same_digest(hub, family, local_reference, tmp_path):
    catalog = str(tmp_path / "catalog.duckdb")
    hub.reset_log()
    hub.fail_share = 0.1
    try:
        r = merge(config=str(_hub_config(tmp_path)), out=str(tmp_path / "out"), budget="10%", catalog=catalog)
    finally:
        hub.fail_share = 0.0
    assert hub.failed > 0
    assert r["digest"] == local_reference["10%"]["digest"]
    run = json.loads((tmp_path / "out" / MANIFEST_FILE).read_text())["run"]
    assert run["bytes"]["retry"] + run["index_bytes"]["retry"] > 0  # ranges asked for again, counted apart


def test_a_private_model_needs_a_token_that_goes_nowhere(hub, family, local_reference, tmp_path):
    hub.publish("org/private-e0", family.experts[0], private=True)
    experts = ["hf://org/private-e0", "hf://org/e1", "hf://org/e2"]
    cfg = _config(tmp_path, "hf://org/base", experts, "private.yaml")
    r = CliRunner().invoke(app, ["merge", str(cfg), "--out", str(tmp_path / "refused")])
    assert r.exit_code == 2, r.output
    assert "hf://org/private-e0" in r.output and "a token is needed" in r.output
    catalog = tmp_path / "catalog.duckdb"
    os.environ["HF_TOKEN"] = TOKEN
    try:
        r = CliRunner().invoke(app, ["merge", str(cfg), "--out", str(tmp_path / "out"), "--catalog", str(catalog)])
    finally:
        os.environ.pop("HF_TOKEN", None)
    assert r.exit_code == 0, r.output
    assert TOKEN not in r.output
    for p in [*(tmp_path / "out").iterdir(), catalog]:
        assert TOKEN.encode() not in p.read_bytes(), p
    # A token in the config's storage_options works too, and is never recorded.
    cfg2 = _config(tmp_path, "hf://org/base", experts, "private2.yaml", storage_options={"hf_token": TOKEN})
    r = CliRunner().invoke(app, ["merge", str(cfg2), "--out", str(tmp_path / "out2"), "--catalog", str(catalog)])
    assert r.exit_code == 0, r.output
    for p in [*(tmp_path / "out2").iterdir(), catalog]:
        assert TOKEN.encode() not in p.read_bytes(), p


def test_mergekit_hub_ids_with_the_hub_key(hub, family, local_reference, tmp_path):
    """`hub: true`: ORG/NAME and ORG/NAME@REVISION as mergekit users write them are Hub models,
    unless a folder of that name lies beside the config (then it is that folder)."""
    sha = hub.repos["org/e1"].refs["main"]
    (tmp_path / "org" / "e2").mkdir(parents=True)
    for p in family.experts[2].iterdir():
        (tmp_path / "org" / "e2" / p.name).write_bytes(p.read_bytes())
    cfg = _config(tmp_path, "org/base", ["org/e0", f"org/e1@{sha}", "org/e2"], "ids.yaml", hub=True)
    r = merge(config=str(cfg), out=str(tmp_path / "out"), catalog=str(tmp_path / "catalog.duckdb"))
    assert r["digest"] == local_reference["100%"]["digest"]
    inputs = json.loads((tmp_path / "out" / MANIFEST_FILE).read_text())["run"]["inputs"]
    assert [i["uri"] for i in inputs] == [
        "hf://org/base",
        "hf://org/e0",
        f"hf://org/e1@{sha}",
        str(tmp_path / "org" / "e2"),
    ]
    without = _config(tmp_path, "org/base", ["org/e0"], "local-ids.yaml")
    r = CliRunner().invoke(app, ["merge", str(without), "--out", str(tmp_path / "o2")])
    assert r.exit_code == 2 and "model not found" in r.output


def test_slices_from_the_hub_record_every_commit_they_read(hub, tmp_path):
    """A frankenmerge of two Hub models reads the second one's layers by its commit URLs: the
    local digest, and a replay refused once that model's branch has moved."""
    from .test_slices import FRANKEN, ORCA, PLATYPUS, _config

    local = merge(
        config=str(_config(tmp_path, FRANKEN, "local.yaml")),
        out=str(tmp_path / "local"),
        catalog=str(tmp_path / "c1.duckdb"),
    )
    hub.publish("llama/orca", Path(ORCA))
    hub.publish("llama/platypus", Path(PLATYPUS))
    text = (
        json.dumps(FRANKEN)
        .replace(json.dumps(ORCA)[1:-1], "hf://llama/orca")
        .replace(json.dumps(PLATYPUS)[1:-1], "hf://llama/platypus")
    )
    catalog = str(tmp_path / "c2.duckdb")
    r = merge(config=str(_config(tmp_path, json.loads(text), "hub.yaml")), out=str(tmp_path / "hub"), catalog=catalog)
    assert r["digest"] == local["digest"]
    run = json.loads((tmp_path / "hub" / MANIFEST_FILE).read_text())["run"]
    assert [c.split("/resolve/")[0].rsplit("/", 1)[1] for c in run["commits"]] == ["orca", "platypus"]
    before = hub.repos["llama/platypus"].refs["main"]
    after = hub.publish("llama/platypus", Path(ORCA))
    with pytest.raises(BadInput, match=rf"hf://llama/platypus: .*{before}.*{after}"):
        replay(manifest=str(tmp_path / "hub" / MANIFEST_FILE), out=str(tmp_path / "again"), catalog=catalog)


@pytest.mark.slow
def test_the_token_is_nowhere_in_prefect_or_the_logs(prefect_flows, hub, family, tmp_path, request):
    """A merge of a private model run as a Prefect flow run: the token is in none of what the
    server keeps of it (the flow run and its parameters, task runs, artifacts, the logs it has
    received), nor in any log record the process emitted, at DEBUG."""
    import logging
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.client.schemas.sorting import LogSort

    runs_logger = logging.getLogger("prefect.flow_runs")
    request.addfinalizer(lambda level=runs_logger.level: runs_logger.setLevel(level))
    runs_logger.setLevel(logging.INFO)
    hub.publish("org/private-e1", family.experts[1], private=True)
    cfg = _config(tmp_path, "hf://org/base", ["hf://org/e0", "hf://org/private-e1"], "p.yaml")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    # Prefect's loggers do not propagate to the root: listen on each family of loggers at DEBUG.
    names = ["", "mergepipe", "prefect", "prefect.flow_runs", "prefect.task_runs", "fsspec", "huggingface_hub", "httpx"]
    keep, levels = Keep(logging.DEBUG), {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).addHandler(keep)
        logging.getLogger(n).setLevel(logging.DEBUG)
    os.environ["HF_TOKEN"] = TOKEN
    try:
        got = merge(config=str(cfg), out=str(tmp_path / "out"), catalog=str(tmp_path / "c.duckdb"))
    finally:
        os.environ.pop("HF_TOKEN", None)
        for n in names:
            logging.getLogger(n).removeHandler(keep)
            logging.getLogger(n).setLevel(levels[n])
    messages = [r.getMessage() for r in records]
    assert len(messages) > 10 and not [m for m in messages if TOKEN in m]
    run_id = UUID(got["flow_run_id"])
    with get_client(sync_client=True) as client:
        kept = [client.read_flow_run(run_id).model_dump_json()]
        kept += [
            t.model_dump_json()
            for t in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
        ]
        only_this_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))

        # Logs reach the API in batches: wait for the run's last one (the engine's "Finished in
        # state …"), so every log the run sent is there to search.
        def finished() -> bool:
            last = client.read_logs(log_filter=only_this_run, sort=LogSort.TIMESTAMP_DESC, limit=20)
            return any(log.message.startswith("Finished in state") for log in last)

        wait_until(finished, EVENT_S, "the run's last log line to reach the API")
        logs = client.read_logs(log_filter=only_this_run)
        kept += [log.model_dump_json() for log in logs]
        kept += [
            a.model_dump_json()
            for a in client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
            )
        ]
    assert len(kept) > 3
    assert not [k for k in kept if TOKEN in k]


def test_a_cache_fetches_only_the_ranges_it_has_not_read(hub, family, local_reference, tmp_path):
    """--cache: a 25% merge after a 10% one downloads only the blocks the 10% one did not read
    (counted by the server; the ledger's cache role shows the rest), and a 10% merge again
    downloads nothing. The digests do not change."""
    catalog = str(tmp_path / "catalog.duckdb")
    cfg = _hub_config(tmp_path)
    index_family(config=str(cfg), catalog=catalog)
    experts = r"^/org/e\d/resolve/.*\.safetensors$"
    sent, runs = {}, {}
    os.environ["MERGEPIPE_CACHE"] = str(tmp_path / "cache")
    try:
        for name, budget in (("a", "10%"), ("b", "25%"), ("c", "10%")):
            hub.reset_log()
            runs[name] = merge(config=str(cfg), out=str(tmp_path / name), budget=budget, catalog=catalog)
            sent[name] = hub.wire_bytes(experts)
    finally:
        os.environ.pop("MERGEPIPE_CACHE", None)
    assert runs["a"]["digest"] == runs["c"]["digest"] == local_reference["10%"]["digest"]
    ledger = json.loads((tmp_path / "b" / MANIFEST_FILE).read_text())["run"]["ledger"]
    cached = sum(r["bytes"] for r in ledger if r["role"] == "cache" and r["model"].startswith("expert"))
    assert 0 < cached < runs["b"]["expert_bytes_read"]
    assert sent["b"] == runs["b"]["expert_bytes_read"] - cached  # headers came from the cache too
    assert sent["c"] == 0
    # The command line's --cache is the same folder setting.
    try:
        r = CliRunner().invoke(
            app,
            [
                "merge",
                str(cfg),
                "--out",
                str(tmp_path / "d"),
                "--budget",
                "10%",
                "--catalog",
                catalog,
                "--cache",
                str(tmp_path / "cli-cache"),
            ],
        )
    finally:
        os.environ.pop("MERGEPIPE_CACHE", None)
    assert r.exit_code == 0, r.output
    assert list((tmp_path / "cli-cache").rglob("*.ranges"))


def _mirror_requests(hub, family, n: int, length: int):
    """n requests of `length` bytes each, 4 KiB apart, from an expert's first shard served as an
    https:// folder, with the bytes they should give."""
    shard = sorted(family.experts[0].glob("*.safetensors"))[0]
    url = f"{hub.endpoint}/mirror/org/e0/{shard.name}"
    data = shard.read_bytes()
    requests = [ReadRequest(url, [(i * 4096, i * 4096 + length)], "expert", "expert-0", shard.name) for i in range(n)]
    return requests, [data[i * 4096 : i * 4096 + length] for i in range(n)], rf"^/mirror/org/e0/{shard.name}$"


def test_ranges_read_ahead_are_fetched_once(hub, family):
    """Ranges read ahead and then read: the same bytes, each range sent once by the server, and
    the ledger counting them in their role; a range read before it was read ahead is not
    fetched again."""
    requests, expected, path = _mirror_requests(hub, family, 6, 3000)
    hub.reset_log()
    ledger = ByteLedger()
    with RangeReader(ledger, read_ahead=3 * 3000) as reader:
        reader.read_ahead(requests[1:])
        got = [reader.read_batch([r])[0][0] for r in requests]
        reader.read_ahead(requests[:1])  # read already: not fetched again
    assert [bytes(g) for g in got] == expected
    assert hub.wire_bytes(path) == 6 * 3000
    assert ledger.by_role()["expert"] == 6 * 3000 and ledger.by_role()["reread"] == 0


def test_reading_ahead_holds_at_most_its_bound(hub, family):
    """Nothing read: the reader fetches ahead what fits its bound and no more, and counts what
    it fetched and never used (as `reread`) when it closes, as the server counted it."""
    requests, _, path = _mirror_requests(hub, family, 6, 3000)
    hub.reset_log()
    ledger = ByteLedger()
    with RangeReader(ledger, read_ahead=3 * 3000 + 2999) as reader:
        reader.read_ahead(requests)
    assert hub.wire_bytes(path) == 3 * 3000
    assert ledger.by_role()["reread"] == 3 * 3000 and ledger.by_role()["expert"] == 0


@pytest.mark.parametrize("method", ["task_arithmetic", "ties"])
def test_tensors_merged_in_parts_read_ahead_exactly_their_reads(hub, family, tmp_path, monkeypatch, method):
    """Under a small memory budget tensors are merged in runs (task arithmetic) or in passes over
    windows of rows (TIES), their remote ranges read ahead: the digest of the whole-tensor merge,
    and the server sends exactly what the ledger counts (headers aside)."""
    catalog = str(tmp_path / "catalog.duckdb")
    extra = {"parameters": {"density": 0.5}} if method == "ties" else {}
    cfg = _hub_config(tmp_path, merge_method=method, **extra)
    whole = merge(config=str(cfg), out=str(tmp_path / "whole"), budget="30%", catalog=catalog)
    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    monkeypatch.setattr(memory, "MIN_SLAB_ELEMENTS", 64)
    monkeypatch.setattr(slabs, "SLAB_ELEMENTS", 256)
    needs = memory.tensor_needs(*saved_plan(whole, catalog))
    share = max(3 * max(n.least for n in needs), max(n.whole for n in needs) // 2)
    forms = []
    real_streamed, real_windowed = streamed.merge_streamed, windowed.merge_windowed

    def spied(form, real):
        def spy(g, reads):
            forms.append(form)
            return real(g, reads)

        return spy

    monkeypatch.setattr(streamed, "merge_streamed", spied("streamed", real_streamed))
    monkeypatch.setattr(windowed, "merge_windowed", spied("windowed", real_windowed))
    fetched_ahead = []
    real_fetch = RangeReader._fetch_requests

    def fetch(reader, requests):
        if threading.current_thread().name.startswith("read-ahead"):
            fetched_ahead.extend(requests)
        return real_fetch(reader, requests)

    monkeypatch.setattr(RangeReader, "_fetch_requests", fetch)
    hub.reset_log()
    parts = merge(config=str(cfg), out=str(tmp_path / "parts"), budget="30%", catalog=catalog, memory=str(2 * share))
    assert parts["digest"] == whole["digest"]
    assert forms and set(forms) == {"streamed" if method == "task_arithmetic" else "windowed"}
    assert parts["memory"]["read_ahead_bytes"] > 0
    # Runs and windows were fetched ahead, and with TIES windows read again in a later pass too.
    assert {r.role for r in fetched_ahead} == {"base", "expert"}
    again = len(fetched_ahead) - len({r.key for r in fetched_ahead})
    assert again > 0 if method == "ties" else again == 0
    files = [p for m in (family.base, *family.experts) for p in sorted(m.glob("*.safetensors"))]
    headers = sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for p in files)
    read = parts["bytes"]
    assert (
        hub.wire_bytes(r"^/org/.*/resolve/.*\.safetensors$") == headers + read["base"] + read["expert"] + read["reread"]
    )
    assert parts["expert_bytes_read"] == whole["expert_bytes_read"]


def test_a_sweep_merges_every_budget_from_the_commit_it_pinned_first(hub, family, tmp_path, monkeypatch):
    """The branch moves after the first budget's merge: every budget still reads, and records,
    the commit the sweep pinned first."""
    from mergepipe.flows import sweep

    first = hub.publish("org/sweeping", family.experts[0])
    cfg = _config(tmp_path, "hf://org/base", ["hf://org/sweeping", "hf://org/e1"], "sweep.yaml")
    real, merged = sweep._merge_at, []

    def merge_then_move(*args, **kwargs):
        merged.append(real(*args, **kwargs))
        if len(merged) == 1:
            hub.publish("org/sweeping", family.experts[2])  # a new commit on main
        return merged[-1]

    monkeypatch.setattr(sweep, "_merge_at", merge_then_move)
    rows = sweep.budget_sweep(
        config=str(cfg), out=str(tmp_path / "sweep"), budgets=["10%", "25%", "100%"], catalog=str(tmp_path / "c.duckdb")
    )
    assert len(rows) == 3 and hub.repos["org/sweeping"].refs["main"] != first
    for row in rows:
        commits = json.loads((Path(row["out"]) / MANIFEST_FILE).read_text())["run"]["commits"]
        assert [c for c in commits if "/org/sweeping/" in c] == [f"{hub.endpoint}/org/sweeping/resolve/{first}"], row


# ---------------------------------------------------------------- the Hub as it serves large files


@pytest.fixture
def redirecting(hub, monkeypatch):
    """The server answering large files' resolves with 302 to signed URLs on a storage host of
    its own origin, as the Hub does, and a process that has resolved nothing yet."""
    monkeypatch.setattr(remote, "LOCATIONS", remote.Locations())
    hub.redirect = True
    hub.reset_log()
    try:
        yield hub
    finally:
        hub.redirect, hub.url_ttl, hub.resolve_limit, hub.resolve_window = False, 3600.0, None, 300.0
        hub.rate = None
        hub.reset_log()


def _shards(*models: Path) -> list[Path]:
    return [p for m in models for p in sorted(m.glob("*.safetensors"))]


def _no_token_off_the_hub(hub: HubServer) -> None:
    storage = hub.storage_requests()
    assert storage and all("authorization" not in {k.lower() for k in s.headers} for s in storage)
    assert not [s for s in storage if s.status == 400]  # no signed request came with a header of ours


def test_each_shard_is_resolved_once_and_read_from_its_signed_url(redirecting, family, local_reference, tmp_path):
    hub = redirecting
    catalog = str(tmp_path / "catalog.duckdb")
    cfg = _hub_config(tmp_path)
    index_family(config=str(cfg), catalog=catalog)
    shards = _shards(family.base, *family.experts)
    headers = sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for p in _shards(*family.experts))
    for budget in ("10%", "100%"):
        remote.LOCATIONS = remote.Locations()  # as a fresh worker would
        hub.reset_log()
        given = None if budget == "100%" else budget  # as the reference was merged
        r = merge(config=str(cfg), out=str(tmp_path / budget), budget=given, catalog=catalog)
        assert r["digest"] == local_reference[budget]["digest"]
        files = {s.file or s.path for s in hub.log if s.method == "GET" and s.status in (200, 206)}
        heads = [s for s in hub.log if s.method == "HEAD" and "/resolve/" in s.path]
        assert len(heads) == len(shards) == r["requests"]["resolves"]  # one per shard, as the run says
        assert hub.resolves() <= 2 * len(files) + 4, (hub.resolves(), sorted(files))
        assert r["requests"]["reads"] > 2 * hub.resolves()  # one resolve per read would be many more
        # The storage host sent the plan's bytes of the experts, and the headers; nothing else.
        sent = hub.wire_bytes(r"^/org/e\d/resolve/.*\.safetensors$")
        assert sent - headers == r["expert_bytes_read"] == r["expert_bytes_planned"]
        assert not [s for s in hub.log if s.host == "hub" and s.path.endswith(".safetensors") and s.method == "GET"]
        _no_token_off_the_hub(hub)


@pytest.mark.parametrize("stated", [True, False], ids=["expiry-stated", "expiry-unknown"])
def test_urls_that_expire_mid_merge_are_resolved_again(
    redirecting, family, local_reference, tmp_path, monkeypatch, stated
):
    """Resolved again before the URL says it expires or, where mergepipe cannot tell (another
    URL shape, a skewed clock), when the storage host refuses it."""
    hub = redirecting
    if not stated:
        monkeypatch.setattr(hub_module, "expiry", lambda url: None)
    hub.url_ttl = 1.0
    hub.rate = 1e6  # a slow link: the merge takes several URL lifetimes
    r = merge(config=str(_hub_config(tmp_path)), out=str(tmp_path / "out"), catalog=str(tmp_path / "c.duckdb"))
    assert r["digest"] == local_reference["100%"]["digest"]
    assert r["wall_seconds"] > 3
    shards = len(_shards(family.base, *family.experts))
    heads = len([s for s in hub.log if s.method == "HEAD" and "/resolve/" in s.path])
    # Each refresh was a resolve of its own, and the run's record counts every one.
    assert heads > shards and r["requests"]["resolves"] == heads
    if not stated:  # every refresh followed a refusal
        assert len([s for s in hub.storage_requests() if s.status == 403]) >= heads - shards
    _no_token_off_the_hub(hub)


@pytest.mark.slow  # it waits out rate-limit windows
def test_a_storage_host_that_refuses_fresh_urls_fails_the_merge_naming_the_file(
    redirecting, family, tmp_path, monkeypatch
):
    hub = redirecting
    issue = hub.storage.url
    # Every URL the Hub issues is one its storage host refuses.
    monkeypatch.setattr(hub.storage, "url", lambda *a: re.sub(r"Signature=\w+", "Signature=0", issue(*a)))
    r = CliRunner().invoke(app, ["merge", str(_hub_config(tmp_path)), "--out", str(tmp_path / "out")])
    assert r.exit_code == 1, r.output
    assert "refused a freshly resolved URL (403" in r.output and ".safetensors" in r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the merge tasks retry before it fails
def test_a_rate_limit_is_not_met_and_when_met_waited_out(redirecting, family, local_reference, tmp_path, caplog):
    hub = redirecting
    cfg = _hub_config(tmp_path)
    hub.resolve_limit = 20  # a client resolving for every read would meet it again and again
    r = merge(config=str(cfg), out=str(tmp_path / "under"), catalog=str(tmp_path / "c1.duckdb"))
    assert r["digest"] == local_reference["100%"]["digest"]
    assert hub.rate_limited == 0 and r["requests"]["rate_limited"] == 0
    assert r["requests"]["reads"] >= 3 * hub.resolve_limit
    # A limit low enough to meet anyway: the merge waits as the server says, and goes on.
    remote.LOCATIONS = remote.Locations()
    hub.reset_log()
    hub.resolve_limit, hub.resolve_window = 3, 2.0
    with caplog.at_level("WARNING", logger="mergepipe.storage"):
        r = merge(config=str(cfg), out=str(tmp_path / "limited"), catalog=str(tmp_path / "c2.duckdb"))
    assert r["digest"] == local_reference["100%"]["digest"]
    assert hub.rate_limited > 0 and r["requests"]["rate_limited"] > 0
    assert r["requests"]["rate_limit_wait_seconds"] > 0
    assert re.search(r"rate-limited by the Hub: resuming in \d+ s", caplog.text)
    run = json.loads((tmp_path / "limited" / MANIFEST_FILE).read_text())["run"]
    assert run["requests"] == r["requests"]


@pytest.mark.parametrize("redirect", [True, False], ids=["redirected", "served-by-the-hub"])
def test_a_private_base_with_folders_elsewhere_sends_the_token_to_the_hub_only(
    redirecting, family, local_reference, tmp_path, monkeypatch, redirect
):
    """Reads of the base (from its signed URLs, or from the Hub itself where it serves the files)
    and of the experts' folders go out in the same batches: each host gets its own headers."""
    hub = redirecting
    hub.redirect = redirect
    hub.publish("org/private-base", family.base, private=True)
    folders = HubServer()  # another host: a mirror of the experts, as https:// folders
    try:
        for i, e in enumerate(family.experts):
            folders.publish(f"org/e{i}", e)
        experts = [f"{folders.endpoint}/mirror/org/e{i}" for i in range(3)]
        cfg = _config(tmp_path, "hf://org/private-base", experts, "mixed.yaml")
        refused = CliRunner().invoke(app, ["merge", str(cfg), "--out", str(tmp_path / "refused")])
        assert refused.exit_code == 2, refused.output
        assert "hf://org/private-base" in refused.output and "a token is needed" in refused.output
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        catalog = str(tmp_path / "catalog.duckdb")
        for budget, given in (("100%", None), ("25%", "25%")):
            folders.reset_log()
            r = merge(config=str(cfg), out=str(tmp_path / budget), budget=given, catalog=catalog)
            assert r["digest"] == local_reference[budget]["digest"]
            got = [s for s in folders.log if s.method == "GET" and s.range]
            assert got and all("authorization" not in {k.lower() for k in s.headers} for s in folders.log)
        if redirect:
            _no_token_off_the_hub(hub)
        else:  # every read of the private base went to the Hub, with the token
            base_reads = [s for s in hub.log if "/org/private-base/resolve/" in s.path and s.method == "GET"]
            assert base_reads and all(s.status in (200, 206) for s in base_reads)
    finally:
        folders.close()


def test_signed_urls_say_when_they_expire_and_429s_how_long_to_wait():
    assert hub_module.expiry("https://cdn.example/x?Expires=1700000000&Signature=s&Key-Pair-Id=k") == 1700000000
    s3v4 = "https://b.s3.amazonaws.com/k?X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&X-Amz-Signature=s"
    assert hub_module.expiry(s3v4) == 1767225600 + 3600
    assert hub_module.expiry("https://mirror.example/x") is None
    assert hub_module.expiry("https://cdn.example/x?Expires=soon") is None
    # The RateLimit header's reset where nothing remains, else Retry-After.
    limited = {"RateLimit": '"resolvers";r=0;t=55', "RateLimit-Policy": '"fixed window";"resolvers";q=5000;w=300'}
    assert hub_module.rate_limit_wait(limited | {"Retry-After": "7"}) == 55
    assert hub_module.rate_limit_wait({"RateLimit": '"api";r=3;t=55', "retry-after": "7"}) == 7
    assert hub_module.rate_limit_wait({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}) is None
    assert hub_module.rate_limit_wait({}) is None


def test_a_lora_adapter_on_the_hub_reads_its_factors_from_its_commit(hub, family, tmp_path):
    """MODEL+ADAPTER with both on the Hub: the local merge's digest, the adapter's commit
    recorded, and at 100% the expert bytes read from it are its tensors."""
    from mergepipe.devtools.synthetic import write_adapter

    from .reference import load_model

    adapter = write_adapter(tmp_path / "adapter", load_model(family.base), 5, rank=4)
    hub.publish("org/adapter", adapter)
    local = _config(tmp_path, str(family.base), [str(family.experts[0]), f"{family.base}+{adapter}"], "l.yaml")
    remote_cfg = _config(tmp_path, "hf://org/base", ["hf://org/e0", "hf://org/base+hf://org/adapter"], "r.yaml")
    want = merge(config=str(local), out=str(tmp_path / "local"), catalog=str(tmp_path / "a.duckdb"))
    got = merge(config=str(remote_cfg), out=str(tmp_path / "hub"), catalog=str(tmp_path / "b.duckdb"))
    assert got["digest"] == want["digest"]
    run = json.loads((tmp_path / "hub" / MANIFEST_FILE).read_text())["run"]
    assert any(c.endswith(hub.repos["org/adapter"].refs["main"]) for c in run["commits"])
    raw = (adapter / "adapter_model.safetensors").read_bytes()
    read = sum(r["bytes"] for r in run["ledger"] if r["role"] == "expert" and r["model"] == "expert-1")
    assert read == len(raw) - 8 - int.from_bytes(raw[:8], "little")


def test_vocabularies_from_the_hub_give_the_local_digest(hub, tmp_path):
    """Models whose vocabularies differ, on the Hub: their tokenizers read from their commits,
    the local merge's digest and tokenizer."""
    pytest.importorskip("transformers")
    from .test_vocabulary_merge import E2E, _config, meaning

    local = _config("tokens", tmp_path / "local.yml")
    text = local.read_text()
    for name in ("base", "chat", "other"):
        hub.publish(f"org/vocab-{name}", E2E / name)
        text = text.replace(str(E2E / name), f"hf://org/vocab-{name}")
    remote_cfg = tmp_path / "hub.yml"
    remote_cfg.write_text(text)
    want = merge(config=str(local), out=str(tmp_path / "local"), catalog=str(tmp_path / "a.duckdb"))
    got = merge(config=str(remote_cfg), out=str(tmp_path / "hub"), catalog=str(tmp_path / "b.duckdb"))
    assert got["digest"] == want["digest"]
    assert meaning(tmp_path / "hub") == meaning(tmp_path / "local")
