"""Merge search (`mergepipe search`): 10%-budget trials against the same search with every trial at 100%.

    .venv/bin/python benchmarks/search_bench.py                          # K = 6, ~55 MB per model, 100 MB/s
    .venv/bin/python benchmarks/search_bench.py --trials 20 --local-trials 10 --deadline-min 30

The family: a small Llama causal LM (transformers' LlamaConfig; by default hidden 512,
intermediate 1536, 4 layers, 8 heads: 13.7 M parameters, 55 MB in float32) with the word-level
tokenizer of the tests' tiny family (tests/llama_family.py). A base trained 100 steps (AdamW,
1e-3) on six synthetic text domains at once, then K experts, each the base trained 30 steps
further on one domain (the tests' numbers and animals, and four more here from the same words:
counting down, each animal's colour, the animals' order, runs of colours). The experts are
trained with plain SGD (lr 0.02): their deltas concentrate in few blocks, as real fine-tunes'
do (docs/benchmarks.md, all-MiniLM-L6-v2: a 10% plan keeps the loss within a few percent);
a few AdamW steps move every weight by about the same amount, and a 10% plan then captures
little of any delta (--expert-optimizer adamw --expert-lr 1e-4 builds such a family). The
share of each expert's delta energy in its top 10% of blocks is reported. The search scores a
candidate by the built-in evaluator (`perplexity`: mean token loss, max_length 64) on 48
held-out texts of all six domains in unequal shares, so that the best weights are neither
uniform nor one expert's.

The search config: task_arithmetic over the K experts, `weight: {search: [0, 1]}` each, one
sampler and seed for every run. Runs, each in a fresh catalog, block cache, scratch and HF_HOME,
each `mergepipe search ... --parallel 1 --json` in a process of its own, timed whole:

  hub_budgeted   TRIALS trials at 10%, the top_k (5) merged again at 100%
  hub_full       TRIALS trials at 100% (search.budget: 100%), the top_k at 100%
  local_budgeted, local_full   the same on the family's local folders, LOCAL_TRIALS trials each
  hub_budgeted_random          with --random: hub_budgeted with the random sampler

The hub runs read every model as an hf:// repo from the tests' Hub-shaped server
(tests/hub_server.py) in a process of its own, on loopback with its bandwidth capped (--rate,
100 MB/s by default, one link shared by every connection), HF_ENDPOINT pointing at it, as
benchmarks/hub_merge.py does; --cache is a fresh folder and --cache-size a share (--cache-frac,
50%) of the experts' total size, so the cache cannot hold the family, as no local cache holds a
frontier family. Before each search, `mergepipe index` of the same family (fixed weights) fills
its catalog: the one full read of the experts the catalog needs, paid once per family and
reported apart (its seconds and bytes are not in the search's).

Bytes on the wire are counted by the server (body bytes sent, per run; expert files, base files
and the rest apart). Beside them, from each search's --json: the trials' and finals'
input_bytes_read (what storage sent to the merges), cache_bytes (what the block cache served,
from local disk), expert_bytes_read (what the plans read), merge_seconds and eval_seconds, and
from its report (search.json) the rank agreement. The process's rusage (CPU seconds, block I/O,
peak RSS) comes from wait4.

"Within noise": the winners of two searches are compared on the search's own held-out texts,
text by text: the paired difference of their summed token losses gives the standard error of
the difference of their mean losses (SE = sqrt(n * var(d_i)) / tokens); a difference under
2 SE is within noise (and a budgeted winner that scores better than the full search's is
within it too). (Evaluating one model twice gives the same loss to the bit, so repeated
evaluation has no spread to measure.) Also reported: the spread of the full search's five final
scores, and both winners' loss on a second held-out set of the same mixture (other seeds).

A hard deadline (--deadline-min, from the start of the script) kills a search that would pass
it; the runs after it are skipped and say so. Results: results.json and search_bench.png under
--results (default benchmarks/results/search/). The family is generated under a temporary
folder (--work) and deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mergepipe.config.sizes import parse_size  # noqa: E402
from tests.llama_family import ANIMALS, COLOURS, DOMAINS, NUMBERS, make_tokenizer  # noqa: E402

MB = 1e6
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f} s] {msg}", flush=True)


# The family ---------------------------------------------------------------------------------------

FACT = dict(zip(ANIMALS, COLOURS))  # each animal's colour, a fact of domain d


def countdown_sentence(rng: random.Random) -> str:
    """Domain c: counting down, in words."""
    end = rng.randrange(len(NUMBERS) - 6)
    run = NUMBERS[end : end + rng.randint(3, 6)]
    return "count " + " ".join(reversed(run))


def colour_fact_sentence(rng: random.Random) -> str:
    """Domain d: each animal has its colour."""

    def fact() -> str:
        animal = rng.choice(ANIMALS)
        return f"{rng.choice(('the', 'a'))} {animal} is {FACT[animal]}"

    return fact() + (f" and {fact()}" if rng.random() < 0.4 else "")


def animal_order_sentence(rng: random.Random) -> str:
    """Domain e: the animals in a fixed order."""
    i = rng.randrange(1, len(ANIMALS) - 1)
    if rng.random() < 0.5:
        return f"the {ANIMALS[i]} comes before the {ANIMALS[i + 1]}"
    return f"the {ANIMALS[i]} comes after the {ANIMALS[i - 1]}"


def colour_run_sentence(rng: random.Random) -> str:
    """Domain f: runs of colours in a fixed cycle."""
    start, n = rng.randrange(len(COLOURS)), rng.randint(3, 7)
    return " ".join(COLOURS[(start + k) % len(COLOURS)] for k in range(n))


ALL_DOMAINS = {
    "a": DOMAINS["a"],
    "b": DOMAINS["b"],
    "c": countdown_sentence,
    "d": colour_fact_sentence,
    "e": animal_order_sentence,
    "f": colour_run_sentence,
}
# The held-out mixture: unequal shares, so the best merge is not the uniform one.
SHARES = {"a": 0.30, "b": 0.25, "c": 0.15, "d": 0.12, "e": 0.10, "f": 0.08}


def held_out(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    names, weights = list(SHARES), list(SHARES.values())
    return [ALL_DOMAINS[rng.choices(names, weights)[0]](rng) for _ in range(n)]


def train(
    model, tokenizer, domains: str, steps: int, lr: float, batch: int, rng: random.Random, optimizer: str = "adamw"
) -> float:
    import torch

    kind = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    opt = kind(model.parameters(), lr=lr)
    model.train()
    loss = None
    for _ in range(steps):
        texts = [ALL_DOMAINS[rng.choice(domains)](rng) for _ in range(batch)]
        enc = tokenizer(texts, padding=True, return_tensors="pt")
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        loss = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


def make_family(root: Path, args) -> dict:
    """base/ and e0/ … e{K-1}/ (float32 safetensors, config, tokenizer); heldout.jsonl (the
    search's evaluation) and test.jsonl (the same mixture, other seeds)."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.utils.logging.disable_progress_bar()
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    rng = random.Random(args.seed)

    def save(name: str) -> str:
        folder = root / name
        model.save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))
        return str(folder)

    domains = "".join(ALL_DOMAINS)
    losses = {"base": train(model, tokenizer, domains, args.base_steps, args.base_lr, 16, rng)}
    base = save("base")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    experts, expert_domains = [], []
    for i in range(args.experts):
        domain = domains[i % len(domains)]  # past six experts, the domains again (other data)
        model.load_state_dict(state)
        losses[f"e{i}"] = train(
            model, tokenizer, domain, args.expert_steps, args.expert_lr, 16, rng, args.expert_optimizer
        )
        experts.append(save(f"e{i}"))
        expert_domains.append(domain)
    for name, seed in (("heldout", 10_000), ("test", 20_000)):
        texts = held_out(args.eval_texts, args.seed + seed)
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    files = [p for e in experts for p in Path(e).glob("*.safetensors")]
    block = parse_size(args.block_size, key="--block-size")
    return {
        "energy_in_top_10pct_blocks": [round(top_energy(base, e, block, 0.10), 4) for e in experts],
        "base": base,
        "experts": experts,
        "expert_domains": expert_domains,
        "heldout": str(root / "heldout.jsonl"),
        "test": str(root / "test.jsonl"),
        "params": sum(p.numel() for p in model.parameters()),
        "model_bytes": sum(p.stat().st_size for p in Path(base).glob("*.safetensors")),
        "expert_bytes": sum(p.stat().st_size for p in files),
        "train_loss_last_batch": {k: round(v, 4) for k, v in losses.items()},
    }


