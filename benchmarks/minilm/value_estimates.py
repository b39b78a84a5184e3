"""Which value estimate per block should the planner rank by? An experiment on the MiniLM family.

The planner ranks (expert, block) pairs by |c_k|·‖Δ_kb‖ per byte and fills the budget greedily.
This script replays that plan in memory for task_arithmetic with other value estimates, merges,
and scores the held-out masked-LM loss per domain against the full merge. Nothing here runs the
pipeline: the point is to compare rankings cheaply before changing the planner.

    .venv/bin/python -m benchmarks.minilm.value_estimates --data /work/bench-data/minilm \
        --results benchmarks/results/minilm
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from safetensors.torch import load_file, save_file

from benchmarks.minilm.family import DOMAINS, heldout_losses
from mergepipe.index.blocks import block_rows

BLOCK_SIZE = 1 << 20  # mergepipe's default
WEIGHT = 0.25  # the benchmark configs' task_arithmetic weight for each of the four experts


class Pair(NamedTuple):
    expert: int
    tensor: str
    r0: int
    r1: int
    bytes: int
    score: float  # |c_k|·‖Δ_kb‖, the planner's score
    base_norm: float  # ‖θ₀_b‖: not in the catalog today


def candidates(base: dict, experts: list[dict]) -> tuple[list[Pair], int]:
    """Every (expert, block) pair with a nonzero delta, and the full expert bytes (all tensors, as
    the planner counts them)."""
    out, full = [], 0
    for name, b in sorted(base.items()):
        full += b.numel() * b.element_size() * len(experts)
        if not b.is_floating_point():
            continue
        for r0, r1 in block_rows(tuple(b.shape), b.element_size(), BLOCK_SIZE):
            bb = (b[r0:r1] if b.dim() else b).double()
            base_norm = float(bb.norm())
            for k, e in enumerate(experts):
                d = (e[name][r0:r1] if b.dim() else e[name]).double() - bb
                if bool((d != 0).any()):
                    out.append(
                        Pair(k, name, r0, r1, bb.numel() * b.element_size(), WEIGHT * float(d.norm()), base_norm)
                    )
    return out, full


def bound_gains(pairs: list[Pair]) -> dict[Pair, float]:
    """How much reading each pair lowers the squared bound Σ_b (Σ_k omitted score)², reading a
    block's experts in descending score. The gains fall within a block, so a global sort by gain
    per byte keeps each block's order and is the greedy for the bound itself."""
    by_block = defaultdict(list)
    for p in pairs:
        by_block[(p.tensor, p.r0)].append(p)
    gains = {}
    for ps in by_block.values():
        rest = sum(p.score for p in ps)
        for p in sorted(ps, key=lambda p: (-p.score, p.expert)):
            gains[p] = rest * rest - (rest - p.score) ** 2
            rest -= p.score
    return gains


def estimates(pairs: list[Pair]) -> dict[str, Callable[[Pair], float]]:
    gains = bound_gains(pairs)
    density = defaultdict(lambda: [0.0, 0])  # per (expert, tensor): delta energy and bytes
    for p in pairs:
        density[(p.expert, p.tensor)][0] += p.score**2
        density[(p.expert, p.tensor)][1] += p.bytes

    def rms(p: Pair) -> float:
        energy, nbytes = density[(p.expert, p.tensor)]
        return math.sqrt(energy / nbytes)

    return {
        "norm per byte (mergepipe)": lambda p: p.score / p.bytes,
        "energy per byte": lambda p: p.score**2 / p.bytes,
        "bound gain per byte": lambda p: gains[p] / p.bytes,
        "norm over tensor RMS": lambda p: p.score / math.sqrt(p.bytes) / rms(p) / p.bytes,
        "relative ‖Δ‖/‖θ₀‖ per byte": lambda p: p.score / max(p.base_norm, 1e-30) / p.bytes,
        "‖Δ‖/√‖θ₀‖ per byte": lambda p: p.score / math.sqrt(max(p.base_norm, 1e-30)) / p.bytes,
    }


