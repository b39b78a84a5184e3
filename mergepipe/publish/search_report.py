"""Merge-search reports: the trials and final merges as Markdown, JSON and a PNG plot (score per
trial; score against expert bytes read), with the rank agreement between the budgeted and the
final scores of the best trials. Returned as bytes; the callers write them."""

from __future__ import annotations

import io
import json
import math
from typing import Any, Sequence

from mergepipe.publish.report import markdown_table

MIB = 2**20


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties given their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson's on the ranks); None for fewer than two pairs or
    a side whose values are all equal."""
    if len(a) != len(b) or len(a) < 2:
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    if va == 0 or vb == 0:
        return None
    return cov / math.sqrt(va * vb)


def agreement(result: dict) -> dict:
    """How the budgeted scores of the trials merged again compare with their final scores: the
    rank correlation, and each side's winner."""
    finals = {r["trial"]: r for r in result["finals"] if r["state"] == "complete"}
    budgeted = {r["trial"]: r for r in result["trials"] if r["state"] == "complete"}
    both = sorted(t for t in finals if t in budgeted)
    sign = -1 if result["direction"] == "maximize" else 1

    def winner(rows: dict) -> int | None:
        return min(both, key=lambda t: (sign * rows[t]["score"], t)) if both else None

    a, b = winner(budgeted), winner(finals)
    return {
        "trials_compared": both,
        "spearman": spearman([budgeted[t]["score"] for t in both], [finals[t]["score"] for t in both]),
        "budgeted_winner": a,
        "final_winner": b,
        "budget_changed_winner": a != b,
    }


def summary_rows(result: dict) -> list[dict]:
    """One row per final merge: its trial, both scores and what each read."""
    budgeted = {r["trial"]: r for r in result["trials"]}
    rows = []
    for f in result["finals"]:
        t = budgeted.get(f["trial"], {})
        rows.append(
            {
                "trial": f["trial"],
                "params": json.dumps(f["params"], sort_keys=True),
                "budgeted_score": t.get("score"),
                "final_score": f.get("score"),
                "budgeted_MiB": round((t.get("expert_bytes_read") or 0) / MIB, 3),
                "final_MiB": round((f.get("expert_bytes_read") or 0) / MIB, 3),
                "published": f["trial"] == result["best"]["trial"],
            }
        )
    return rows


def _num(v: Any) -> str:
    return "–" if v is None else f"{v:.6g}"


def _mib(v: Any) -> str:
    return "–" if v is None else f"{v / MIB:,.2f}"


TRIAL_COLUMNS = [
    ("trial", "trial", str),
    ("state", "state", str),
    ("score", "score", _num),
    ("budget", "budget", str),
    ("expert_bytes_read", "expert MiB read", _mib),
    ("cache_bytes", "from cache MiB", _mib),
    ("input_bytes_read", "input MiB read", _mib),
    ("error_bound", "bound", _num),
    ("merge_seconds", "merge s", lambda v: f"{v:.2f}"),
    ("eval_seconds", "eval s", lambda v: f"{v:.2f}"),
    ("params", "parameters", lambda v: json.dumps(v, sort_keys=True)),
    ("error", "error", lambda v: str(v).replace("|", "\\|").replace("\n", " ")[:160]),
]


def totals(result: dict) -> dict:
    """The bytes of the whole search: what its merges read from storage, beside what their plans
    asked for (the difference is what the block cache served)."""
    rows = result["trials"] + result["finals"]
    return {
        "input_bytes_read": sum(r.get("input_bytes_read") or 0 for r in rows),
        "expert_bytes_read": sum(r.get("expert_bytes_read") or 0 for r in rows),
        "cache_bytes": sum(r.get("cache_bytes") or 0 for r in rows),
        "trial_budget_bytes": sum(r.get("budget_bytes") or 0 for r in result["trials"]),
        # what the trials' plans read, each on its own: the bytes a search without a cache reads
        "trial_plan_bytes": sum(r.get("expert_bytes_read") or 0 for r in result["trials"]),
        "merge_seconds": sum(r.get("merge_seconds") or 0 for r in rows),
        "eval_seconds": sum(r.get("eval_seconds") or 0 for r in rows),
    }


