"""Checkpoints and outputs on S3, against a real S3 server (moto's server mode) on loopback,
with a proxy in front that counts what crosses the wire and injects failures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from mergepipe.cli import app
from mergepipe.devtools.synthetic import FamilyPaths, make_family
from mergepipe.errors import BadInput, MergepipeError
from mergepipe.flows.index_family import index_family
from mergepipe.flows.merge import merge
from mergepipe.publish.manifest import verify_output
from mergepipe.storage import plans, remote
from mergepipe.storage.model_files import MANIFEST_FILE

from .helpers import config_for

pytestmark = pytest.mark.slow

BUCKET = "ckpt"
MERGEPIPE = str(Path(sys.executable).parent / "mergepipe")


def upload_folder(server, folder: Path, prefix: str) -> str:
    client = server.client()
    for p in sorted(folder.iterdir()):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{p.name}", Body=p.read_bytes())
    return f"s3://{BUCKET}/{prefix}"


def keys_under(server, prefix: str) -> list[str]:
    out = server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1 :] for o in out.get("Contents", []))


def read_object(server, key: str) -> bytes:
    return server.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()


@pytest.fixture(scope="module")
def families(s3, tmp_path_factory):
    """The same family on local disk and on S3 (objects of a few hundred KiB)."""
    root = tmp_path_factory.mktemp("s3fam")
    local = make_family(
        root,
        experts=("dense", "dense", "lora"),
        n_layers=2,
        hidden=128,
        intermediate=256,
        vocab=512,
        dtype="bfloat16",
        shards=2,
        seed=7,
    )
    base = upload_folder(s3, local.base, "fam/base")
    experts = [upload_folder(s3, e, f"fam/{e.name}") for e in local.experts]
    return local, FamilyPaths(base, experts)


@pytest.fixture(scope="module")
def catalog(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("s3cat") / "catalog.duckdb")


@pytest.fixture(scope="module")
def local_reference(families, catalog, tmp_path_factory):
    """The merge from local disk that every S3 variant must reproduce, at 25% and at 100%."""
    local, _ = families
    tmp = tmp_path_factory.mktemp("s3ref")
    out = {}
    for budget in ("25%", "100%"):
        cfg = config_for(tmp, local, "task_arithmetic", name=f"local-{budget[:-1]}.yaml", budget=budget)
        out[budget] = merge(config=str(cfg), out=str(tmp / f"out-{budget[:-1]}"), catalog=catalog)
    return out


@pytest.mark.parametrize("budget", ["25%", "100%"])
def test_s3_to_s3_and_s3_to_local_give_the_local_digest(s3, families, catalog, local_reference, tmp_path, budget):
    _, remote_fam = families
    cfg = config_for(tmp_path, remote_fam, "task_arithmetic", budget=budget)
    tag = budget[:-1]
    to_s3 = merge(config=str(cfg), out=f"s3://{BUCKET}/out/s3-{tag}", catalog=catalog)
    to_local = merge(config=str(cfg), out=str(tmp_path / "local-out"), catalog=catalog)
    want = local_reference[budget]
    assert to_s3["digest"] == to_local["digest"] == want["digest"]
    assert to_s3["expert_bytes_read"] == want["expert_bytes_read"] == want["expert_bytes_planned"]
    # The ledger counts S3 bytes as it counts local ones.
    for role in ("base", "expert", "output", "checksum", "sidecar"):
        assert to_s3["bytes"][role] == to_local["bytes"][role] == want["bytes"][role], role
    shard_bytes = sum(p.stat().st_size for p in Path(want["out"]).glob("*.safetensors"))
    assert to_s3["bytes"]["upload"] > shard_bytes
    assert to_local["bytes"]["upload"] == to_local["bytes"]["compose"] == 0
    # Shards are joined from their staged pieces mostly by server-side copies: only parts under
    # the minimum part size are read back and sent.
    assert 0 < to_s3["bytes"]["compose"] < shard_bytes / 2
    assert not keys_under(s3, "out/.s3-" + tag + ".mergepipe-staging-" + to_s3["plan_digest"][:16])
    # The uploaded shards are byte for byte the local output's.
    local_out = Path(want["out"])
    for shard in sorted(local_out.glob("*.safetensors")):
        assert read_object(s3, f"out/s3-{tag}/{shard.name}") == shard.read_bytes(), shard.name
    result = verify_output(f"s3://{BUCKET}/out/s3-{tag}")
    assert result.ok, result.problems
    assert set(keys_under(s3, f"out/s3-{tag}")) == {p.name for p in local_out.iterdir()}


def test_a_first_merge_from_s3_indexes_on_the_way_with_the_local_digest(s3, families, local_reference, tmp_path):
    """On a catalog that has never seen the S3 family, a 100% merge indexes it from the bytes it
    downloads: every expert byte fetched once, the digest of the local two-pass route."""
    _, remote_fam = families
    cfg = config_for(tmp_path, remote_fam, "task_arithmetic", budget="100%")
    got = merge(config=str(cfg), out=str(tmp_path / "out"), catalog=str(tmp_path / "fresh.duckdb"))
    want = local_reference["100%"]
    assert "indexed_in_merge" in got and got["index_bytes"]["expert"] == 0
    assert got["digest"] == want["digest"] and got["expert_bytes_read"] == want["expert_bytes_planned"]
    assert got["bytes"]["expert"] + got["bytes"]["index"] == got["full_expert_bytes"]


def test_server_side_bytes_match_the_ledger_at_ten_percent(s3, families, catalog, tmp_path):
    local, remote_fam = families
    cfg = config_for(tmp_path, remote_fam, "task_arithmetic", budget="10%")
    index_family(config=str(cfg), catalog=catalog)  # statistics first: the merge then reads only its plan
    s3.proxy.reset()
    result = merge(config=str(cfg), out=str(tmp_path / "out"), catalog=catalog)
    manifest = json.loads((tmp_path / "out" / MANIFEST_FILE).read_text())

    # Header reads are the ranges starting at byte 0 or 8 (tensor data starts after the header).
    header, data, requests, wire = 0, defaultdict(int), defaultdict(int), defaultdict(int)
    for x in s3.proxy.taken():
        if x.method != "GET" or x.range is None:
            continue  # listings and HEADs carry no object bytes
        assert x.status == 206, x
        if x.range.startswith(("bytes=0-", "bytes=8-")):
            header += x.body_bytes
        else:
            data[x.key] += x.body_bytes
            requests[x.key] += 1
            wire[x.key] += x.wire_bytes
    roots = {"base": "fam/base", **{f"expert-{i}": f"fam/{e.name}" for i, e in enumerate(local.experts)}}
    ledger, ledger_requests = defaultdict(int), defaultdict(int)
    for row in manifest["run"]["ledger"]:
        if row["role"] in ("base", "expert") and row["bytes"]:
            key = f"{BUCKET}/{roots[row['model']]}/{row['file']}"
            ledger[key] += row["bytes"]
            ledger_requests[key] += row["requests"]
    assert dict(data) == dict(ledger)
    assert dict(requests) == dict(ledger_requests)
    assert header == result["index_bytes"]["header"]
    expert_keys = [k for k in ledger if "/expert-" in k]
    assert sum(data[k] for k in expert_keys) == result["expert_bytes_read"] == result["expert_bytes_planned"]
    assert result["expert_bytes_planned"] <= result["budget_bytes"]
    expert_wire = sum(wire[k] for k in expert_keys)
    n_req = sum(requests[k] for k in expert_keys)
    assert expert_wire <= result["budget_bytes"] + n_req * 1024  # the budget plus HTTP overhead
    assert expert_wire < 0.2 * result["full_expert_bytes"]


def test_merge_survives_ten_percent_failed_requests(s3, families, catalog, local_reference, tmp_path):
    _, remote_fam = families
    cfg = config_for(tmp_path, remote_fam, "task_arithmetic", budget="25%")
    s3.proxy.reset(fault_rate=0.10, seed=3)
    try:
        result = merge(config=str(cfg), out=f"s3://{BUCKET}/out/faulty", catalog=catalog)
    finally:
        taken = s3.proxy.taken()
        s3.proxy.reset()
    faults = defaultdict(int)
    for x in taken:
        if x.fault:
            faults[x.fault] += 1
    assert faults["503"] and faults["drop"] and faults["truncate"], dict(faults)
    assert result["digest"] == local_reference["25%"]["digest"]
    assert result["expert_bytes_read"] == result["expert_bytes_planned"]
    assert verify_output(f"s3://{BUCKET}/out/faulty").ok


def test_missing_object_fails_clearly_and_publishes_nothing(s3, families, catalog, tmp_path):
    local, _ = families
    expert = local.experts[1]
    prefix = "fam-missing/expert"
    uri = upload_folder(s3, expert, prefix)
    shard = sorted(p.name for p in expert.glob("*.safetensors"))[0]
    s3.client().delete_object(Bucket=BUCKET, Key=f"{prefix}/{shard}")
    cfg = config_for(tmp_path, FamilyPaths(f"s3://{BUCKET}/fam/base", [uri]), "task_arithmetic", weights=[0.5])
    with pytest.raises(BadInput, match=shard):
        merge(config=str(cfg), out=f"s3://{BUCKET}/out/missing", catalog=catalog)
    assert keys_under(s3, "out/missing") == []
    cfg = config_for(
        tmp_path,
        FamilyPaths(f"s3://{BUCKET}/fam/base", [f"s3://{BUCKET}/no-such-expert"]),
        "task_arithmetic",
        weights=[0.5],
        name="gone.yaml",
    )
    with pytest.raises(BadInput, match="no-such-expert: model not found"):
        merge(config=str(cfg), out=f"s3://{BUCKET}/out/missing", catalog=catalog)
    assert keys_under(s3, "out/missing") == []


def test_overwritten_object_is_noticed_by_its_etag(s3, families, catalog, tmp_path):
    local, _ = families
    prefix = "fam-etag/expert"
    uri = upload_folder(s3, local.experts[0], prefix)
    cfg = config_for(tmp_path, FamilyPaths(f"s3://{BUCKET}/fam/base", [uri]), "task_arithmetic", weights=[0.5])
    assert index_family(config=str(cfg), catalog=catalog)["indexed_now"] == [uri]
    assert index_family(config=str(cfg), catalog=catalog)["indexed_now"] == []
    # Same key, same size, other bytes (another expert's shard): a new ETag, so a new pass.
    other = upload_folder(s3, local.experts[1], "fam-etag/other")
    for name in keys_under(s3, "fam-etag/other"):
        s3.client().copy_object(
            Bucket=BUCKET, Key=f"{prefix}/{name}", CopySource={"Bucket": BUCKET, "Key": f"fam-etag/other/{name}"}
        )
    again = index_family(config=str(cfg), catalog=catalog)
    assert again["indexed_now"] == [uri]
    assert (
        again["content_sha256"]["expert-0"]
        == index_family(
            config=str(
                config_for(
                    tmp_path,
                    FamilyPaths(f"s3://{BUCKET}/fam/base", [other]),
                    "task_arithmetic",
                    weights=[0.5],
                    name="other.yaml",
                )
            ),
            catalog=catalog,
        )["content_sha256"]["expert-0"]
    )


def test_object_replaced_during_the_merge_is_not_published(s3, families, catalog, tmp_path, monkeypatch):
    local, _ = families
    prefix = "fam-swap/expert"
    uri = upload_folder(s3, local.experts[0], prefix)
    cfg = config_for(
        tmp_path, FamilyPaths(f"s3://{BUCKET}/fam/base", [uri]), "task_arithmetic", weights=[0.5], budget="100%"
    )
    index_family(config=str(cfg), catalog=catalog)
    replacement = local.experts[1]
    swapped = []

    def swap_on_first_data_read(method, key):
        if method == "GET" and key.startswith(f"{BUCKET}/{prefix}/") and not swapped:
            swapped.append(key)
            name = key.rsplit("/", 1)[1]
            s3.client().put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=(replacement / name).read_bytes())

    s3.proxy.reset()
    # Armed when the first group starts, after headers were read and the plan was made.
    from mergepipe.execute import group as execution

    run = execution.GroupMerger.run

    def armed(self, group):
        s3.proxy.hook = swap_on_first_data_read
        return run(self, group)

    monkeypatch.setattr(execution.GroupMerger, "run", armed)
    try:
        with pytest.raises(BadInput, match="changed during the merge"):
            merge(config=str(cfg), out=f"s3://{BUCKET}/out/swapped", catalog=catalog)
    finally:
        s3.proxy.reset()
    assert swapped
    assert keys_under(s3, "out/swapped") == []


def test_multipart_upload_and_exact_ranges(s3, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "PART_SIZE", 5 * 1024 * 1024)
    data = os.urandom(11 * 1024 * 1024 + 123)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    s3.proxy.reset()
    with remote.open_writer(f"s3://{BUCKET}/big/big.bin") as f:
        f.write(src.read_bytes())
    parts = [x for x in s3.proxy.taken() if x.method == "PUT"]
    assert len(parts) == 3  # 5 + 5 + 1 MiB
    fp = remote.stat(f"s3://{BUCKET}/big/big.bin")
    assert fp.size == len(data) and fp.etag.endswith("-3")
    s3.proxy.reset()
    got = remote.read_ranges(f"s3://{BUCKET}/big/big.bin", [(0, 8), (5_000_000, 5_004_096), (len(data) - 5, len(data))])
    assert got == [data[:8], data[5_000_000:5_004_096], data[-5:]]
    assert sorted(x.range for x in s3.proxy.taken()) == sorted(
        ["bytes=0-7", "bytes=5000000-5004095", f"bytes={len(data) - 5}-{len(data) - 1}"]
    )


def test_ranges_are_fetched_concurrently_with_a_bound(s3, monkeypatch):
    data = os.urandom(200 * 1024)
    s3.client().put_object(Bucket=BUCKET, Key="conc/x.bin", Body=data)
    monkeypatch.setattr(remote, "CONCURRENCY", 4)
    s3.proxy.reset()
    ranges = [(i * 4096, i * 4096 + 1000) for i in range(40)]
    assert remote.read_ranges(f"s3://{BUCKET}/conc/x.bin", ranges) == [data[s:e] for s, e in ranges]
    assert 1 < s3.proxy.peak_in_flight <= 4


def test_fingerprint_carries_the_version_id_of_a_versioned_bucket(s3):
    client = s3.client()
    client.create_bucket(Bucket="ckpt-versioned")
    client.put_bucket_versioning(Bucket="ckpt-versioned", VersioningConfiguration={"Status": "Enabled"})
    first = client.put_object(Bucket="ckpt-versioned", Key="m/x.bin", Body=b"one")["VersionId"]
    assert remote.stat("s3://ckpt-versioned/m/x.bin").version_id == first
    second = client.put_object(Bucket="ckpt-versioned", Key="m/x.bin", Body=b"two")["VersionId"]
    fp = remote.stat("s3://ckpt-versioned/m/x.bin")
    assert fp.version_id == second != first and fp.size == 3


def test_replay_from_s3_to_s3(s3, families, catalog, local_reference, tmp_path):
    from mergepipe.flows.replay import replay

    _, remote_fam = families
    cfg = config_for(tmp_path, remote_fam, "task_arithmetic", budget="25%")
    merge(config=str(cfg), out=f"s3://{BUCKET}/out/to-replay", catalog=catalog)
    again = replay(manifest=f"s3://{BUCKET}/out/to-replay", out=f"s3://{BUCKET}/out/replayed", catalog=catalog)
    assert again["digest"] == local_reference["25%"]["digest"]
    assert verify_output(f"s3://{BUCKET}/out/replayed").ok


def test_output_to_a_missing_bucket_is_refused_before_any_work(s3, families, catalog, tmp_path):
    _, remote_fam = families
    cfg = config_for(tmp_path, remote_fam, "task_arithmetic", budget="25%")
    with pytest.raises(BadInput, match="bucket 'no-such-bucket' not found"):
        merge(config=str(cfg), out="s3://no-such-bucket/out", catalog=catalog)


def test_output_over_foreign_objects_needs_overwrite(s3, families, catalog, tmp_path):
    _, remote_fam = families
    s3.client().put_object(Bucket=BUCKET, Key="out/foreign/notes.txt", Body=b"keep me")
    cfg = config_for(tmp_path, remote_fam, "task_arithmetic", budget="25%")
    with pytest.raises(BadInput, match="notes.txt"):
        merge(config=str(cfg), out=f"s3://{BUCKET}/out/foreign", catalog=catalog)
    assert keys_under(s3, "out/foreign") == ["notes.txt"]
    with pytest.raises(BadInput, match="lies inside the output folder"):
        merge(config=str(cfg), out=f"s3://{BUCKET}/fam", overwrite=True, catalog=catalog)


def test_short_bodies_are_never_accepted(s3, tmp_path, monkeypatch):
    s3.client().put_object(Bucket=BUCKET, Key="short/x.bin", Body=b"x" * 10_000)
    monkeypatch.setattr(remote, "BACKOFF_BASE_S", 0.001)
    monkeypatch.setattr(remote, "ATTEMPTS", 2)
    s3.proxy.reset(fault_rate=1.0, kinds=["truncate"])
    try:
        with pytest.raises(MergepipeError, match=r"short/x.bin: read of bytes 100-5100 failed after \d+ attempts"):
            remote.read_ranges(f"s3://{BUCKET}/short/x.bin", [(100, 5100)])
    finally:
        s3.proxy.reset()
    assert remote.read_ranges(f"s3://{BUCKET}/short/x.bin", [(100, 5100)]) == [b"x" * 5000]


def _cli_env(home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        MERGEPIPE_HOME=str(home / "mergepipe-home"),
        PREFECT_HOME=str(home / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300",
        **extra,
    )
    env.pop("PREFECT_API_URL", None)
    return env


def test_killed_upload_leaves_no_manifest_and_a_rerun_completes_it(s3, families, catalog, local_reference, tmp_path):
    _, remote_fam = families
    cfg = config_for(tmp_path, remote_fam, "task_arithmetic", budget="25%")
    env = _cli_env(
        tmp_path,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=s3.endpoint,
    )
    out_key = "out/killed"
    log = open(tmp_path / "merge.log", "w")
    # Its own process group: the kill takes the ephemeral Prefect server it starts, too.
    proc = subprocess.Popen(
        [MERGEPIPE, "merge", str(cfg), "--out", f"s3://{BUCKET}/{out_key}", "--catalog", str(tmp_path / "cat.duckdb")],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    killed = []

    def kill_at_second_shard(method, key):
        if method == "PUT" and key.startswith(f"{BUCKET}/{out_key}/model-00002-of-") and not killed:
            killed.append(key)
            os.killpg(proc.pid, signal.SIGKILL)

    s3.proxy.reset()
    s3.proxy.hook = kill_at_second_shard
    try:
        proc.wait(timeout=300)
    finally:
        s3.proxy.reset()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    assert killed and proc.returncode == -signal.SIGKILL, (tmp_path / "merge.log").read_text()[-3000:]
    left = keys_under(s3, out_key)
    assert any(k.startswith("model-00001-of-") for k in left) and MANIFEST_FILE not in left
    verify = CliRunner().invoke(app, ["verify", f"s3://{BUCKET}/{out_key}"])
    assert verify.exit_code == 2
    assert "not a published output" in verify.output
    # Running the same merge again completes the output, without --overwrite.
    result = merge(config=str(cfg), out=f"s3://{BUCKET}/{out_key}", catalog=catalog)
    assert result["digest"] == local_reference["25%"]["digest"]
    verify = CliRunner().invoke(app, ["verify", f"s3://{BUCKET}/{out_key}", "--json"])
    assert verify.exit_code == 0, verify.output
    assert json.loads(verify.output)["ok"]
    # A published output is not replaced without --overwrite.
    with pytest.raises(BadInput, match="already exists"):
        merge(config=str(cfg), out=f"s3://{BUCKET}/{out_key}", catalog=catalog)


def test_credentials_never_leak(s3, families, tmp_path):
    """Credentials given only in the config's storage_options: the merge works, and the secret
    is nowhere in the manifest, the catalog, the plans, Prefect's database or the logs."""
    _, remote_fam = families
    secret = "mergepipe-test-secret-7Qz1xV"
    key_id = "AKIAMERGEPIPETEST"
    cfg = config_for(
        tmp_path,
        remote_fam,
        "task_arithmetic",
        budget="25%",
        storage_options={
            "key": key_id,
            "secret": secret,
            "endpoint_url": s3.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
        },
    )
    # As Prefect flow runs (Prefect's temporary server, its database under tmp_path), so that
    # database and Prefect's logs are searched too; an in-process run has neither.
    env = _cli_env(
        tmp_path,
        PREFECT_LOGGING_LEVEL="DEBUG",
        PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL="DEBUG",
        MERGEPIPE_DEBUG="1",
        MERGEPIPE_ORCHESTRATION="prefect",
    )
    cat = tmp_path / "cat.duckdb"
    out = f"s3://{BUCKET}/out/secret"
    run = subprocess.run(
        [MERGEPIPE, "merge", str(cfg), "--out", out, "--catalog", str(cat), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # A failing run too (a published output is refused): errors must not show them either.
    again = subprocess.run(
        [MERGEPIPE, "merge", str(cfg), "--out", out, "--catalog", str(cat)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 2 and "already exists" in again.stderr
    logs = run.stdout + run.stderr + again.stdout + again.stderr
    assert "DEBUG" in logs  # the logs really were captured at debug level
    manifest = read_object(s3, f"out/secret/{MANIFEST_FILE}").decode()
    import duckdb

    con = duckdb.connect(str(cat), read_only=True)
    tables = [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()]
    catalog_text = "".join(str(con.execute(f'SELECT * FROM "{t}"').fetchall()) for t in tables)
    saved_plans = con.execute("SELECT record, access FROM saved_plans").fetchall()
    con.close()
    assert "s3://ckpt/fam/base" in catalog_text  # the scan covers real rows
    # The saved plans, compressed in the catalog, searched as their layer tasks read them.
    assert saved_plans
    for record, access in saved_plans:
        plan_record, access_table = plans.decode_plan(record, access)
        catalog_text += json.dumps(plan_record) + str(access_table.to_pylist())
    assert list(tmp_path.rglob("prefect.db"))
    stored = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p != cfg)
    for where, text in [("logs", logs), ("manifest", manifest), ("catalog", catalog_text)]:
        assert secret not in text, where
        assert key_id not in text, where
    assert secret.encode() not in stored  # Prefect's database, the catalog file


def test_missing_credentials_are_a_clear_error(s3, families, catalog, tmp_path, monkeypatch):
    _, remote_fam = families
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # Distinct storage options, so fsspec builds a new client instead of reusing a cached one.
    cfg = config_for(tmp_path, remote_fam, "task_arithmetic", storage_options={"endpoint_url": s3.endpoint})
    result = CliRunner().invoke(app, ["merge", str(cfg), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "s3://ckpt/fam/base" in result.output and "no usable credentials" in result.output
    assert not (tmp_path / "out").exists()


def test_transient_and_permanent_failures_are_told_apart():
    import errno

    from botocore.exceptions import ConnectionClosedError, NoCredentialsError, ReadTimeoutError

    assert remote.is_transient(ConnectionClosedError(endpoint_url="http://x"))
    assert remote.is_transient(ReadTimeoutError(endpoint_url="http://x"))
    assert remote.is_transient(OSError(errno.EBUSY, "SlowDown"))
    assert remote.is_transient(remote.ShortRead("got 3 bytes"))
    assert not remote.is_transient(NoCredentialsError())
    assert not remote.is_transient(FileNotFoundError("gone"))
    assert not remote.is_transient(PermissionError("denied"))
    assert not remote.is_transient(OSError(errno.EINVAL, "InvalidRange"))


def test_config_in_s3_with_models_beside_it(s3, families, catalog, local_reference, tmp_path):
    """A config object in the bucket; relative model paths resolve against its prefix."""
    local, _ = families
    cfg = config_for(tmp_path, FamilyPaths("base", [e.name for e in local.experts]), "task_arithmetic", budget="25%")
    s3.client().put_object(Bucket=BUCKET, Key="fam/merge.yaml", Body=cfg.read_bytes())
    result = merge(config=f"s3://{BUCKET}/fam/merge.yaml", out=str(tmp_path / "out"), catalog=catalog)
    assert result["digest"] == local_reference["25%"]["digest"]
    with pytest.raises(BadInput, match="no-such.yaml: config file not found"):
        merge(config=f"s3://{BUCKET}/fam/no-such.yaml", out=str(tmp_path / "out2"), catalog=catalog)


def test_slices_from_s3_give_the_local_digest(s3, catalog, tmp_path):
    """A view names the shards of models other than its home by their full s3:// locations:
    a frankenmerge and a merge over slices read from S3 give the digests of the same configs on
    local disk."""
    from .test_slices import BASE, FRANKEN, ORCA, PAIRED, PLATYPUS, WIZARD, _config

    text = {"franken": json.dumps(FRANKEN), "paired": json.dumps(PAIRED)}
    local = {
        name: merge(
            config=str(_config(tmp_path, json.loads(t), f"{name}.yaml")), out=str(tmp_path / name), catalog=catalog
        )
        for name, t in text.items()
    }
    for model in (BASE, ORCA, PLATYPUS, WIZARD):
        uri = upload_folder(s3, Path(model), f"e2e/{Path(model).name}")
        text = {name: t.replace(json.dumps(model)[1:-1], uri) for name, t in text.items()}
    for name, t in text.items():
        assert not [m for m in (BASE, ORCA, PLATYPUS, WIZARD) if m in t]
        r = merge(
            config=str(_config(tmp_path, json.loads(t), f"{name}-s3.yaml")),
            out=f"s3://{BUCKET}/slices/{name}",
            catalog=catalog,
        )
        assert r["digest"] == local[name]["digest"], name


def test_a_lora_adapter_in_s3_gives_the_local_digest(s3, families, catalog, tmp_path):
    from mergepipe.devtools.synthetic import write_adapter

    from .reference import load_model

    local, remote_family = families
    adapter = write_adapter(tmp_path / "adapter", load_model(local.base), 5, rank=4, targets=("o_proj", "up_proj"))
    in_s3 = upload_folder(s3, adapter, "adapters/one")
    docs = {}
    for label, base, lora in (("local", local.base, adapter), ("s3", remote_family.base, in_s3)):
        cfg = tmp_path / f"{label}.yaml"
        models = [{"model": f"{base}+{lora}", "parameters": {"weight": 0.8}}]
        cfg.write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": str(base), "models": models}))
        docs[label] = merge(config=str(cfg), out=str(tmp_path / label), budget="50%", catalog=catalog)
    assert docs["s3"]["digest"] == docs["local"]["digest"]
    assert docs["s3"]["expert_bytes_read"] == docs["s3"]["expert_bytes_planned"] == docs["local"]["expert_bytes_read"]


def test_vocabularies_from_s3_give_the_local_digest(s3, catalog, tmp_path):
    """Models whose vocabularies differ, their tokenizer files read from S3: the same tokenizer
    and digest as from local folders, bytes read = plan."""
    pytest.importorskip("transformers")
    from .test_vocabulary_merge import E2E, _config, meaning

    local = _config("tokens", tmp_path / "local.yml")
    remote = tmp_path / "s3.yml"
    text = local.read_text()
    for name in ("base", "chat", "other"):
        text = text.replace(str(E2E / name), upload_folder(s3, E2E / name, f"vocab/{name}"))
    remote.write_text(text)
    docs = {
        label: merge(config=str(cfg), out=str(tmp_path / label), budget="50%", catalog=catalog)
        for label, cfg in (("local", local), ("s3", remote))
    }
    assert docs["s3"]["digest"] == docs["local"]["digest"]
    assert docs["s3"]["expert_bytes_read"] == docs["s3"]["expert_bytes_planned"] == docs["local"]["expert_bytes_read"]
    assert meaning(tmp_path / "s3") == meaning(tmp_path / "local")