def greedy(pairs: list[Pair], value: Callable[[Pair], float], budget: int) -> list[Pair]:
    """The planner's fill: walk the ranking (ties by expert, tensor, block) and take what fits."""
    chosen, left = [], budget
    for p in sorted(pairs, key=lambda p: (-value(p), p.expert, p.tensor, p.r0)):
        if p.bytes <= left:
            chosen.append(p)
            left -= p.bytes
    return chosen


def merge(base: dict, experts: list[dict], chosen: list[Pair]) -> dict:
    acc = {n: torch.zeros(t.shape, dtype=torch.float64) for n, t in base.items() if t.is_floating_point()}
    for p in chosen:
        b, e = base[p.tensor], experts[p.expert][p.tensor]
        rows = slice(p.r0, p.r1) if b.dim() else slice(None)
        acc[p.tensor][rows] += WEIGHT * (e[rows].double() - b[rows].double())
    return {n: ((t.double() + acc[n]).to(t.dtype) if n in acc else t) for n, t in base.items()}


def run(data: Path, variant: str, budgets: list[float]) -> dict:
    base = load_file(str(data / variant / "base" / "model.safetensors"))
    experts = [load_file(str(data / variant / d / "model.safetensors")) for d in DOMAINS]
    pairs, full = candidates(base, experts)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model.safetensors")

        def losses(model: dict) -> dict[str, float]:
            save_file(model, path)
            return heldout_losses(data, path, variant)

        full_model = merge(base, experts, pairs)
        full_loss = losses(full_model)
        full_norm = math.sqrt(
            sum(float(t.double().square().sum()) for t in full_model.values() if t.is_floating_point())
        )
        rows = []
        for name, value in estimates(pairs).items():
            for frac in budgets:
                chosen = greedy(pairs, value, int(full * frac))
                model = merge(base, experts, chosen)
                loss = losses(model)
                dev = math.sqrt(
                    sum(
                        float((model[n].double() - full_model[n].double()).square().sum())
                        for n in model
                        if model[n].is_floating_point()
                    )
                )
                emb = sum(p.bytes for p in chosen if "word_embeddings" in p.tensor)
                rows.append(
                    {
                        "estimate": name,
                        "budget": frac,
                        "read_bytes": sum(p.bytes for p in chosen),
                        "embedding_bytes": emb,
                        "relative_to_full": dev / full_norm,
                        "loss_increase": {d: loss[d] / full_loss[d] - 1 for d in DOMAINS},
                    }
                )
                print(table_row(rows[-1]), flush=True)
    return {"variant": variant, "full_expert_bytes": full, "full_loss": full_loss, "rows": rows}


def table_row(r: dict) -> str:
    cells = [r["estimate"], f"{r['budget']:.0%}"] + [f"{100 * r['loss_increase'][d]:+.2f}%" for d in DOMAINS]
    cells += [
        f"{max(r['loss_increase'].values()) * 100:+.2f}%",
        f"{r['relative_to_full']:.2e}",
        f"{r['embedding_bytes'] / r['read_bytes']:.0%}",
    ]
    return "| " + " | ".join(cells) + " |"


def markdown(results: list[dict]) -> str:
    out = []
    for res in results:
        out += [
            f"### {res['variant']} decoder, task_arithmetic",
            "",
            "| value estimate | budget | "
            + " | ".join(DOMAINS)
            + " | worst | ‖θ̂−θ_full‖/‖θ_full‖ | embedding share of reads |",
            "|---" * (len(DOMAINS) + 5) + "|",
        ]
        out += [table_row(r) for r in res["rows"]] + [""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data", type=Path, required=True, help="the MiniLM family (benchmarks/minilm/family.py build --out)"
    )
    ap.add_argument("--results", type=Path, required=True)
    ap.add_argument("--variants", default="untied,tied")
    ap.add_argument("--budgets", default="0.1,0.25,0.5")
    a = ap.parse_args(argv)
    budgets = [float(b) for b in a.budgets.split(",")]
    results = [run(a.data, v, budgets) for v in a.variants.split(",")]
    a.results.mkdir(parents=True, exist_ok=True)
    (a.results / "value-estimates.json").write_text(json.dumps(results, indent=1))
    (a.results / "value-estimates.md").write_text(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