def top_energy(base: str, expert: str, block_bytes: int, share: float) -> float:
    """The share of an expert's delta energy (sum of squares) in its `share` of blocks with the
    most: blocks as contiguous block_bytes of each tensor (how concentrated the delta is, what a
    budgeted plan can capture)."""
    import numpy as np
    from safetensors.numpy import load_file

    b, e = load_file(str(Path(base) / "model.safetensors")), load_file(str(Path(expert) / "model.safetensors"))
    energies = []
    for name, x in e.items():
        d = (x.astype(np.float64) - b[name].astype(np.float64)).ravel()
        n = max(1, block_bytes // x.itemsize)
        pad = (-d.size) % n
        energies.append(np.square(np.pad(d, (0, pad))).reshape(-1, n).sum(axis=1))
    all_ = np.sort(np.concatenate(energies))[::-1]
    return float(all_[: max(1, int(share * all_.size))].sum() / all_.sum())


# Runs ---------------------------------------------------------------------------------------------


def search_config(path: Path, base: str, experts: list[str], args, budget: str, sampler: str, trials: int, data: str):
    import yaml

    doc = {
        "merge_method": "task_arithmetic",
        "base_model": base,
        "block_size": args.block_size,
        "dtype": "float32",
        "models": [{"model": e, "parameters": {"weight": {"search": [0.0, 1.0]}}} for e in experts],
        "search": {
            "trials": trials,
            "budget": budget,
            "final_budget": "100%",
            "top_k": args.top_k,
            "sampler": sampler,
            "seed": args.seed,
            "parallel": 1,
            "evaluate": {"perplexity": {"data": data, "field": "text", "max_length": 64}},
        },
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def index_config(path: Path, base: str, experts: list[str], args) -> Path:
    import yaml

    doc = {
        "merge_method": "task_arithmetic",
        "base_model": base,
        "block_size": args.block_size,
        "dtype": "float32",
        "models": [{"model": e, "parameters": {"weight": 0.5}} for e in experts],
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


FAMILY_ARGS = (
    "experts", "layers", "hidden", "intermediate", "heads", "base_steps", "expert_steps", "base_lr", "expert_lr",
    "expert_optimizer", "eval_texts", "seed", "block_size",
)  # fmt: skip
PROGRESS = re.compile(r"(trial \d+: .*|base model: .*|publishing .*|checking the evaluation .*)")


def run_process(cmd: list[str], env: dict, log: Path, deadline: float) -> dict:
    """Run a command to its end or the deadline (monotonic): wall seconds, exit code, stdout,
    rusage (from wait4: the process and its waited-for children). Relays progress lines."""
    t0 = time.perf_counter()
    with open(log, "w") as err_file:
        proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        out_chunks: list[str] = []
        reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
        reader.start()

        def relay() -> None:
            for line in proc.stderr:
                err_file.write(line)
                err_file.flush()
                m = PROGRESS.search(line)
                if m:
                    say("  " + m.group(1)[:160])

        relayer = threading.Thread(target=relay, daemon=True)
        relayer.start()
        timed_out = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.5)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        reader.join(30)
        relayer.join(30)
    return {
        "wall_s": round(wall, 2),
        "rc": proc.returncode,
        "timed_out": timed_out,
        "stdout": "".join(out_chunks),
        "rusage": {
            "user_s": round(usage.ru_utime, 2),
            "system_s": round(usage.ru_stime, 2),
            "max_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "block_input_mb": round(usage.ru_inblock * 512 / MB, 1),
            "block_output_mb": round(usage.ru_oublock * 512 / MB, 1),
        },
    }


class Wire:
    """The Hub-shaped server's count of body bytes sent, since the last call."""

    def __init__(self, endpoint: str | None) -> None:
        self.endpoint = endpoint

    def take(self) -> dict:
        if self.endpoint is None:
            return {"wire_bytes": 0, "wire_expert_bytes": 0, "wire_base_bytes": 0, "requests": 0}
        with urllib.request.urlopen(f"{self.endpoint}/_log") as r:
            sent = json.loads(r.read())
        expert = sum(n for path, n in sent if re.search(r"^/bench/e\d+/.*\.safetensors$", path))
        base = sum(n for path, n in sent if re.search(r"^/bench/base/.*\.safetensors$", path))
        return {
            "wire_bytes": sum(n for _, n in sent),
            "wire_expert_bytes": expert,
            "wire_base_bytes": base,
            "requests": len(sent),
        }


def summarize(name: str, sampler: str, budget: str, trials: int, proc: dict, wire: dict, index: dict, run: Path):
    """One run's row: the process's figures, the server's bytes and the search's own."""
    row = {
        "run": name,
        "sampler": sampler,
        "budget": budget,
        "final_budget": "100%",
        "trials_asked": trials,
        "wall_s": proc["wall_s"],
        "rc": proc["rc"],
        "timed_out": proc["timed_out"],
        "rusage": proc["rusage"],
        "index": index,
        **wire,
    }
    try:
        result = json.loads(proc["stdout"])
    except ValueError:
        tail = (run / "stderr.log").read_text()[-1500:] if (run / "stderr.log").exists() else ""
        row["error"] = f"no JSON result (exit {proc['rc']}): {tail}"
        return row, None
    trials, finals = result["trials"], result["finals"]

    def total(rows: list, key: str) -> float:
        return sum(r.get(key) or 0 for r in rows)

    report = json.loads((Path(result["report"]) / "search.json").read_text())
    row.update(
        trials_done=len(trials),
        trials_failed=sum(r["state"] != "complete" for r in trials),
        finals_done=len(finals),
        base_score=result["base_score"],
        best=result["best"] | {"params": {k.split(".")[0]: round(v, 4) for k, v in result["best"]["params"].items()}},
        digest=result["digest"],
        agreement=report.get("agreement"),
        report_totals=report.get("totals"),
    )
    for part, rows in (("trials", trials), ("finals", finals)):
        row[part] = {
            key: round(total(rows, key), 2 if key.endswith("seconds") else None)
            for key in (
                "merge_seconds",
                "eval_seconds",
                "input_bytes_read",
                "cache_bytes",
                "expert_bytes_read",
                "budget_bytes",
            )
        }
    merge_eval = total(trials + finals, "merge_seconds") + total(trials + finals, "eval_seconds")
    row["other_seconds"] = round(proc["wall_s"] - merge_eval, 2)  # imports, the base's check, publish, report
    row["per_trial"] = [
        {
            "trial": r["trial"],
            "score": r.get("score"),
            "error_bound": r.get("error_bound"),
            "merge_s": round(r.get("merge_seconds") or 0, 2),
            "eval_s": round(r.get("eval_seconds") or 0, 2),
            "input_mb": round((r.get("input_bytes_read") or 0) / MB, 2),
            "cache_mb": round((r.get("cache_bytes") or 0) / MB, 2),
        }
        for r in sorted(trials, key=lambda r: r["trial"])
    ]
    row["per_final"] = [
        {
            "trial": r["trial"],
            "budgeted_score": next((t.get("score") for t in trials if t["trial"] == r["trial"]), None),
            "final_score": r.get("score"),
            "merge_s": round(r.get("merge_seconds") or 0, 2),
            "eval_s": round(r.get("eval_seconds") or 0, 2),
            "input_mb": round((r.get("input_bytes_read") or 0) / MB, 2),
            "cache_mb": round((r.get("cache_bytes") or 0) / MB, 2),
        }
        for r in sorted(finals, key=lambda r: r["trial"])
    ]
    return row, result


# Noise --------------------------------------------------------------------------------------------


def per_text_losses(model_dir: str, data: str) -> tuple[list[float], list[int]]:
    """Each text's summed token loss and its token count, as the built-in evaluator scores them."""
    import torch

    from mergepipe.config.search import PerplexityEvaluation
    from mergepipe.evaluate.perplexity import _load, _text_loss, _transformers, read_texts

    setting = PerplexityEvaluation(data, "text", None, 64)
    model, tokenizer, kind, limit = _load(_transformers(), model_dir)
    losses, counts = [], []
    with torch.no_grad():
        for text in read_texts(setting):
            loss, n = _text_loss(model, tokenizer, kind, text, min(64, limit))
            losses.append(loss)
            counts.append(n)
    return losses, counts


def compare(a_dir: str, b_dir: str, data: str) -> dict:
    """Mean losses of two models on the same texts, their difference (a - b) and its paired
    standard error over the texts."""
    la, n = per_text_losses(a_dir, data)
    lb, _ = per_text_losses(b_dir, data)
    tokens = sum(n)
    d = [x - y for x, y in zip(la, lb)]
    mean_d = sum(d) / len(d)
    var = sum((x - mean_d) ** 2 for x in d) / (len(d) - 1)
    se = math.sqrt(len(d) * var) / tokens
    diff = (sum(la) - sum(lb)) / tokens
    return {
        "a": sum(la) / tokens,
        "b": sum(lb) / tokens,
        "diff": diff,
        "se": se,
        "texts": len(d),
        "tokens": tokens,
        "within_2se": abs(diff) <= 2 * se,
    }


def noise_check(budgeted: dict, full: dict, fam: dict) -> dict:
    """The budgeted search's winner against the full search's, on the search's texts and on the
    second held-out set; and the spread of the full search's final scores."""
    finals = [f["final_score"] for f in full["per_final"] if f["final_score"] is not None]
    spread = {
        "min": min(finals),
        "max": max(finals),
        "std": (sum((x - sum(finals) / len(finals)) ** 2 for x in finals) / max(1, len(finals) - 1)) ** 0.5,
    }
    out = {
        "budgeted_final": budgeted["best"]["final_score"],
        "full_final": full["best"]["final_score"],
        "difference": budgeted["best"]["final_score"] - full["best"]["final_score"],
        "full_top_k_final_spread": spread,
        "within_full_top_k_range": budgeted["best"]["final_score"] <= spread["max"],
    }
    for name in ("heldout", "test"):
        out[f"paired_{name}"] = compare(budgeted["out"], full["out"], fam[name])
    out["within_noise"] = out["paired_heldout"]["within_2se"] or out["difference"] <= 0
    return out


# Plot ---------------------------------------------------------------------------------------------


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "per_trial" in r]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    for r in done:
        if not r["run"].startswith("hub"):
            continue
        xs = [t["trial"] for t in r["per_trial"] if t["score"] is not None]
        ys = [t["score"] for t in r["per_trial"] if t["score"] is not None]
        (line,) = ax.plot(xs, ys, "o", ms=3, alpha=0.6, label=f"{r['run']} trials")
        best = [min(ys[: i + 1]) for i in range(len(ys))]
        ax.plot(xs, best, "-", color=line.get_color(), lw=1)
        fx = [f["trial"] for f in r["per_final"] if f["final_score"] is not None]
        fy = [f["final_score"] for f in r["per_final"] if f["final_score"] is not None]
        ax.plot(fx, fy, "x", ms=8, color=line.get_color(), label=f"{r['run']} finals (100%)")
    if done:
        ax.axhline(done[0]["base_score"], color="grey", ls=":", lw=1, label="base")
    ax.set_xlabel("trial")
    ax.set_ylabel("mean token loss (lower is better)")
    ax.set_title("score per trial (hub runs); line: best so far")
    ax.legend(fontsize=6, ncol=2, loc="upper center")
    ys = [t["score"] for r in done if r["run"].startswith("hub") for t in r["per_trial"] if t["score"] is not None]
    if ys:
        lo = min(ys)
        ax.set_ylim(lo - 0.02 * abs(lo), sorted(ys)[int(0.9 * (len(ys) - 1))] * 1.06)

    names = [r["run"] for r in done]
    x = range(len(names))
    merge = [r["trials"]["merge_seconds"] + r["finals"]["merge_seconds"] for r in done]
    ev = [r["trials"]["eval_seconds"] + r["finals"]["eval_seconds"] for r in done]
    other = [r["other_seconds"] for r in done]
    ax = axes[1]
    ax.bar(x, merge, label="merges")
    ax.bar(x, ev, bottom=merge, label="evaluations")
    ax.bar(x, other, bottom=[m + e for m, e in zip(merge, ev)], label="the rest (imports, base, publish)")
    ax.set_xticks(list(x), names, rotation=20, fontsize=8)
    ax.set_ylabel("seconds (wall of the search command)")
    ax.set_title("where the search's wall goes")
    ax.legend(fontsize=7)

    ax = axes[2]
    wire = [r["wire_bytes"] / MB for r in done]
    cached = [(r["trials"]["cache_bytes"] + r["finals"]["cache_bytes"]) / MB for r in done]
    local = [
        (r["trials"]["input_bytes_read"] + r["finals"]["input_bytes_read"]) / MB
        if not r["run"].startswith("hub")
        else 0
        for r in done
    ]
    w = 0.28
    ax.bar([i - w for i in x], wire, w, label="on the wire (server)")
    ax.bar(list(x), cached, w, label="from the block cache (disk)")
    ax.bar([i + w for i in x], local, w, label="read from local files")
    ax.set_xticks(list(x), names, rotation=20, fontsize=8)
    ax.set_ylabel("MB")
    ax.set_title("bytes the search's merges read")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


# Main ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=6)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--base-steps", type=int, default=100, help="training steps of the base, on every domain")
    ap.add_argument("--expert-steps", type=int, default=30, help="further steps of each expert, on its domain")
    ap.add_argument("--base-lr", type=float, default=1e-3)
    ap.add_argument("--expert-optimizer", default="sgd", choices=("sgd", "adamw"))
    ap.add_argument("--expert-lr", type=float, default=0.02)
    ap.add_argument("--eval-texts", type=int, default=48, help="held-out texts the search scores on")
    ap.add_argument("--block-size", default="128KiB")
    ap.add_argument("--trials", type=int, default=50, help="trials of each hub search")
    ap.add_argument("--local-trials", type=int, default=20, help="trials of each local search (0: none)")
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--sampler", default="tpe", choices=("tpe", "cmaes", "random"))
    ap.add_argument("--random", action="store_true", help="also a budgeted hub search with the random sampler")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=100e6, help="link bandwidth, bytes per second")
    ap.add_argument(
        "--cache-frac", type=float, default=0.5, help="the block cache's bound, a share of the experts' bytes"
    )
    ap.add_argument(
        "--deadline-min", type=float, default=55.0, help="minutes from the start; a search past it is killed"
    )
    ap.add_argument("--only", default=None, help="comma-separated runs to do (default: all)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (the family, outputs, catalogs)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "search"))
    ap.add_argument("--replot", action="store_true", help="only draw the PNG again from --results' results.json")
    args = ap.parse_args()
    if args.replot:
        out = Path(args.results)
        plot(json.loads((out / "results.json").read_text())["runs"], out / "search_bench.png")
        return
    deadline = T0 + args.deadline_min * 60

    work = Path(args.work or tempfile.mkdtemp(prefix="search-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    say(f"work folder {work}; deadline in {args.deadline_min:g} min")
    recipe = {k: getattr(args, k) for k in FAMILY_ARGS}
    saved = work / "fam" / "family.json"
    if saved.exists() and json.loads(saved.read_text())["recipe"] == recipe:
        fam = json.loads(saved.read_text())  # a kept --work folder's family, made by the same arguments
        say("reusing the family in --work")
        for run in work.iterdir():
            if run.name != "fam":
                shutil.rmtree(run)
    else:
        t = time.perf_counter()
        fam = make_family(work / "fam", args)
        fam["generate_s"] = round(time.perf_counter() - t, 1)
        saved.write_text(json.dumps({**fam, "recipe": recipe}))
    say(
        f"family generated in {fam['generate_s']} s: {fam['params'] / 1e6:.1f} M parameters, "
        f"{fam['model_bytes'] / MB:.1f} MB per model, {fam['expert_bytes'] / MB:.1f} MB of expert files; "
        f"last training losses {fam['train_loss_last_batch']}; delta energy in the top 10% of blocks "
        f"{fam['energy_in_top_10pct_blocks']}"
    )

    repos = [f"bench/base={fam['base']}"] + [f"bench/e{i}={e}" for i, e in enumerate(fam["experts"])]
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.hub_server", f"{args.rate}:0", *repos],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    endpoint = server.stdout.readline().strip()
    say(f"Hub-shaped server at {endpoint}, link {args.rate / MB:g} MB/s")
    hub_wire, no_wire = Wire(endpoint), Wire(None)
    hub_base, hub_experts = "hf://bench/base", [f"hf://bench/e{i}" for i in range(args.experts)]
    cache_bound = int(args.cache_frac * fam["expert_bytes"])

    plan = [
        ("hub_budgeted", "hub", "10%", args.sampler, args.trials),
        ("hub_full", "hub", "100%", args.sampler, args.trials),
    ]
    if args.local_trials:
        plan += [
            ("local_budgeted", "local", "10%", args.sampler, args.local_trials),
            ("local_full", "local", "100%", args.sampler, args.local_trials),
        ]
    if args.random:
        plan.append(("hub_budgeted_random", "hub", "10%", "random", args.trials))
    if args.only:
        keep = set(args.only.split(","))
        plan = [p for p in plan if p[0] in keep]

    rows: list[dict] = []
    skipped: list[str] = []
    base_env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "MERGEPIPE_CACHE", "MERGEPIPE_CATALOG")}
    for name, where, budget, sampler, trials in plan:
        if time.monotonic() > deadline - 60:
            skipped.append(name)
            say(f"{name}: skipped (the deadline is near)")
            continue
        run = work / name
        run.mkdir()
        env = {
            **base_env,
            "MERGEPIPE_ORCHESTRATION": "local",
            "MERGEPIPE_HOME": str(run / "home"),
            "HF_HOME": str(run / "hf-home"),
        }
        if where == "hub":
            env["HF_ENDPOINT"] = endpoint
            base, experts, wire = hub_base, hub_experts, hub_wire
        else:
            base, experts, wire = fam["base"], fam["experts"], no_wire
        catalog = run / "catalog.duckdb"
        cli = [sys.executable, "-m", "mergepipe.cli"]
        idx = index_config(run / "index.yml", base, experts, args)
        wire.take()
        say(f"{name}: index pass")
        p = run_process(
            cli + ["index", str(idx), "--catalog", str(catalog), "--json"], env, run / "index.log", deadline
        )
        index = {"wall_s": p["wall_s"], "rc": p["rc"], **wire.take()}
        if p["rc"] != 0:
            say(f"{name}: the index pass failed (exit {p['rc']}), see {run / 'index.log'}")
            rows.append({"run": name, "error": "index failed", "index": index})
            break
        say(f"{name}: indexed in {p['wall_s']} s, {index['wire_bytes'] / MB:.1f} MB on the wire")
        cfg = search_config(run / "search.yml", base, experts, args, budget, sampler, trials, fam["heldout"])
        cmd = cli + [
            "search", str(cfg), "--out", str(run / "out"), "--catalog", str(catalog), "--report", str(run / "report"),
            "--scratch", str(run / "scratch"), "--parallel", "1", "--json",
        ]  # fmt: skip
        if where == "hub":
            cmd += ["--cache", str(run / "cache"), "--cache-size", f"{cache_bound}B"]
        say(f"{name}: {trials} trials at {budget}, sampler {sampler}")
        p = run_process(cmd, env, run / "stderr.log", deadline)
        shutil.copy(run / "stderr.log", run / "search.log")
        row, _ = summarize(name, sampler, budget, trials, p, wire.take(), index, run)
        row["where"] = where
        row["out"] = str(run / "out")
        rows.append(row)
        if "error" in row:
            say(f"{name}: FAILED: {row['error'][:600]}")
            if p["timed_out"]:
                say(f"{name}: killed at the deadline")
            break
        say(
            f"{name}: {row['wall_s']} s; wire {row['wire_bytes'] / MB:.1f} MB; best trial {row['best']['trial']} "
            f"final {row['best']['final_score']:.5f}; spearman {row['agreement'].get('spearman')}"
        )

    server.kill()
    by = {r["run"]: r for r in rows if "best" in r}
    comparisons = {}
    for where in ("hub", "local"):
        b, f = by.get(f"{where}_budgeted"), by.get(f"{where}_full")
        if b and f:
            c = {
                "wall_ratio": round(b["wall_s"] / f["wall_s"], 3),
                "wall_ratio_trials_only": round(
                    (b["trials"]["merge_seconds"] + b["trials"]["eval_seconds"])
                    / (f["trials"]["merge_seconds"] + f["trials"]["eval_seconds"]),
                    3,
                ),
                "wire_ratio": round(b["wire_bytes"] / f["wire_bytes"], 4) if f["wire_bytes"] else None,
                **noise_check(b, f, fam),
            }
            c["goal_met"] = bool(c["within_noise"] and c["wall_ratio"] <= 1 / 3)
            comparisons[f"{where}_budgeted_vs_full"] = c
            say(f"{where}: {json.dumps(c)}")
    if "hub_budgeted_random" in by and "hub_full" in by:
        comparisons["hub_random_vs_full"] = noise_check(by["hub_budgeted_random"], by["hub_full"], fam)

    for r in rows:
        r.pop("out", None)
    result = {
        "machine": "2-core CPU VM, 24 GiB RAM, no GPU (timings vary up to 2x between runs)",
        "family": {
            k: fam[k]
            for k in (
                "params",
                "model_bytes",
                "expert_bytes",
                "expert_domains",
                "generate_s",
                "train_loss_last_batch",
                "energy_in_top_10pct_blocks",
            )  # fmt: skip
        }
        | {
            "experts": args.experts,
            "layers": args.layers,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "heads": args.heads,
            "dtype": "float32",
            "eval_texts": args.eval_texts,
            "base_steps": args.base_steps,
            "expert_steps": args.expert_steps,
            "base_lr": args.base_lr,
            "expert_lr": args.expert_lr,
            "expert_optimizer": args.expert_optimizer,
            "max_length": 64,
            "shares": SHARES,
        },
        "settings": {
            "method": "task_arithmetic",
            "block_size": args.block_size,
            "rate_bytes_per_s": args.rate,
            "cache_bound_bytes": cache_bound,
            "cache_frac": args.cache_frac,
            "sampler": args.sampler,
            "seed": args.seed,
            "top_k": args.top_k,
            "trials": args.trials,
            "local_trials": args.local_trials,
            "deadline_min": args.deadline_min,
        },
        "runs": rows,
        "skipped": skipped,
        "comparisons": comparisons,
        "total_wall_s": round(time.monotonic() - T0, 1),
    }
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    if any("per_trial" in r for r in rows):
        plot(rows, out / "search_bench.png")
    say(f"results in {out}")
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
