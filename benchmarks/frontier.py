"""Merges at frontier scale: the family of frontier_family.py, cold, one fresh `mergepipe`
process per run with flows in process, under a memory budget.

For each (operator, budget) it records wall time, peak anonymous memory (sampled RssAnon: what
the process allocated) beside peak total RSS (which also counts clean, reclaimable pages of
mapped files), expert bytes read, the predicted peak, and the I/O limit measured in the same
run: cold sequential reads of the same bytes (the whole base and each expert's planned bytes)
plus a write of the output's size with fsync. The index pass is measured on its own first;
with --first-merge there is none, and each merge starts from an empty catalog: a first merge
at a 100% budget indexes the family on the way (one read of every expert byte).

    .venv/bin/python benchmarks/frontier.py --data /work/bench-data/frontier --results benchmarks/results/frontier
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402
from frontier_family import write_model_config  # noqa: E402

MERGEPIPE = str(Path(sys.executable).parent / "mergepipe")


def write_config(path: Path, data: Path, experts: int, method: str) -> Path:
    lines = [f"merge_method: {method}", f"base_model: {data / 'base'}", "models:"]
    for k in range(experts):
        lines += [f"- model: {data / f'expert-{k}'}", "  parameters:", f"    weight: {round(1 / experts, 4)}"]
        if method == "ties":
            lines.append("    density: 0.5")
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--results", type=Path, required=True)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--memory", default="8GiB", help="the merges' --memory, or 'default' to give none")
    ap.add_argument("--cases", default="task_arithmetic:100%,task_arithmetic:10%,ties:100%,ties:10%")
    ap.add_argument("--scratch", type=Path, default=None, help="outputs and catalog (default: beside --data)")
    ap.add_argument("--first-merge", action="store_true", help="no index pass: each merge on an empty catalog")
    ap.add_argument("--mergekit", type=Path, default=None, help="mergekit-yaml to run on each case's config too")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="frontier-", dir=args.scratch or args.data.parent))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(MERGEPIPE_HOME=str(scratch / "home"), PREFECT_HOME=str(scratch / "prefect-home"))
    inputs = [args.data / "base"] + [args.data / f"expert-{k}" for k in range(args.experts)]
    files = [f for d in inputs for f in measure.model_files(d)]
    catalog = str(scratch / "catalog.duckdb")
    results: dict = {"machine": machine(), "experts": args.experts, "memory": args.memory, "runs": []}
    if (args.results / "results.json").exists():  # runs of other cases are kept
        results["runs"] = json.loads((args.results / "results.json").read_text())["runs"]
    results["input_bytes"] = sum(f.stat().st_size for f in files)
    try:
        if not args.first_merge:
            cfg = write_config(scratch / "index.yaml", args.data, args.experts, "task_arithmetic")
            measure.evict(files)
            m = measure.run_sampled([MERGEPIPE, "index", cfg, "--catalog", catalog, "--json"], env)
            results["index"] = {"seconds": m.seconds, "peak_anon": m.peak_anon, "peak_rss": m.peak_rss}
            print(f"index: {m.seconds:.1f} s, anon {m.peak_anon / 2**30:.2f} GiB, rss {m.peak_rss / 2**30:.2f} GiB")
        for case in args.cases.split(","):
            method, budget = case.split(":")
            cfg = write_config(scratch / f"{method}.yaml", args.data, args.experts, method)
            memory = [] if args.memory == "default" else ["--memory", args.memory]
            if args.first_merge:  # a catalog of its own, empty; the merge reads every expert file whole
                catalog = str(scratch / f"first-{method}-{budget.rstrip('%')}.duckdb")
                plan = {"planned_bytes_per_expert": [f.stat().st_size for f in files[1:]]}
            else:
                plan = json.loads(
                    measure.run_sampled(
                        [MERGEPIPE, "plan", cfg, "--budget", budget, *memory, "--catalog", catalog, "--json"], env
                    ).stdout
                )
            out = scratch / f"out-{method}-{budget.rstrip('%')}"
            measure.evict(files)
            t0 = time.time()
            m = measure.run_sampled(
                [MERGEPIPE, "merge", cfg, "--out", out, "--budget", budget, *memory, "--catalog", catalog, "--json"],
                env,
            )
            r = m.json()
            out_bytes = sum(f.stat().st_size for f in measure.model_files(out))
            shutil.rmtree(out)
            read_plan = [(files[0], files[0].stat().st_size)] + [
                (measure.model_files(d)[0], n) for d, n in zip(inputs[1:], plan["planned_bytes_per_expert"])
            ]
            limit = measure.hardware_limit(read_plan, out_bytes, scratch)
            row = {
                "method": method,
                "budget": budget,
                "memory": args.memory,
                "seconds": m.seconds,
                "peak_anon": m.peak_anon,
                "peak_rss": m.peak_rss,
                "expert_bytes_read": r["expert_bytes_read"],
                "reread_bytes": r["bytes"].get("reread", 0),
                "reread_bytes_max": r["memory"].get("reread_bytes_max", 0),
                "full_expert_bytes": r["full_expert_bytes"],
                "predicted_peak": r["memory"]["predicted_peak"],
                "workers": r["memory"]["workers"],
                "memory_warning": r["memory"]["warning"],
                "digest": r["digest"],
                "first_merge": "indexed_in_merge" in r,
                "io_limit": limit,
                "started": t0,
            }
            if args.mergekit is not None:
                row["mergekit"] = run_mergekit(args.mergekit, cfg, args.data, files, scratch, env)
                mk = row["mergekit"]
                print(f"  mergekit {method}: {mk['seconds']:.1f} s, anon {mk['peak_anon'] / 2**30:.2f} GiB", flush=True)
            results["runs"].append(row)
            print(
                f"{method} {budget}: {m.seconds:.1f} s (I/O limit {limit['seconds']:.1f} s, "
                f"{m.seconds / limit['seconds']:.2f}×; with O_DIRECT reads {limit['direct_seconds']:.1f} s, "
                f"{m.seconds / limit['direct_seconds']:.2f}×), anon {m.peak_anon / 2**30:.2f} GiB, "
                f"rss {m.peak_rss / 2**30:.2f} GiB, predicted {r['memory']['predicted_peak'] / 2**30:.2f} GiB, "
                f"{r['memory']['workers']} group(s) at once, {r['bytes'].get('reread', 0) / 1e9:.2f} GB read again",
                flush=True,
            )
            args.results.mkdir(parents=True, exist_ok=True)
            (args.results / "results.json").write_text(json.dumps(results, indent=1))
            (args.results / "results.md").write_text(render(results))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_mergekit(exe: Path, cfg: Path, data: Path, files: list[Path], scratch: Path, env: dict) -> dict:
    """mergekit 0.1.5 on the same config, cold, its memory sampled like mergepipe's. Its full
    budget reads every expert byte whatever the case's budget."""
    for folder in [data / "base", *sorted(data.glob("expert-*"))]:
        write_model_config(folder, json.loads((data / "family.json").read_text())["shapes"])
    out = scratch / "mergekit-out"
    measure.evict(files)
    m = measure.run_sampled(
        [exe, cfg, out, "--no-copy-tokenizer", "--no-write-model-card"],
        dict(env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
    )
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": m.seconds, "peak_anon": m.peak_anon, "peak_rss": m.peak_rss}


def render(results: dict) -> str:
    gib = 2**30
    lines = [
        "# Benchmark: frontier-scale family",
        "",
        f"Machine: {results['machine']}. K = {results['experts']}, inputs {results['input_bytes'] / 1e9:.1f} GB. "
        "Cold, one run each, flows in process.",
        "",
    ]
    if "index" in results:
        i = results["index"]
        lines += [f"- index: {i['seconds']:.1f} s, peak anonymous {i['peak_anon'] / gib:.2f} GiB", ""]
    lines += [
        "| operator | budget | --memory | wall s | I/O limit s | × limit | direct I/O limit s | × direct | "
        "peak anon GiB | peak RSS GiB | predicted GiB | groups at once | expert GB read | GB read again |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        lim = r["io_limit"]["seconds"]
        direct = r["io_limit"].get("direct_seconds")
        direct_cells = f"{direct:.1f} | {r['seconds'] / direct:.2f}" if direct else "| "
        lines.append(
            f"| {r['method']}{' (first merge)' if r.get('first_merge') else ''} | {r['budget']} | {r.get('memory', '8GiB')} | {r['seconds']:.1f} | {lim:.1f} | "
            f"{r['seconds'] / lim:.2f} | {direct_cells} | {r['peak_anon'] / gib:.2f} | {r['peak_rss'] / gib:.2f} | "
            f"{r['predicted_peak'] / gib:.2f} | {r['workers']} | {r['expert_bytes_read'] / 1e9:.2f} | "
            f"{r.get('reread_bytes', 0) / 1e9:.2f} |"
        )
    for r in results["runs"]:
        if "mergekit" in r:
            mk = r["mergekit"]
            lines.append(
                f"\nmergekit 0.1.5, {r['method']} (the same config, cold): {mk['seconds']:.1f} s, "
                f"peak anon {mk['peak_anon'] / gib:.2f} GiB, peak RSS {mk['peak_rss'] / gib:.2f} GiB"
            )
    return "\n".join(lines) + "\n"


def machine() -> str:
    import platform

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} CPUs ({platform.machine()}), {mem:.0f} GiB RAM, Python {platform.python_version()}"


if __name__ == "__main__":
    main()
