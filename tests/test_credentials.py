"""Credentials travel with the merge, not the process: each merge's storage options reach the
threads and the Dask tasks that read for it, and two merges with different options, one after
the other or at once, each sign every request with their own key (seen by the S3 proxy)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from mergepipe.devtools.synthetic import FamilyPaths, make_family
from mergepipe.flows.merge import merge
from mergepipe.storage.location import ContextPool, current_options, hub_token, storage_options
from mergepipe.tasks.heartbeat import beating

from .helpers import config_for


def test_options_belong_to_the_context_that_set_them():
    seen: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def merge_like(name: str) -> None:
        with storage_options({"hf_token": f"token-{name}"}):
            barrier.wait()  # both are inside their block at once
            with ContextPool(2) as pool:  # threads a merge starts read with its options
                seen[name] = pool.submit(hub_token).result()
            beat = threading.Event()
            got = []
            with beating(lambda: got.append(hub_token()) or beat.set() or False, 0.01, "test"):
                assert beat.wait(60)  # a lease renewed by a heartbeat renews with its merge's options
            seen[f"{name}-heartbeat"] = got[0]

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(merge_like, ["a", "b"]))
    assert seen == {"a": "token-a", "b": "token-b", "a-heartbeat": "token-a", "b-heartbeat": "token-b"}
    assert current_options() == {}  # nothing left behind in the caller


def test_a_flow_keeps_its_options_to_itself(bf16_family, tmp_path, session_catalog):
    """A merge whose config gives storage options leaves none in its caller: the next merge in
    the process (here, one without options) reads with the environment's."""
    cfg = config_for(tmp_path, bf16_family, "linear", storage_options={"anon": True})
    merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    assert current_options() == {}


@pytest.mark.slow
def test_two_merges_on_one_dask_worker_sign_with_their_own_keys(s3, tmp_path, prefect_flows):
    from distributed import LocalCluster

    from .test_s3 import upload_folder

    local = make_family(
        tmp_path / "fam",
        experts=("dense", "dense"),
        n_layers=2,
        hidden=128,
        intermediate=256,
        vocab=512,
        dtype="bfloat16",
        shards=1,
        seed=5,
    )
    keys = {"a": "AKIDMERGEPIPEA", "b": "AKIDMERGEPIPEB"}
    configs = {}
    for who, key in keys.items():
        base = upload_folder(s3, local.base, f"cred-{who}/base")
        experts = [upload_folder(s3, e, f"cred-{who}/{e.name}") for e in local.experts]
        configs[who] = config_for(
            tmp_path,
            FamilyPaths(base, experts),
            "task_arithmetic",
            name=f"{who}.yaml",
            budget="50%",
            storage_options={
                "key": key,
                "secret": f"secret-{who}",
                "endpoint_url": s3.endpoint,
                "client_kwargs": {"region_name": "us-east-1"},
            },
        )

    with LocalCluster(
        n_workers=1, threads_per_worker=2, processes=True, dashboard_address=None, silence_logs=logging.ERROR
    ) as cluster:

        def run(who: str, tag: str) -> dict:
            return merge(
                config=str(configs[who]),
                out=f"s3://ckpt/cred-{who}/out-{tag}",
                catalog=str(tmp_path / f"catalog-{who}.duckdb"),
                runner="dask",
                dask_address=cluster.scheduler_address,
            )

        def check(results: dict[str, dict]) -> None:
            exchanges = s3.proxy.taken()
            for who, key in keys.items():
                mine = [x for x in exchanges if x.key.startswith(f"ckpt/cred-{who}/")]
                assert mine and {x.access_key for x in mine} == {key}, who
                assert len(results[who]["workers"]) == 1  # the cluster's one worker ran its groups
            # Requests that name no model (the bucket's check) were signed by one merge or the other.
            assert {x.access_key for x in exchanges} <= set(keys.values())

        s3.proxy.reset()
        check({who: run(who, "one-by-one") for who in keys})
        s3.proxy.reset()
        with ThreadPoolExecutor(2) as pool:
            futures = {who: pool.submit(run, who, "at-once") for who in keys}
            results = {who: f.result() for who, f in futures.items()}
        check(results)
        assert results["a"]["workers"] == results["b"]["workers"]
