"""Merge the LLM-shaped benchmark family again and compare each digest with the one its benchmark
run recorded (benchmarks/results/*/results.json): a refactor that claims to change no output
shows here that it changed none. With --memory, under a memory budget small enough that large
tensors are merged in parts (runs of rows, windows of rows in passes).

    .venv/bin/python benchmarks/llm_family.py --out /work/bench-data/llm --experts 4
    .venv/bin/python benchmarks/check_digests.py --data /work/bench-data/llm --k 2,4 --budgets 10,100

Each merge is a fresh `mergepipe merge --json` process run in process (no Prefect server: the
digest does not depend on the orchestration), with the configs the benchmark runner writes. It
prints one line per merge and exits 1 when any digest differs from the recorded one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.run import Family  # noqa: E402

RESULTS = [ROOT / "benchmarks/results/llm-ta/results.json", ROOT / "benchmarks/results/llm-gta/results.json"]


def recorded_digests() -> dict[tuple[str, str, str], str]:
    """(family label, operator, budget) -> the digest its benchmark run recorded."""
    out = {}
    for path in RESULTS:
        for fam in json.loads(path.read_text())["families"]:
            for op, result in fam["operators"].items():
                for row in result["rows"]:
                    out[(fam["label"], op, row["budget"])] = row["digest"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--k", default="2,4")
    ap.add_argument("--operators", default="task_arithmetic,ties,dare_ties")
    ap.add_argument("--budgets", default="10,100")
    ap.add_argument("--memory", default=None, help="each merge's --memory (the digest must not change with it)")
    args = ap.parse_args()
    recorded = recorded_digests()
    scratch = Path(tempfile.mkdtemp(prefix="mergepipe-digests-"))
    env = dict(os.environ, MERGEPIPE_HOME=str(scratch / "home"), MERGEPIPE_ORCHESTRATION="local")
    mergepipe = str(Path(sys.executable).parent / "mergepipe")
    differ = 0
    try:
        for k in map(int, args.k.split(",")):
            fam = Family(f"k{k}", args.data, [f"expert-{i}" for i in range(k)])
            catalog = scratch / f"catalog-k{k}.duckdb"
            for op in args.operators.split(","):
                cfg = fam.config(op)
                for b in args.budgets.split(","):
                    out = scratch / "out"
                    done = subprocess.run(
                        [
                            mergepipe,
                            "merge",
                            str(cfg),
                            "--out",
                            str(out),
                            "--budget",
                            f"{b}%",
                            "--overwrite",
                            "--catalog",
                            str(catalog),
                            "--json",
                            *(["--memory", args.memory] if args.memory else []),
                        ],
                        env=env,
                        capture_output=True,
                        text=True,
                    )
                    if done.returncode != 0:
                        print(
                            f"k{k} {op} {b}%: merge failed ({done.returncode}): {done.stderr.strip()[-400:]}",
                            flush=True,
                        )
                        differ += 1
                        continue
                    digest = json.loads(done.stdout)["digest"]
                    want = recorded.get((f"k{k}", op, f"{b}%"))
                    same = "same" if digest == want else f"DIFFERS from recorded {want}"
                    differ += digest != want
                    print(f"k{k} {op} {b}%: {digest} {same}", flush=True)
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
