"""What merges that do not depend on the CPU's float kernels cost: each method's merge time with
the working tree against an earlier commit (by default HEAD), builds alternating method by
method, round by round, on one family with a warm page cache.

    .venv/bin/python benchmarks/llm_family.py --out /work/bench-data/mid --experts 3 --layers 8
    .venv/bin/python benchmarks/kernel_cost.py --family /work/bench-data/mid [--before REV] [--rounds 2]
    .venv/bin/python benchmarks/kernel_cost.py --operators [--elements 8000000] [--before REV]

The earlier commit is checked out in a temporary git worktree and imported from there, with
the same venv. Each build has its own catalog, indexed before the first
timed merge. Printed per method: the flow's merge seconds (the `merge` timing: reading and
merging the groups) of each build, the median over rounds, and the change. The outputs' digests
are printed too: where a method's arithmetic changed, they differ between the builds.

--operators times the arithmetic alone: each method's merge() of one fp32 tensor of --elements
elements held in memory (K experts as in the config cases), the median of 3, each build in a
process of its own, builds alternating method by method.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.kernel_merges import CASES  # noqa: E402  (every method, with its parameters)


def _config(path: Path, family: Path, method: str) -> Path:
    from tests.kernel_merges import write_config

    experts = sorted(str(p) for p in family.glob("expert-*"))
    write_config(path, {"base": str(family / "base"), "experts": experts}, method)
    cfg = yaml.safe_load(path.read_text())
    cfg.pop("block_size", None)  # the default block size, as users run it
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


# The CLI, imported from a given tree: the venv's editable install puts a finder ahead of
# PYTHONPATH, so it is taken out first (else every build would run the working tree's code).
LAUNCH = """
import runpy, sys
tree = sys.argv.pop(1)
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path.insert(0, tree)
import mergepipe
assert mergepipe.__file__.startswith(tree), mergepipe.__file__
runpy.run_module("mergepipe.cli", run_name="__main__", alter_sys=True)
"""


def _merge(tree: Path, cfg: Path, out: Path, catalog: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MERGEPIPE_ORCHESTRATION")}
    env.update(PREFECT_SERVER_EPHEMERAL_ENABLED="false")
    cmd = [sys.executable, "-c", LAUNCH, str(tree), "merge", str(cfg), "--out", str(out), "--overwrite"]
    done = subprocess.run([*cmd, "--catalog", str(catalog), "--json"], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {cfg.name}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


OPERATOR_CHILD = """
import json, statistics, sys, time
import torch
from mergepipe.operators import OPERATORS, TensorContext
method, k, n, per_model, shared = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *map(json.loads, sys.argv[4:6])
op = OPERATORS[method]
values = {name: tuple([v] * k) for name, v in per_model.items()}
if op.declared("weight") is not None:
    values["weight"] = (0.6, 0.9, 0.4)[:k]
g = torch.Generator().manual_seed(0)
base = torch.randn(2000, n // 2000, generator=g) * 0.02
experts = [base + torch.randn(base.shape, generator=g) * 0.002 for _ in range(k)]
params, ctx = op.params(k, **values, **shared), TensorContext("t", ((0, 2000),), seed=0)
times = []
for _ in range(3):
    t0 = time.perf_counter()
    op.merge(base, experts, params, ctx)
    times.append(time.perf_counter() - t0)
print(json.dumps(statistics.median(times)))
"""


def _operator_seconds(tree: Path, method: str, elements: int) -> float:
    per_model, k, shared = CASES[method]
    launch = LAUNCH.replace('runpy.run_module("mergepipe.cli", run_name="__main__", alter_sys=True)', OPERATOR_CHILD)
    args = [method, str(k), str(elements), json.dumps(per_model), json.dumps(shared)]
    done = subprocess.run([sys.executable, "-c", launch, str(tree), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {method}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", type=Path)
    ap.add_argument("--before", default="HEAD")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", nargs="*", default=list(CASES))
    ap.add_argument("--operators", action="store_true", help="time merge() on tensors in memory")
    ap.add_argument("--elements", type=int, default=8_000_000)
    args = ap.parse_args()
    if not args.operators and args.family is None:
        ap.error("--family is required (or --operators)")
    work = Path(tempfile.mkdtemp(prefix="kernel-cost-"))
    before = work / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True)
    builds = {"before": before, "after": ROOT}
    try:
        if args.operators:
            print(f"{'method':18s} {'before s':>9s} {'after s':>9s} {'change':>8s}   ({args.elements} elements)")
            for method in (m for m in args.methods if CASES[m][1] > 0):
                b, a = (_operator_seconds(builds[n], method, args.elements) for n in ("before", "after"))
                print(f"{method:18s} {b:9.3f} {a:9.3f} {100 * (a - b) / b:+7.1f}%", flush=True)
            return
        times: dict[tuple[str, str], list[float]] = {}
        digests: dict[tuple[str, str], str] = {}
        for r in range(args.rounds):
            for method in args.methods:
                cfg = _config(work / f"{method}.yaml", args.family, method)
                order = list(builds) if r % 2 == 0 else list(reversed(builds))
                for name in order:
                    out = work / f"out-{name}"
                    res = _merge(builds[name], cfg, out, work / f"catalog-{name}.duckdb")
                    shutil.rmtree(out, ignore_errors=True)
                    if r == 0 and (name, method) not in times and res.get("indexed_in_merge"):
                        # a first merge indexes on the way: time the next one instead
                        res = _merge(builds[name], cfg, out, work / f"catalog-{name}.duckdb")
                        shutil.rmtree(out, ignore_errors=True)
                    times.setdefault((name, method), []).append(res["timings"]["merge"])
                    digests[(name, method)] = res["digest"]
                    print(f"round {r} {method:18s} {name:6s} {res['timings']['merge']:7.2f} s", flush=True)
        print(f"\n{'method':18s} {'before s':>9s} {'after s':>9s} {'change':>8s}  same bytes")
        for method in args.methods:
            b, a = (statistics.median(times[(n, method)]) for n in ("before", "after"))
            same = digests[("before", method)] == digests[("after", method)]
            print(f"{method:18s} {b:9.2f} {a:9.2f} {100 * (a - b) / b:+7.1f}%  {'yes' if same else 'no'}")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
