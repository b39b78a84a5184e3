"""Calibrated access sets (`rank_by: activation`) against the data-free rankings: held-out loss
per domain at several budgets, on the MiniLM family (both decoder variants) and a small Llama
causal-LM family, with calibration texts disjoint from the held-out ones.

    .venv/bin/python -m benchmarks.calibration_bench --minilm /work/bench-data/minilm --llama \\
        --results benchmarks/results/calibration

For each family (and MiniLM variant), in a fresh catalog, in this process (no Prefect API):
`index`, then `calibrate` twice, plain and with --gradients (its seconds; it reads the base's
files once), each followed by a plan ranked by activation under it (the first weighs the experts
indexed before the calibration: one more pass, timed), then task_arithmetic merges at each
budget under each ranking (`delta`, `delta_over_sqrt_base`, `activation` under the plain
calibration, `activation+gradients` under the other; for MiniLM also `activation+masked-loss`,
a calibration this benchmark makes with the family's own masked-LM loss through its frozen head)
and at 100%, each scored per domain on held-out texts.
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

# (label, rank_by, which calibration): `activation+gradients` ranks by activation under the
# calibration made with --gradients.
RANKINGS = (
    ("delta", "delta", None),
    ("delta_over_sqrt_base", "delta_over_sqrt_base", None),
    ("activation", "activation", "plain"),
    ("activation+gradients", "activation", "gradients"),
)
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
    """One family to merge: its models, config values, how to score an output, calibration texts,
    and optionally calibrations made here rather than by `mergepipe calibrate` (`extra(catalog,
    base_fp) -> {label: digest}`, each ranked as `activation` under that calibration)."""

    def __init__(self, label, base, experts, weight, block_size, score, calib, domains, extra=None):
        self.label, self.base, self.experts, self.weight = label, base, experts, weight
        self.block_size, self.score, self.calib, self.domains = block_size, score, calib, domains
        self.extra = extra


def minilm_subjects(data: Path, variants: list[str], texts_per_domain: int, work: Path) -> list[Subject]:
    import torch
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
        rows = torch.cat(
            [
                blocks[f"{d}.train"][:: max(1, blocks[f"{d}.train"].shape[0] // texts_per_domain)][:texts_per_domain]
                for d in DOMAINS
            ]
        )
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
                extra=lambda catalog, base_fp, v=v, rows=rows: masked_loss_calibration(data, v, rows, catalog, base_fp),
            )
        )
    return out


def masked_loss_calibration(data: Path, variant: str, rows, catalog: str, base_fp: str) -> dict[str, str]:
    """An estimate `mergepipe calibrate` cannot make for this base, whose files hold no head: the
    gradients of the family's own masked-LM loss, through its frozen head (and, in the tied
    variant, the decoder that is the word embedding), on the calibration blocks masked as in
    training (seed 0). Stored as a calibration of the base, so plans rank by it as by any other."""
    import torch
    from safetensors.torch import load_file

    from benchmarks.minilm import family as fm
    from mergepipe.catalog import calibration, db
    from mergepipe.catalog.calibration import CalibrationRow
    from mergepipe.config.environment import parse_catalog
    from mergepipe.evaluate.calibrate import gather_statistics
    from mergepipe.storage.canonical import sha256_hex

    base_dir = data / variant / "base"
    model = fm._new_model(base_dir / "config.json")
    base = {k: t.float() for k, t in load_file(str(base_dir / "model.safetensors")).items()}
    fm._load_encoder(model, base, str(base_dir))
    fm._load_head(model, load_file(str(data / "mlm_head.safetensors")))
    if variant == "untied":  # the decoder is the base's embedding, frozen: no tensor of the merge
        model.cls.predictions.decoder.weight = torch.nn.Parameter(base["embeddings.word_embeddings.weight"].clone())
    assert (model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight) == (variant == "tied")
    from tokenizers import Tokenizer

    ids = fm._special_ids(Tokenizer.from_file(str(base_dir / "tokenizer.json")))
    x, labels = fm.mask_blocks(rows, torch.Generator().manual_seed(0), model.config.vocab_size, ids["mask"])
    inputs = [(x[i : i + 1], {"labels": labels[i : i + 1]}) for i in range(x.shape[0])]

    def objective(out, _ids, kwargs):
        scored = kwargs["labels"] != -100
        return torch.nn.functional.cross_entropy(out.logits[scored].float(), kwargs["labels"][scored], reduction="sum")

    cal = gather_statistics(model, inputs, list(base), objective, "masked-LM loss")
    digest = sha256_hex(f"calibration-bench masked-LM loss {variant}".encode())
    row = CalibrationRow(
        base_fp, digest, "bench:masked-lm-loss", cal.texts, cal.tokens, rows.shape[1], "cpu", cal.seconds, True
    )
    with db.connect(parse_catalog(catalog)) as con:
        calibration.store_calibration(con, row, cal.tensor_weights())
    say(
        f"minilm-{variant}: masked-LM loss calibration in {cal.seconds:.1f} s ({len(cal.output_moments)} linear weights)"
    )
    return {"activation+masked-loss": digest}


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
    doc = {
        "merge_method": "task_arithmetic",
        "base_model": s.base,
        "block_size": s.block_size,
        "models": [{"model": e, "parameters": {"weight": s.weight}} for e in s.experts],
    }

    def config(name: str, **extra) -> str:
        path = folder / f"{name}.yml"
        path.write_text(yaml.safe_dump({**doc, **extra}, sort_keys=False))
        return str(path)

    cfg = config("merge")
    t = time.perf_counter()
    run(index_family, config=cfg, catalog=catalog)
    index_s = time.perf_counter() - t
    base_bytes = sum(p.stat().st_size for p in Path(s.base).glob("*.safetensors"))
    made, configs, timing, labels = {}, {}, {}, []
    for kind in ("plain", "gradients"):
        t = time.perf_counter()
        made[kind] = run(calibrate, config=cfg, data=s.calib, catalog=catalog, gradients=kind == "gradients")
        took = time.perf_counter() - t
        configs[kind] = config(kind, rank_by="activation", calibration=made[kind]["data_digest"])
        say(
            f"{s.label}: calibrated ({kind}) in {took:.1f} s ({made[kind]['seconds']:.1f} s running the base over "
            f"{made[kind]['texts']} texts, {made[kind]['tokens']} tokens; {made[kind]['tensors']})"
        )
        t = time.perf_counter()
        run(plan, config=configs[kind], budget="25%", catalog=catalog)
        weigh_s = time.perf_counter() - t
        t = time.perf_counter()
        run(plan, config=configs[kind], budget="25%", catalog=catalog)
        plan_s = time.perf_counter() - t
        say(
            f"{s.label}: first activation plan ({kind}) {weigh_s:.1f} s (weighing the experts), the next {plan_s:.1f} s"
        )
        timing[kind] = {
            "seconds_total": took,
            "seconds_running_the_base": made[kind]["seconds"],
            "texts": made[kind]["texts"],
            "tokens": made[kind]["tokens"],
            "base_bytes_read": base_bytes,
            "tensors": made[kind]["tensors"],
            "objective": made[kind].get("objective"),
            "first_activation_plan_seconds": weigh_s,
            "next_plan_seconds": plan_s,
        }

    if s.extra is not None:
        for label, digest in s.extra(catalog, made["plain"]["base_fp"]).items():
            configs[label] = config(label.replace("+", "-"), rank_by="activation", calibration=digest)
            labels.append((label, "activation", label))

    def merged(budget: str, label: str, ranking: str, calibration: str | None) -> tuple[dict, dict]:
        out = str(folder / f"out-{label}-{budget.rstrip('%')}")
        path = configs[calibration] if calibration else cfg
        r = run(merge, config=path, out=out, budget=budget, catalog=catalog, rank_by=ranking, overwrite=True)
        losses = s.score(out)
        shutil.rmtree(out, ignore_errors=True)
        return r, losses

    full, full_loss = merged("100%", "delta", "delta", None)
    rows = []
    for budget in budgets:
        for label, ranking, calibration in [*RANKINGS, *labels]:
            r, loss = merged(budget, label, ranking, calibration)
            increase = {d: loss[d] / full_loss[d] - 1 for d in s.domains}
            rows.append(
                {
                    "budget": budget,
                    "ranking": label,
                    "loss_increase": increase,
                    "worst": max(increase.values()),
                    "expert_bytes_read": r["expert_bytes_read"],
                    "budget_bytes": r["budget_bytes"],
                    "error_bound": r["error_bound"],
                    "omitted_output_energy": r["ranking"].get("omitted_output_energy"),
                }
            )
            say(
                f"{s.label} {budget} {label}: worst {100 * rows[-1]['worst']:+.2f}% "
                + " ".join(f"{d} {100 * x:+.2f}%" for d, x in increase.items())
            )
    return {
        "label": s.label,
        "domains": s.domains,
        "full_loss": full_loss,
        "full_expert_bytes": full["full_expert_bytes"],
        "index_seconds": index_s,
        "calibration": timing,
        "rows": rows,
    }


def markdown(results: list[dict]) -> str:
    out = []
    for res in results:
        out += [f"### {res['label']}, task_arithmetic", ""]
        for kind, c in res["calibration"].items():
            out += [
                f"Calibration ({kind}{', ' + c['objective'] if c.get('objective') else ''}): {c['texts']} texts, "
                f"{c['tokens']} tokens, {c['seconds_running_the_base']:.1f} s running the base "
                f"({c['seconds_total']:.1f} s in all; the base's {c['base_bytes_read'] / 1e6:.1f} MB read once); the first "
                f"activation plan, which weighs the experts, {c['first_activation_plan_seconds']:.1f} s (the next "
                f"{c['next_plan_seconds']:.1f} s; the index pass took {res['index_seconds']:.1f} s).",
                "",
            ]
        out += [
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
