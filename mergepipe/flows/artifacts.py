"""Prefect artifacts of a run: the plan's explain table and the manifest summary.

They show in the Prefect UI next to the run and can be read back from the API (a flow run in
process, with no API, publishes none). They hold locations, digests and byte counts, never
storage options. A merge's artifacts are keyed by its output location as given (a nightly
deployment's `merges/nightly-{date}` is one key), so each output's merges form a history
under one key in the UI."""

from __future__ import annotations

import hashlib
import re

from mergepipe.flows.orchestration import publish_artifact
from mergepipe.storage.location import is_remote

PLAN_KEY = "merge-plan"
SUMMARY_KEY = "merge-summary"


def artifact_key(kind: str, out: str | None) -> str:
    """`kind`, and for a merge its output location (as given) in the characters a key allows
    (lowercase letters, digits, dashes), its tail kept and a hash of all of it added."""
    if out is None:
        return kind
    slug = re.sub(r"[^a-z0-9]+", "-", out.lower()).strip("-")[-40:].strip("-")
    return f"{kind}-{slug}-{hashlib.sha256(out.encode()).hexdigest()[:8]}"


def create_table_artifact(**kwargs) -> None:
    from prefect.artifacts import create_table_artifact as create

    create(**kwargs)


def create_markdown_artifact(**kwargs) -> None:
    from prefect.artifacts import create_markdown_artifact as create

    create(**kwargs)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def plan_artifact(plan: dict, out: str | None = None) -> None:
    """One row per (layer, expert): bytes selected of the expert's bytes, energy captured. The
    expert by its display name (catalog models.name) and its position in the config."""
    rows = [
        {
            "layer": r["layer"],
            "expert": r["name"],
            "position": r["expert"],
            "selected_bytes": int(r["selected_bytes"]),
            "expert_bytes": int(r["expert_bytes"]),
            "energy_captured": round(r["captured_energy"] / r["delta_energy"], 6) if r["delta_energy"] else None,
            "nonfinite_blocks": int(r["nonfinite_blocks"]),
        }
        for r in plan["explain"]
    ]
    publish_artifact(
        create_table_artifact,
        key=artifact_key(PLAN_KEY, out),
        table=rows,
        description=(
            f"Plan {plan['plan_digest'][:16]} ({plan['merge_method']}): {_mib(plan['expert_bytes_planned'])} planned "
            f"of a {_mib(plan['budget_bytes'])} budget (full {_mib(plan['full_expert_bytes'])}), "
            f"error bound {plan['error_bound']:.6g}{'' if plan['bound_guaranteed'] else ' (heuristic)'}"
        ),
    )


def _link(uri: str) -> str:
    return uri if is_remote(uri) else f"file://{uri}"


def summary_artifact(result: dict, out: str | None = None) -> None:
    lines = [
        f"### {result['kind']} {result['digest'][:16]}",
        "",
        "| | |",
        "|---|---|",
        f"| digest | `{result['digest']}` |",
        f"| merge method | {result['merge_method']} |",
        f"| output | [{result['out']}]({_link(result['out'])}) |",
        f"| manifest | [{result['manifest']}]({_link(result['manifest'])}) |",
        f"| budget | {_mib(result['budget_bytes'])} of {_mib(result['full_expert_bytes'])} |",
        f"| expert bytes planned | {result['expert_bytes_planned']} |",
        f"| expert bytes read | {result['expert_bytes_read']} |",
        f"| error bound | {result['error_bound']:.6g}{'' if result['bound_guaranteed'] else ' (heuristic)'} |",
        f"| wall time | {result['wall_seconds']:.1f} s |",
        f"| resumed layer groups | {', '.join(result['resumed_groups']) or 'none'} |",
    ]
    publish_artifact(
        create_markdown_artifact,
        key=artifact_key(SUMMARY_KEY, out),
        markdown="\n".join(lines),
        description=f"{result['kind']} {result['digest'][:16]}",
    )
