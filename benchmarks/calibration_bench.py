"""Calibrated access sets (`rank_by: activation`) against the data-free rankings: held-out loss
per domain at several budgets, on the MiniLM family (both decoder variants) and a small Llama
causal-LM family, with calibration texts disjoint from the held-out ones.

    .venv/bin/python -m benchmarks.calibration_bench --minilm /work/bench-data/minilm --llama \\
        --results benchmarks/results/calibration

For each family (and MiniLM variant), in a fresh catalog, in this process (no Prefect API):
`index`, then `calibrate` (its seconds; it reads the base's files once), then a plan ranked by
activation (the first weighs the experts indexed before the calibration: one more pass, timed),
then task_arithmetic merges at each budget under each ranking (`delta`,
`delta_over_sqrt_base`, `activation`) and at 100%, each scored per domain on held-out texts.
Reported per row: the loss against the full merge's per domain, the worst domain, the expert
bytes read, the error bound and, for the activation ranking, the predicted output energy it
leaves out.

- MiniLM (benchmarks/minilm/family.py `build --out DIR` first): the base all-MiniLM-L6-v2 and four
  masked-LM fine-tunes; weights 0.25, the default 1 MiB blocks, as in the earlier tables
  (docs/benchmarks.md). Held-out: the family's fixed masked blocks and frozen head. Calibration:
  --minilm-texts training blocks per domain (never held out), decoded to text.
- Llama (--llama): benchmarks/search_bench.py's family (hidden 512, 4 layers, six domains, K = 6
  SGD fine-tunes), made under --work; weights 1/6, 128 KiB blocks. Held-out: 24 texts per domain
  (seeds of their own), mean token loss by mergepipe's built-in evaluator. Calibration:
  --llama-texts texts of the six domains mixed, other seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("MERGEPIPE_ORCHESTRATION", "local")

import yaml  # noqa: E402

RANKINGS = ("delta", "delta_over_sqrt_base", "activation")
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f} s] {msg}", flush=True)


def run(flow, **params) -> dict:
    from mergepipe.flows.orchestration import run_flow

    return run_flow(flow, **params)


def write_jsonl(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


class Subject:
    """One family to merge: its models, config values, how to score an output, calibration texts."""

    def __init__(self, label, base, experts, weight, block_size, score, calib, domains):
        self.label, self.base, self.experts, self.weight = label, base, experts, weight
        self.block_size, self.score, self.calib, self.domains = block_size, score, calib, domains


def minilm_subjects(data: Path, variants: list[str], texts_per_domain: int, work: Path) -> list[Subject]:
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from benchmarks.minilm.family import DOMAINS, heldout_losses

    blocks = load_file(str(data / ".cache" / "blocks.safetensors"))
    out = []
    for v in variants:
        base = data / v / "base"
        tok = Tokenizer.from_file(str(base / "tokenizer.json"))
        texts = []
        for d in DOMAINS:
            train = blocks[f"{d}.train"]
            step = max(1, train.shape[0] // texts_per_domain)
            for row in train[::step][:texts_per_domain]:
                texts.append(tok.decode(row.tolist(), skip_special_tokens=True))
        calib = write_jsonl(work / f"minilm-{v}-calib.jsonl", texts)
        out.append(
            Subject(
                f"minilm-{v}",
                str(base),
                [str(data / v / d) for d in DOMAINS],
                0.25,
                "1MiB",
                lambda folder, v=v: heldout_losses(data, folder, v),
                calib,
                list(DOMAINS),
            )
        )
    return out


def llama_subject(work: Path, texts: int) -> Subject:
    from benchmarks import search_bench as sb
    from mergepipe.config.search import PerplexityEvaluation
    from mergepipe.evaluate.perplexity import mean_loss

    args = argparse.Namespace(
        experts=6,
        layers=4,
        hidden=512,
        intermediate=1536,
        heads=8,
        base_steps=100,
        expert_steps=30,
        base_lr=1e-3,
        expert_optimizer="sgd",
        expert_lr=0.02,
        eval_texts=48,
        block_size="128KiB",
        seed=0,
    )
    made = work / "llama-family" / "family.json"
    if made.exists():  # a kept --work folder's
        fam = json.loads(made.read_text())
    else:
        t = time.perf_counter()
        fam = sb.make_family(work / "llama-family", args)
        made.write_text(json.dumps(fam))
        say(f"llama family made in {time.perf_counter() - t:.1f} s ({fam['model_bytes'] / 1e6:.1f} MB per model)")
    held = {}
    for i, d in enumerate(sb.ALL_DOMAINS):
        rng = random.Random(30_000 + i)
        held[d] = write_jsonl(work / f"llama-heldout-{d}.jsonl", [sb.ALL_DOMAINS[d](rng) for _ in range(24)])
    rng = random.Random(40_000)
    names = list(sb.ALL_DOMAINS)
    calib = write_jsonl(work / "llama-calib.jsonl", [sb.ALL_DOMAINS[rng.choice(names)](rng) for _ in range(texts)])

    def score(folder: str) -> dict[str, float]:
        out = {}
        for d, path in held.items():
            s = mean_loss(PerplexityEvaluation(data=path, max_length=64), folder)
            if s.error:
                raise RuntimeError(s.error)
            out[d] = s.score
        return out

    return Subject("llama", fam["base"], fam["experts"], round(1 / 6, 6), "128KiB", score, calib, names)


def bench(s: Subject, budgets: list[str], work: Path) -> dict:
    from mergepipe.flows.calibrate import calibrate
    from mergepipe.flows.index_family import index_family
    from mergepipe.flows.merge import merge, plan

    folder = work / "runs" / s.label
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    catalog = str(folder / "catalog.duckdb")
    cfg = folder / "merge.yml"
    doc = {
        "merge_method": "task_arithmetic",
        "base_model": s.base,
        "block_size": s.block_size,
        "models": [{"model": e, "parameters": {"weight": s.weight}} for e in s.experts],
    }
    cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
    t = time.perf_counter()
    run(index_family, config=str(cfg), catalog=catalog)
    index_s = time.perf_counter() - t
    t = time.perf_counter()
    made = run(calibrate, config=str(cfg), data=s.calib, catalog=catalog)
    calibrate_s = time.perf_counter() - t
    base_bytes = sum(p.stat().st_size for p in Path(s.base).glob("*.safetensors"))
    say(
        f"{s.label}: indexed in {index_s:.1f} s; calibrated in {calibrate_s:.1f} s ({made['seconds']:.1f} s running "
        f"the base over {made['texts']} texts, {made['tokens']} tokens; {made['tensors']})"
    )
    t = time.perf_counter()
    run(plan, config=str(cfg), budget="25%", catalog=catalog, rank_by="activation")
    weigh_s = time.perf_counter() - t
    t = time.perf_counter()
    run(plan, config=str(cfg), budget="25%", catalog=catalog, rank_by="activation")
    plan_s = time.perf_counter() - t
    say(f"{s.label}: first activation plan {weigh_s:.1f} s (weighing the experts), the next {plan_s:.1f} s")

    def merged(budget: str, ranking: str) -> tuple[dict, dict]:
        out = str(folder / f"out-{ranking}-{budget.rstrip('%')}")
        r = run(merge, config=str(cfg), out=out, budget=budget, catalog=catalog, rank_by=ranking, overwrite=True)
        losses = s.score(out)
        shutil.rmtree(out, ignore_errors=True)
        return r, losses

    full, full_loss = merged("100%", "delta")
    rows = []
    for budget in budgets:
        for ranking in RANKINGS:
            r, loss = merged(budget, ranking)
            increase = {d: loss[d] / full_loss[d] - 1 for d in s.domains}
            rows.append(
                {
                    "budget": budget,
                    "ranking": ranking,
                    "loss_increase": increase,
                    "worst": max(increase.values()),
                    "expert_bytes_read": r["expert_bytes_read"],
                    "budget_bytes": r["budget_bytes"],
                    "error_bound": r["error_bound"],
                    "omitted_output_energy": r["ranking"].get("omitted_output_energy"),
                }
            )
            say(
                f"{s.label} {budget} {ranking}: worst {100 * rows[-1]['worst']:+.2f}% "
                + " ".join(f"{d} {100 * x:+.2f}%" for d, x in increase.items())
            )
    return {
        "label": s.label,
        "domains": s.domains,
        "full_loss": full_loss,
        "full_expert_bytes": full["full_expert_bytes"],
        "index_seconds": index_s,
        "calibration": {
            "seconds_total": calibrate_s,
            "seconds_running_the_base": made["seconds"],
            "texts": made["texts"],
            "tokens": made["tokens"],
            "base_bytes_read": base_bytes,
            "tensors": made["tensors"],
            "first_activation_plan_seconds": weigh_s,
            "next_plan_seconds": plan_s,
        },
        "rows": rows,
    }


def markdown(results: list[dict]) -> str:
    out = []
    for res in results:
        c = res["calibration"]
        out += [
            f"### {res['label']}, task_arithmetic",
            "",
            f"Calibration: {c['texts']} texts, {c['tokens']} tokens, {c['seconds_running_the_base']:.1f} s running "
            f"the base ({c['seconds_total']:.1f} s in all; the base's {c['base_bytes_read'] / 1e6:.1f} MB read once); "
            f"the first activation plan, which weighs the experts indexed before it, {c['first_activation_plan_seconds']:.1f} s "
            f"(the next {c['next_plan_seconds']:.1f} s; the index pass took {res['index_seconds']:.1f} s).",
            "",
            "| budget | ranking | " + " | ".join(res["domains"]) + " | worst | bound | omitted output energy |",
            "|---" * (len(res["domains"]) + 5) + "|",
        ]
        for r in res["rows"]:
            energy = r["omitted_output_energy"]
            out.append(
                f"| {r['budget']} | {r['ranking']} | "
                + " | ".join(f"{100 * r['loss_increase'][d]:+.2f}%" for d in res["domains"])
                + f" | {100 * r['worst']:+.2f}% | {r['error_bound']:.4g} | {'' if energy is None else f'{energy:.4g}'} |"
            )
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minilm", type=Path, default=None, help="the MiniLM family (family.py build --out)")
    ap.add_argument("--variants", default="untied,tied")
    ap.add_argument("--minilm-texts", type=int, default=16, help="calibration texts per MiniLM domain")
    ap.add_argument("--llama", action="store_true", help="also the Llama family (made under --work)")
    ap.add_argument("--llama-texts", type=int, default=96, help="calibration texts of the Llama family")
    ap.add_argument("--budgets", default="10%,25%,50%")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--results", type=Path, required=True)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="calibration-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    subjects = []
    if args.llama:
        subjects.append(llama_subject(work, args.llama_texts))
    if args.minilm:
        subjects += minilm_subjects(args.minilm, args.variants.split(","), args.minilm_texts, work)
    budgets = args.budgets.split(",")
    results = []
    args.results.mkdir(parents=True, exist_ok=True)
    for s in subjects:
        results.append(bench(s, budgets, work))
        (args.results / "results.json").write_text(json.dumps(results, indent=1))
        (args.results / "results.md").write_text(markdown(results))
    say(f"results in {args.results}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
