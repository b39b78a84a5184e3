"""One digest on every machine: a merge's bytes do not depend on the float kernels torch
dispatches to (ATEN_CPU_CAPABILITY: the plain kernels, AVX2, AVX-512 where the CPU has them),
for every method, budget and memory form, and on Dask workers that run different ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mergepipe.devtools.synthetic import make_family
from mergepipe.operators.kernels import kernel_set, kernel_sets

ROOT = Path(__file__).resolve().parent.parent


def _env(kernels: str, tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MERGEPIPE_ORCHESTRATION")}
    return dict(
        env,
        ATEN_CPU_CAPABILITY=kernels,
        PREFECT_HOME=str(tmp / "prefect-home"),
        PREFECT_SERVER_EPHEMERAL_ENABLED="false",
    )


def _family(root: Path) -> dict:
    # bf16 matrices, fp32 norms; the embedding (1024 x 96) spans more than one lane sweep.
    fam = make_family(
        root, experts=("dense", "dense", "lora"), n_layers=2, hidden=96, intermediate=192, vocab=1024, seed=3
    )
    return {"base": str(fam.base), "experts": [str(e) for e in fam.experts]}


def test_kernel_sets_start_with_the_plain_one_and_end_with_this_process():
    sets = kernel_sets()
    assert sets[0] == "default" and sets[-1] == kernel_set()


@pytest.mark.slow
def test_every_method_gives_one_digest_under_every_kernel_set(tmp_path):
    if len(kernel_sets()) < 2:
        pytest.skip("this CPU offers torch one kernel set: nothing to compare")
    family = tmp_path / "family.json"
    family.write_text(json.dumps(_family(tmp_path / "fam")))
    runs = {}
    for kernels in kernel_sets():
        work = tmp_path / kernels
        work.mkdir()
        done = subprocess.run(
            [sys.executable, "-m", "tests.kernel_merges", str(family), str(work)],
            cwd=ROOT,
            env=_env(kernels, tmp_path),
            capture_output=True,
            text=True,
            timeout=1500,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        runs[kernels] = json.loads(done.stdout.splitlines()[-1])
        assert runs[kernels]["kernels"] == kernels
        # the small-memory cases did run over windows and in streamed runs
        assert runs[kernels]["forms"]["windowed"] > 0 and runs[kernels]["forms"]["streamed"] > 0
    first, *others = runs.values()
    cases = first["digests"]
    assert len(cases) == 2 * 19 + 1 + 3
    for run in others:
        differ = sorted(c for c in cases if run["digests"][c] != cases[c])
        assert not differ, f"{run['kernels']} differs from {first['kernels']} on {differ}"
    # A merge in windows or streamed runs gives the whole merge's bytes.
    for method in ("ties", "slerp", "linear"):
        assert cases[f"{method}@100%/small-memory"] == cases[f"{method}@100%"], method


@pytest.mark.slow
def test_dask_workers_under_different_kernel_sets_give_the_thread_runners_digest(
    bf16_family, tmp_path, session_catalog
):
    """Two worker processes, one on the plain kernels and one on this CPU's widest: their layer
    groups make the output one process makes, and the manifest names both kernel sets."""
    import logging

    import yaml
    from distributed import Client, LocalCluster

    from mergepipe.flows.merge import merge

    from .helpers import config_for

    plain, widest = kernel_sets()[0], kernel_sets()[-1]
    if plain == widest:
        pytest.skip("this CPU offers torch one kernel set: nothing to compare")
    configs = [
        config_for(tmp_path, bf16_family, "linear", name="linear.yaml"),
        config_for(tmp_path, bf16_family, "ties", density=0.6, name="ties.yaml", budget="60%"),
        tmp_path / "slerp.yaml",
    ]
    configs[2].write_text(
        yaml.safe_dump(
            {
                "merge_method": "slerp",
                "base_model": str(bf16_family.base),
                "models": [{"model": str(bf16_family.experts[0])}],
                "parameters": {"t": 0.4},
                "block_size": "4KiB",
            }
        )
    )
    with LocalCluster(n_workers=0, processes=True, dashboard_address=None, silence_logs=logging.ERROR) as cluster:
        workers = [
            subprocess.Popen(
                [sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address]
                + ["--nthreads", "1", "--no-dashboard", "--name", kernels],
                env=_env(kernels, tmp_path),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for kernels in (plain, widest)
        ]
        try:
            with Client(cluster.scheduler_address) as client:
                client.wait_for_workers(2, timeout=300)  # started under load, they may take minutes
            for c in configs:
                threads = merge(config=str(c), out=str(tmp_path / f"{c.stem}-threads"), catalog=session_catalog)
                dask = merge(
                    config=str(c),
                    out=str(tmp_path / f"{c.stem}-dask"),
                    catalog=session_catalog,
                    runner="dask",
                    dask_address=cluster.scheduler_address,
                )
                assert dask["digest"] == threads["digest"], c.stem
                assert len(dask["workers"]) == 2
                assert dask["cpu_kernels"] == sorted({plain, widest})
                assert threads["cpu_kernels"] == [kernel_set()]
        finally:
            for w in workers:
                w.terminate()
            for w in workers:
                w.wait(timeout=120)


def test_fixed_reductions_are_within_an_ulp_of_the_exact_sum():
    """fp64 lanes, rounded once: within one fp32 ulp of math.fsum's exactly rounded sum (torch's
    fp32 norm of a million elements is off by far more)."""
    import math

    import torch

    from mergepipe.operators.reductions import fixed_dot, fixed_norm, fixed_sum, norm_last, sum_last

    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 4096, 65536 * 3 + 5):
        a, b = torch.randn(n, generator=g) * 3, torch.randn(n, generator=g)
        a64, b64 = a.double().tolist(), b.double().tolist()
        exact = {
            "sum": math.fsum(a64),
            "norm": math.sqrt(math.fsum(x * x for x in a64)),
            "dot": math.fsum(x * y for x, y in zip(a64, b64)),
        }
        got = {"sum": fixed_sum(a), "norm": fixed_norm(a), "dot": fixed_dot(a, b)}
        for k, v in got.items():
            assert v.dtype == torch.float32 and v.dim() == 0
            ulp32 = math.ulp(abs(exact[k])) * 2.0**29  # an fp32 ulp at that magnitude
            assert abs(float(v) - exact[k]) <= ulp32, (n, k)
    rows = torch.randn(5, 3, 333, generator=g)
    for x, kind in ((sum_last(rows), "sum"), (norm_last(rows), "norm")):
        assert x.shape == (5, 3, 1)
        for i, j in ((0, 0), (4, 2)):
            r = rows[i, j].double().tolist()
            want = math.fsum(r) if kind == "sum" else math.sqrt(math.fsum(v * v for v in r))
            assert abs(float(x[i, j, 0]) - want) <= math.ulp(abs(want)) * 2.0**29


def test_exp_and_log_are_within_an_fp64_ulp_or_two_and_keep_the_special_values():
    import math

    import torch

    from mergepipe.operators.elementary import exp64, log64, softmax64

    x = torch.cat([torch.linspace(-744, 709, 20001, dtype=torch.float64), torch.randn(20000, dtype=torch.float64) * 4])
    ref = torch.tensor([math.exp(v) for v in x.tolist()], dtype=torch.float64)
    normal = ref > 2.0**-1022
    assert float(((exp64(x) - ref).abs() / ref)[normal].max()) <= 4 * 2.0**-53
    y = torch.cat(
        [torch.rand(20000, dtype=torch.float64) * 10 + 1e-300, torch.logspace(-320, 300, 2000, dtype=torch.float64)]
    )
    ref = torch.tensor([math.log(v) for v in y.tolist()], dtype=torch.float64)
    assert float(((log64(y) - ref).abs() / ref.abs().clamp(min=1e-300)).max()) <= 4 * 2.0**-53
    special = torch.tensor([0.0, -1.0, math.inf, math.nan], dtype=torch.float64)
    got = log64(special)
    assert got[0] == -math.inf and got[1].isnan() and got[2] == math.inf and got[3].isnan()
    got = exp64(torch.tensor([-math.inf, math.inf, math.nan, 0.0], dtype=torch.float64))
    assert got[0] == 0 and got[1] == math.inf and got[2].isnan() and got[3] == 1
    logits = torch.randn(7, 300) * 5
    assert torch.allclose(softmax64(logits.double()).float(), torch.softmax(logits, -1), rtol=1e-6, atol=1e-9)
