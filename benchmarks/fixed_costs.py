"""What each command costs before it does any work: wall time and peak RSS of a fresh process,
and whether it imported torch or Prefect.

    .venv/bin/python benchmarks/fixed_costs.py --results benchmarks/results/fixed-costs/commands

Commands run as a new user's would, with no Prefect API configured (flows in process), on the
demo family (built once in the scratch folder by `mergepipe demo`) and on a tiny family of one
1-layer expert. Each figure is the median of --runs fresh processes; a separate run of each
command under `python -X importtime` says which heavy packages it loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402

HEAVY = ("torch", "prefect", "duckdb", "pyarrow", "numpy", "pydantic")
# The targets (seconds of wall time); None: no target.
TARGETS = {"--help": 1.0, "catalog sql": 1.0, "catalog schema": 1.0, "verify": 1.0, "plan": 2.0, "tiny merge": 3.0}


def commands(scratch: Path) -> dict[str, list[str]]:
    demo = scratch / "mergepipe-demo"
    catalog = str(demo / "catalog.duckdb")
    return {
        "--help": ["--help"],
        "catalog sql": ["catalog", "sql", "select count(*) from models", "--catalog", catalog],
        "catalog schema": ["catalog", "schema", "--catalog", catalog],
        "verify": ["verify", str(demo / "merged-full")],
        "plan": ["plan", str(demo / "merge.yaml"), "--budget", "25%", "--catalog", catalog],
        "tiny merge": [
            "merge",
            str(scratch / "tiny.yaml"),
            "--out",
            str(scratch / "tiny-out"),
            "--overwrite",
            "--catalog",
            str(scratch / "tiny.duckdb"),
        ],
    }


def heavy_imports(args: list[str], env: dict) -> list[str]:
    """The heavy top-level packages a command imported (from -X importtime's report on stderr)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mergepipe.cli", *args], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"mergepipe {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    loaded = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    # A package bound lazily (torch, in mergepipe/__init__.py) is reported by its submodules only.
    return [m for m in HEAVY if any(x == m or x.startswith(m + ".") for x in loaded)]


def measure_all(scratch: Path, runs: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(MERGEPIPE_HOME=str(scratch / "home"), PREFECT_HOME=str(scratch / "prefect-home"))
    env.pop("MERGEPIPE_ORCHESTRATION", None)
    exe = str(Path(sys.executable).parent / "mergepipe")
    subprocess.run([exe, "demo", "--out", str(scratch / "mergepipe-demo")], env=env, check=True, capture_output=True)
    from mergepipe.devtools.synthetic import make_family, write_config

    fam = make_family(scratch / "tiny", experts=("dense",), n_layers=1, hidden=32, intermediate=64, vocab=64)
    write_config(scratch / "tiny.yaml", fam, "task_arithmetic", weights=[0.5])
    rows = {}
    for label, args in commands(scratch).items():
        ms = [measure.run([exe, *args], env=env) for _ in range(runs)]
        rows[label] = {
            "seconds": median(m.seconds for m in ms),
            "runs": [m.seconds for m in ms],
            "peak_rss": max(m.peak_rss for m in ms),
            "imports": heavy_imports(args, env),
            "target_seconds": TARGETS.get(label),
        }
    return rows


def render(results: dict) -> str:
    lines = [
        "# Fixed costs of each command",
        "",
        f"Machine: {results['machine']}. Code: {results['commit']}. Median of {results['runs']} fresh processes, "
        "no Prefect API configured (flows in process).",
        "",
        "| command | wall s | target s | peak RSS MiB | heavy imports |",
        "|---|---|---|---|---|",
    ]
    for label, r in results["commands"].items():
        target = f"{r['target_seconds']:.0f}" if r["target_seconds"] else "–"
        met = "" if not r["target_seconds"] else (" ✓" if r["seconds"] <= r["target_seconds"] else " ✗")
        lines.append(
            f"| `{label}` | {r['seconds']:.2f}{met} | {target} | {r['peak_rss'] / 2**20:,.0f} | "
            f"{', '.join(r['imports']) or '–'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="mergepipe-fixed-") as tmp:
        results = {
            "machine": f"{os.cpu_count()} CPUs, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM",
            "commit": commit,
            "runs": args.runs,
            "commands": measure_all(Path(tmp), args.runs),
        }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "results.json").write_text(json.dumps(results, indent=1))
    (args.results / "results.md").write_text(render(results))
    print(render(results))


if __name__ == "__main__":
    main()
