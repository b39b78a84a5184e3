"""Cost per tensor: the same bytes as ~100k small tensors (an MoE checkpoint as hubs ship it,
one tensor per expert matrix) and as ~200 large ones, indexed and merged cold.

Both families: 64 layers, bf16, about 1 GB per checkpoint, K experts (full fine-tune-like
deltas from frontier_family.py's generator). "moe": per layer 512 experts × (gate, up, down)
of 64 × 80; "dense": per layer 3 tensors of 32768 × 80; tensors lie in each file in the
order safetensors writes them (by name, for one dtype). For each, the index pass and a
task_arithmetic merge at 100% as fresh processes (flows in process), the catalog's size and
rows, and the saved plan's size; then a first merge on an empty catalog, which indexes the
family on the way.

    .venv/bin/python benchmarks/many_tensors.py --data /work/bench-data/many --results benchmarks/results/many-tensors
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402
from frontier import MERGEPIPE, machine, write_config  # noqa: E402
from frontier_family import write_checkpoint  # noqa: E402

LAYERS, MOE_EXPERTS, ROWS, WIDTH = 64, 512, 64, 80


def shapes(kind: str) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}.mlp."
        for m in ("gate_proj", "up_proj", "down_proj"):
            if kind == "moe":
                out.update({f"{p}experts.{e}.{m}.weight": (ROWS, WIDTH) for e in range(MOE_EXPERTS)})
            else:
                out[f"{p}{m}.weight"] = (ROWS * MOE_EXPERTS, WIDTH)
    # In file in the order safetensors' writer uses (by dtype, then name), as hubs ship them.
    return dict(sorted(out.items()))


def build(folder: Path, kind: str, experts: int) -> list[Path]:
    models = [folder / "base"] + [folder / f"expert-{k}" for k in range(experts)]
    for i, m in enumerate(models):
        if not (m / "model.safetensors").exists():
            write_checkpoint(m, shapes(kind), None if i == 0 else i - 1)
    return models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--results", type=Path, required=True)
    ap.add_argument("--experts", type=int, default=4)
    args = ap.parse_args()
    results = {"machine": machine(), "experts": args.experts, "families": {}}
    for kind in ("dense", "moe"):
        models = build(args.data / kind, kind, args.experts)
        files = [f for m in models for f in measure.model_files(m)]
        scratch = Path(tempfile.mkdtemp(prefix=f"many-{kind}-", dir=args.data))
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
        env.update(MERGEPIPE_HOME=str(scratch / "home"), PREFECT_HOME=str(scratch / "prefect-home"))
        cfg = write_config(scratch / "merge.yaml", args.data / kind, args.experts, "task_arithmetic")
        catalog = scratch / "catalog.duckdb"
        try:
            measure.evict(files)
            idx = measure.run_sampled([MERGEPIPE, "index", cfg, "--catalog", catalog, "--json"], env)
            measure.evict(files)
            m = measure.run_sampled(
                [MERGEPIPE, "merge", cfg, "--out", scratch / "out", "--catalog", catalog, "--json"], env
            )
            r = m.json()
            plan_bytes = sum(p.stat().st_size for p in (scratch / "home").rglob("*") if p.is_file())
            rows = json.loads(
                measure.run_sampled(
                    [MERGEPIPE, "catalog", "sql", "select count(*) as n from block_stats", "--catalog", catalog]
                    + ["--json"],
                    env,
                ).stdout
            )[0]["n"]
            shutil.rmtree(scratch / "out")
            measure.evict(files)
            first = measure.run_sampled(
                [MERGEPIPE, "merge", cfg, "--out", scratch / "out", "--catalog", scratch / "first.duckdb", "--json"],
                env,
            )
            assert first.json()["digest"] == r["digest"] and "indexed_in_merge" in first.json()
            results["families"][kind] = {
                "tensors": len(shapes(kind)),
                "bytes_per_checkpoint": files[0].stat().st_size,
                "index_seconds": idx.seconds,
                "merge_seconds": m.seconds,
                "merge_timings": r["timings"],
                "merge_peak_anon": m.peak_anon,
                "first_merge_seconds": first.seconds,
                "first_merge_timings": first.json()["timings"],
                "first_merge_peak_anon": first.peak_anon,
                "catalog_bytes": catalog.stat().st_size,
                "block_stats_rows": rows,
                "saved_plan_bytes": plan_bytes,
            }
            print(kind, json.dumps(results["families"][kind]), flush=True)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    d, e = results["families"]["dense"], results["families"]["moe"]
    results["ratios"] = {k: e[k] / d[k] for k in ("index_seconds", "merge_seconds", "first_merge_seconds")}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results["ratios"]))


if __name__ == "__main__":
    main()
