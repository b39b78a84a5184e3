"""What merges that do not depend on the CPU's float kernels cost: each method's merge time with
the working tree against an earlier commit (by default HEAD), builds alternating method by
method, round by round, on one family with a warm page cache.

    .venv/bin/python benchmarks/llm_family.py --out /work/bench-data/mid --experts 3 --layers 8
    .venv/bin/python benchmarks/kernel_cost.py --family /work/bench-data/mid [--before REV] [--rounds 2]

The earlier commit is checked out in a temporary git worktree and imported from there, with
the same venv. Each build has its own catalog, indexed before the first
timed merge. Printed per method: the flow's merge seconds (the `merge` timing: reading and
merging the groups) of each build, the median over rounds, and the change. The outputs' digests
are printed too: where a method's arithmetic changed, they differ between the builds.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", type=Path, required=True)
    ap.add_argument("--before", default="HEAD")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", nargs="*", default=list(CASES))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kernel-cost-"))
    before = work / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True)
    builds = {"before": before, "after": ROOT}
    try:
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
