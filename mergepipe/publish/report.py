"""Budget-sweep reports: a Markdown table and a PNG plot (bytes, seconds and deviation against
budget) from result rows, as text and bytes (the callers write them). Shared by `mergepipe
sweep` and the benchmarks."""

from __future__ import annotations

import io
import json
from typing import Any, Callable, Sequence

MIB = 2**20


def _pct(x: float) -> str:
    return f"{x:.1f}%"


def _sci(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


# (key, header, format) of the sweep table.
SWEEP_COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("budget", "budget", str),
    ("expert_bytes_read", "expert MiB read", lambda v: f"{v / MIB:,.1f}"),
    ("read_share", "of full", _pct),
    ("wall_seconds", "seconds", lambda v: f"{v:.2f}"),
    ("error_bound", "bound", _sci),
    ("bound_guaranteed", "guaranteed", lambda v: "yes" if v else "no"),
    ("relative_to_full", "‖θ̂−θ_full‖/‖θ_full‖", _sci),
    ("relative_to_delta", "‖θ̂−θ_full‖/‖θ_full−θ₀‖", _sci),
]


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, Callable[[Any], str]]]) -> str:
    present = [c for c in columns if any(c[0] in r for r in rows)]
    lines = ["| " + " | ".join(h for _, h, _ in present) + " |", "|" + "---|" * len(present)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r[k]) if r.get(k) is not None else "–" for k, _, fmt in present) + " |")
    return "\n".join(lines) + "\n"


def sweep_figure(rows: Sequence[dict], title: str, references: dict[str, float] | None = None):
    """Three panels against the share of expert bytes the budget allows, on one x range: expert
    bytes read, wall seconds from 0 (with `references`, e.g. another tool's seconds, as
    horizontal lines), and the deviation from the full-budget merge with its predicted bound.
    A bound that is only a ranking heuristic (bound_guaranteed false) is drawn dotted and
    labelled so, never as the guarantee's solid line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [100 * r["budget_bytes"] / r["full_expert_bytes"] if r["full_expert_bytes"] else 100.0 for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8), sharex=True)
    a.plot(x, [r["expert_bytes_read"] / MIB for r in rows], "o-")
    a.set(xlabel="budget (% of expert bytes)", ylabel="expert MiB read", title="bytes")
    b.plot(x, [r["wall_seconds"] for r in rows], "o-", label="mergepipe")
    if "hardware_seconds" in rows[0]:
        b.plot(x, [r["hardware_seconds"] for r in rows], "^:", label="hardware limit")
    for i, (name, seconds) in enumerate(sorted((references or {}).items())):
        b.axhline(seconds, linestyle="--", color=f"C{i + 2}", label=name)
    if references or "hardware_seconds" in rows[0]:
        b.legend()
    b.set(xlabel="budget (% of expert bytes)", ylabel="seconds", title="wall time")
    b.set_ylim(bottom=0)
    partial = [(xi, r) for xi, r in zip(x, rows) if r.get("relative_to_full")]
    if partial:
        c.semilogy([p[0] for p in partial], [p[1]["relative_to_full"] for p in partial], "o-", label="measured")
        bounds = [
            (p[0], p[1]["error_bound"] / p[1]["full_norm"], p[1].get("bound_guaranteed", False))
            for p in partial
            if p[1].get("full_norm")
        ]
        for guaranteed, style, label in ((True, "s--", "bound"), (False, "x:", "heuristic (not a bound)")):
            points = [(xi, v) for xi, v, g in bounds if bool(g) == guaranteed]
            if points:
                c.semilogy([p[0] for p in points], [p[1] for p in points], style, label=label)
        c.legend()
    c.set(xlabel="budget (% of expert bytes)", ylabel="‖θ̂−θ_full‖ / ‖θ_full‖", title="deviation")
    a.set_xlim(0, 105)  # shared by the three panels
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_sweep(rows: Sequence[dict], title: str, references: dict[str, float] | None = None) -> bytes:
    """sweep_figure as PNG bytes."""
    import matplotlib.pyplot as plt

    fig = sweep_figure(rows, title, references)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def sweep_report(rows: Sequence[dict], title: str) -> dict[str, bytes]:
    """The contents of sweep.json, sweep.md and sweep.png."""
    return {
        "sweep.json": (json.dumps(list(rows), indent=1, sort_keys=True) + "\n").encode(),
        "sweep.md": (f"# {title}\n\n" + markdown_table(rows, SWEEP_COLUMNS)).encode(),
        "sweep.png": plot_sweep(rows, title),
    }
