"""What the MiniLM family's held-out loss needs of the experts' deltas: task_arithmetic merges
(weights 0.25, in fp32 with torch, outside mergepipe) that leave out every delta of one tensor
kind, or of one layer, and keep the rest; each scored per domain against the merge of all.

    .venv/bin/python -m benchmarks.calibration_ablation --minilm /work/bench-data/minilm \\
        --results benchmarks/results/calibration

A kind is a tensor's name without its layer (`attention.self.query` covers its weight and bias in
all six layers); a layer is `embeddings`, `layer.N` or `pooler`. Reported per row: the share of
the experts' delta bytes it holds, and the worst domain's loss increase when it is left out. A
budget that must leave out some bytes can afford to leave out those whose rows here are small.

With `--oracle VARIANT=CATALOG` (the calibration bench's catalog of that variant, kept with its
--work): each (expert, weight block) of the encoder left out alone instead, its mean loss
increase stored as a calibration of the base, and mergepipe's merges at --budgets ranked by it
and scored (minilm_oracle_VARIANT.json): how far a ranking that knew each block's own effect on
the loss would get.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f} s] {msg}", flush=True)


def kind_of(name: str) -> str:
    return re.sub(r"\.(weight|bias)$", "", re.sub(r"^encoder\.layer\.\d+\.", "", name))


def layer_of(name: str) -> str:
    m = re.match(r"^encoder\.layer\.(\d+)\.", name)
    return f"layer.{m.group(1)}" if m else name.split(".")[0]


def ablate(data: Path, variant: str, weight: float, work: Path) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    from benchmarks.minilm.family import DOMAINS, heldout_losses

    base = load_file(str(data / variant / "base" / "model.safetensors"))
    floats = [n for n, t in base.items() if t.is_floating_point()]
    deltas = {n: torch.zeros_like(base[n], dtype=torch.float32) for n in floats}
    delta_bytes = dict.fromkeys(floats, 0)
    for d in DOMAINS:
        expert = load_file(str(data / variant / d / "model.safetensors"))
        for n in floats:
            diff = expert[n].float() - base[n].float()
            deltas[n] += weight * diff
            delta_bytes[n] += expert[n].numel() * expert[n].element_size() if bool(diff.any()) else 0
    total = sum(delta_bytes.values())

    def score(left_out: set[str]) -> dict[str, float]:
        out = work / f"{variant}-merged"
        out.mkdir(parents=True, exist_ok=True)
        merged = {
            n: (t.float() + (0 if n in left_out or n not in deltas else deltas[n])).to(t.dtype) for n, t in base.items()
        }
        save_file(merged, str(out / "model.safetensors"))
        return heldout_losses(data, out, variant)

    full = score(set())
    rows = []
    for label, group in (("kind", kind_of), ("layer", layer_of)):
        for value in sorted({group(n) for n in floats if delta_bytes[n]}):
            names = {n for n in floats if group(n) == value}
            loss = score(names)
            increase = {d: loss[d] / full[d] - 1 for d in DOMAINS}
            rows.append(
                {
                    "by": label,
                    "left_out": value,
                    "delta_bytes_share": sum(delta_bytes[n] for n in names) / total,
                    "loss_increase": increase,
                    "worst": max(increase.values()),
                }
            )
            say(
                f"{variant} without {label} {value}: {100 * rows[-1]['delta_bytes_share']:.1f}% of the bytes, worst {100 * rows[-1]['worst']:+.2f}%"
            )
    return {"variant": variant, "full_loss": full, "delta_bytes": total, "domains": list(DOMAINS), "rows": rows}


def oracle(data: Path, variant: str, weight: float, catalog: str, budgets: list[str], work: Path) -> dict:
    """The loss itself as the ranking: each (expert, weight block) of the encoder left out of the
    full merge alone, its mean loss increase over the domains taken as its value; the base's
    small tensors (norms, biases) first, the embeddings and pooler last. Stored as a calibration
    of the base in `catalog` (the calibration bench's, which has the family indexed), then
    merged by mergepipe at each budget and scored: how far a ranking that knew each block's
    effect on the loss, one block at a time, would get."""
    import numpy as np
    import pyarrow as pa
    import yaml
    from safetensors.torch import load_file, save_file

    from benchmarks.minilm.family import DOMAINS, heldout_losses
    from mergepipe.catalog import calibration, db
    from mergepipe.catalog.calibration import CalibrationRow
    from mergepipe.config.environment import parse_catalog
    from mergepipe.flows.merge import merge
    from mergepipe.flows.orchestration import run_flow
    from mergepipe.storage.canonical import sha256_hex

    base_dir = data / variant / "base"
    base = load_file(str(base_dir / "model.safetensors"))
    experts = {d: load_file(str(data / variant / d / "model.safetensors")) for d in DOMAINS}
    location = parse_catalog(catalog)
    with db.connect(location) as con:
        fps = dict(con.execute("SELECT uri, model_fp FROM models").fetchall())
        base_fp = fps[str(base_dir)]
        blocks = con.execute(
            "SELECT tensor, block, row_start, row_end FROM blocks WHERE base_fp = ? AND block_size = ? ORDER BY ALL",
            [base_fp, 1 << 20],
        ).fetchall()
    full = {
        n: t.float() + sum(weight * (experts[d][n].float() - t.float()) for d in DOMAINS)
        for n, t in base.items()
        if t.is_floating_point()
    }
    out = work / f"{variant}-oracle"
    out.mkdir(parents=True, exist_ok=True)

    def score(merged: dict) -> dict[str, float]:
        save_file({n: merged.get(n, t) for n, t in base.items()}, str(out / "model.safetensors"))
        return heldout_losses(data, out, variant)

    reference = score(full)
    values = []
    measured = [(t, b, r0, r1) for t, b, r0, r1 in blocks if t.startswith("encoder.") and base[t].ndim == 2]
    for i, d in enumerate(DOMAINS):
        for j, (tensor, block, r0, r1) in enumerate(measured):
            merged = dict(full)
            part = merged[tensor].clone()
            part[r0:r1] -= weight * (experts[d][tensor][r0:r1].float() - base[tensor][r0:r1].float())
            merged[tensor] = part
            loss = score(merged)
            value = float(np.mean([loss[k] / reference[k] - 1 for k in DOMAINS]))
            values.append((fps[str(data / variant / d)], tensor, block, value))
            if j % 20 == 0:
                say(f"oracle {variant}: {d} block {j + 1}/{len(measured)}: {tensor}[{r0}:{r1}] {100 * value:+.3f}%")
    known = {(fp, t, b) for fp, t, b, _ in values}
    rows = []
    for d in DOMAINS:
        fp = fps[str(data / variant / d)]
        for tensor, block, _, _ in blocks:
            if (fp, tensor, block) in known:
                continue
            small = tensor.startswith("encoder.") and base[tensor].ndim == 1
            rows.append((fp, tensor, block, 1.0 if small else 0.0))  # norms and biases first, embeddings last
    rows += [(fp, t, b, max(v, 0.0) ** 2) for fp, t, b, v in values]  # act_sq: the planner ranks by its root
    digest = sha256_hex(f"calibration-ablation oracle {variant}".encode())
    table = pa.table(
        {
            "expert_fp": [r[0] for r in rows],
            "tensor": [r[1] for r in rows],
            "block": pa.array([r[2] for r in rows], pa.int32()),
            "act_sq": [r[3] for r in rows],
        }
    )
    with db.connect(location) as con:
        calibration.store_calibration(con, CalibrationRow(base_fp, digest, "bench:oracle", 0, 0, 0, "cpu", 0.0), {})
        fps_all = sorted({r[0] for r in rows})
        calibration.ingest_activation(con, base_fp, 1 << 20, digest, fps_all, table)
    cfg = work / f"{variant}-oracle.yml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "merge_method": "task_arithmetic",
                "base_model": str(base_dir),
                "block_size": "1MiB",
                "rank_by": "activation",
                "calibration": digest,
                "models": [{"model": str(data / variant / d), "parameters": {"weight": weight}} for d in DOMAINS],
            },
            sort_keys=False,
        )
    )
    results = []
    merged_full = run_flow(
        merge, config=str(cfg), out=str(work / "o-full"), budget="100%", catalog=catalog, overwrite=True
    )
    full_loss = heldout_losses(data, work / "o-full", variant)
    for budget in budgets:
        target = work / f"o-{budget.rstrip('%')}"
        r = run_flow(merge, config=str(cfg), out=str(target), budget=budget, catalog=catalog, overwrite=True)
        loss = heldout_losses(data, target, variant)
        increase = {k: loss[k] / full_loss[k] - 1 for k in DOMAINS}
        results.append(
            {
                "budget": budget,
                "loss_increase": increase,
                "worst": max(increase.values()),
                "expert_bytes_read": r["expert_bytes_read"],
            }
        )
        say(
            f"oracle {variant} {budget}: worst {100 * results[-1]['worst']:+.2f}% "
            + " ".join(f"{k} {100 * x:+.2f}%" for k, x in increase.items())
        )
        shutil.rmtree(target, ignore_errors=True)
    del merged_full
    return {
        "variant": variant,
        "measured_blocks": len(values),
        "values": values,
        "rows": results,
        "domains": list(DOMAINS),
    }


def markdown(results: list[dict]) -> str:
    out = []
    for res in results:
        out += [
            f"### MiniLM {res['variant']}: one part of the delta left out, the rest merged",
            "",
            "| left out | share of delta bytes | " + " | ".join(res["domains"]) + " | worst |",
            "|---" * (len(res["domains"]) + 3) + "|",
        ]
        for r in res["rows"]:
            out.append(
                f"| {r['by']} `{r['left_out']}` | {100 * r['delta_bytes_share']:.1f}% | "
                + " | ".join(f"{100 * r['loss_increase'][d]:+.2f}%" for d in res["domains"])
                + f" | {100 * r['worst']:+.2f}% |"
            )
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minilm", type=Path, required=True, help="the MiniLM family (family.py build --out)")
    ap.add_argument("--variants", default="untied,tied")
    ap.add_argument("--weight", type=float, default=0.25)
    ap.add_argument("--oracle", default=None, help="VARIANT=CATALOG: rank by the loss itself in the bench's catalog")
    ap.add_argument("--budgets", default="10%,25%,50%")
    ap.add_argument("--results", type=Path, required=True)
    args = ap.parse_args()
    scratch = Path("/dev/shm") if Path("/dev/shm").is_dir() else None  # hundreds of 90 MB writes
    work = Path(tempfile.mkdtemp(prefix="calibration-ablation-", dir=scratch))
    args.results.mkdir(parents=True, exist_ok=True)
    try:
        if args.oracle:
            variant, catalog = args.oracle.split("=", 1)
            found = oracle(args.minilm, variant, args.weight, catalog, args.budgets.split(","), work)
            (args.results / f"minilm_oracle_{variant}.json").write_text(json.dumps(found, indent=1))
            return
        results = [ablate(args.minilm, v, args.weight, work) for v in args.variants.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (args.results / "minilm_ablation.json").write_text(json.dumps(results, indent=1))
    (args.results / "minilm_ablation.md").write_text(markdown(results))
    say(f"results in {args.results}/minilm_ablation.{{json,md}}")


if __name__ == "__main__":
    main()