def search_report(result: dict, title: str) -> dict[str, bytes]:
    """search.md, search.json and search.png."""
    agree = agreement(result)
    sums = totals(result)
    best = result["best"]
    done = [r for r in result["trials"] if r["state"] == "complete"]
    lines = [
        f"# {title}",
        "",
        f"{len(result['trials'])} trials at {result['budget']} ({len(done)} complete), sampler {result['sampler']}, "
        f"{result['direction']} the score; the best {len(result['finals'])} merged again at {result['final_budget']}.",
        "",
        f"Published: trial {best['trial']} to {result['out']} (digest {result['digest'][:16]}…), final score "
        f"{_num(best['final_score'])}, budgeted score {_num(best['score'])}; the base model scores "
        f"{_num(result.get('base_score'))}.",
        "",
        f"Rank agreement of budgeted and final scores over trials {agree['trials_compared']}: Spearman "
        f"{_num(agree['spearman'])}. "
        + (
            f"**The budget changed the winner**: trial {agree['budgeted_winner']} led at {result['budget']}, "
            f"trial {agree['final_winner']} at {result['final_budget']}."
            if agree["budget_changed_winner"]
            else f"The budget did not change the winner (trial {agree['final_winner']})."
        ),
        "",
        f"Bytes: the merges read {_mib(sums['input_bytes_read'])} MiB from the inputs' storage "
        f"({_mib(sums['expert_bytes_read'])} MiB of expert bytes, {_mib(sums['cache_bytes'])} MiB more served by "
        f"the block cache); the trials' plans read {_mib(sums['trial_plan_bytes'])} MiB of expert bytes, "
        f"within budgets that sum to {_mib(sums['trial_budget_bytes'])} MiB. Seconds: "
        f"{sums['merge_seconds']:.1f} merging, {sums['eval_seconds']:.1f} evaluating.",
        "",
        "## Final merges",
        "",
        markdown_table(
            [{**r, "final": "yes"} for r in result["finals"]],
            [c for c in TRIAL_COLUMNS if c[0] not in ("budget",)],
        ),
        "## Trials",
        "",
        markdown_table(result["trials"], TRIAL_COLUMNS),
    ]
    report = {**result, "agreement": agree, "totals": sums}
    return {
        "search.md": "\n".join(lines).encode(),
        "search.json": json.dumps(report, indent=2, sort_keys=True, default=str).encode(),
        "search.png": search_figure(result, title),
    }


def search_figure(result: dict, title: str) -> bytes:
    """Two panels: the score of each trial in order (failed trials marked at the bottom), and
    score against expert bytes read, budgeted trials and final merges apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    done = [r for r in result["trials"] if r["state"] == "complete"]
    finals = [r for r in result["finals"] if r["state"] == "complete"]
    a.plot([r["trial"] for r in done], [r["score"] for r in done], "o", label=f"trial at {result['budget']}")
    a.plot([r["trial"] for r in finals], [r["score"] for r in finals], "*", ms=10, label=f"at {result['final_budget']}")
    if result.get("base_score") is not None:
        a.axhline(result["base_score"], ls=":", c="gray", label="base model")
    failed = [r["trial"] for r in result["trials"] if r["state"] != "complete"]
    if failed:
        a.plot(failed, [a.get_ylim()[0]] * len(failed), "x", c="red", label="failed")
    a.set(xlabel="trial", ylabel="score", title="score per trial")
    a.legend(fontsize=8)
    b.plot([r["expert_bytes_read"] / MIB for r in done], [r["score"] for r in done], "o", label="budgeted")
    b.plot([r["expert_bytes_read"] / MIB for r in finals], [r["score"] for r in finals], "*", ms=10, label="final")
    b.set(xlabel="expert MiB read", ylabel="score", title="score against bytes read")
    b.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
