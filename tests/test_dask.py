"""Layer groups on a Dask LocalCluster with 2 worker processes give the thread runner's digest."""

from __future__ import annotations

import os
import socket

import pytest
from typer.testing import CliRunner

from mergepipe.cli import app
from mergepipe.errors import BadInput
from mergepipe.flows.merge import merge
from mergepipe.publish.manifest import verify_output

from .helpers import config_for

pytestmark = pytest.mark.slow


def test_dask_local_cluster_gives_the_thread_runner_digest(bf16_family, tmp_path, session_catalog, prefect_flows):
    cfg = config_for(tmp_path, bf16_family, "ties", density=0.6)
    threads = merge(config=str(cfg), out=str(tmp_path / "threads"), budget="50%", catalog=session_catalog)
    dask = merge(config=str(cfg), out=str(tmp_path / "dask"), budget="50%", catalog=session_catalog, runner="dask")
    assert dask["runner"] == "dask (LocalCluster, 2 workers)" and threads["runner"].startswith("thread")
    assert dask["digest"] == threads["digest"]
    # The groups really ran in the cluster's two worker processes, not in this one.
    assert len(dask["workers"]) == 2 and not any(w.endswith(f":{os.getpid()}") for w in dask["workers"])
    assert threads["workers"] == [f"{socket.gethostname()}:{os.getpid()}"]
    assert dask["expert_bytes_read"] == threads["expert_bytes_read"] == dask["expert_bytes_planned"]
    assert verify_output(tmp_path / "dask").ok


def test_runner_is_checked_before_any_work(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "linear")
    with pytest.raises(BadInput, match="runner: unknown 'ray'"):
        merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog, runner="ray")
    result = CliRunner().invoke(app, ["merge", str(cfg), "--out", str(tmp_path / "out"), "--dask-address", "tcp://x:1"])
    assert result.exit_code == 2 and "only with runner 'dask'" in result.output
    assert not (tmp_path / "out").exists()


def test_dask_workers_read_lora_experts_from_the_plan_alone(bf16_family, tmp_path, session_catalog, prefect_flows):
    """A worker process has only the plan: the LoRA recipes it records are enough to read."""
    import yaml

    from mergepipe.devtools.synthetic import write_adapter

    from .reference import load_model

    adapter = write_adapter(tmp_path / "adapter", load_model(bf16_family.base), 3, rank=4)
    models = [
        {"model": str(bf16_family.experts[0]), "parameters": {"weight": 0.5}},
        {"model": f"{bf16_family.base}+{adapter}", "parameters": {"weight": 0.9}},
    ]
    cfg = tmp_path / "lora.yaml"
    cfg.write_text(
        yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": str(bf16_family.base), "models": models})
    )
    threads = merge(config=str(cfg), out=str(tmp_path / "threads"), catalog=session_catalog)
    dask = merge(config=str(cfg), out=str(tmp_path / "dask"), catalog=session_catalog, runner="dask")
    assert dask["digest"] == threads["digest"]
    assert dask["expert_bytes_read"] == threads["expert_bytes_read"] == dask["expert_bytes_planned"]


def test_dask_workers_read_vocabulary_rows_from_the_plan_alone(tmp_path, session_catalog, prefect_flows):
    """The vocabulary recipes a plan records (rows of several models, the padding's mean) are
    enough for a worker process to read the output's rows."""
    pytest.importorskip("transformers")
    from .test_vocabulary_merge import _config

    cfg = _config("tokens", tmp_path / "c.yml", block_size="256B")
    threads = merge(config=str(cfg), out=str(tmp_path / "threads"), catalog=session_catalog, budget="60%")
    dask = merge(config=str(cfg), out=str(tmp_path / "dask"), catalog=session_catalog, budget="60%", runner="dask")
    assert dask["digest"] == threads["digest"]
    assert dask["expert_bytes_read"] == threads["expert_bytes_read"] == dask["expert_bytes_planned"]
