"""The output's model card (README.md): Hugging Face metadata, and how the merge was made.

Written from the plan alone, so that a replay writes it again from what it replays. It names
the models where they were read (and the Hub commits), so it lies outside the merge's digest,
which does not depend on where the inputs live: the manifest records its hash in `run`, and
`verify` checks it with the rest.
"""

from __future__ import annotations

import yaml

from mergepipe.config.spec import MergeSpec, validate_spec
from mergepipe.plan.record import Plan
from mergepipe.storage.hub import commit_of, is_hub, parse
from mergepipe.storage.model_files import MANIFEST_FILE

CARD_FILE = "README.md"
LINK = "https://github.com/mergepipe/mergepipe"


def _models(spec: dict) -> list[str]:
    """The models a config names (the base first, each once), as Hub ids where on the Hub."""
    named = validate_spec(spec, source="the plan's spec").model_uris
    return list(dict.fromkeys(parse(m).repo if is_hub(m) else m for m in named))


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _pruned(value):
    """Without the keys a config leaves unset (None, or an empty mapping once pruned)."""
    if isinstance(value, dict):
        kept = {k: _pruned(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not None and v != {}}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def as_given(spec: dict) -> dict:
    """The recorded spec as a config would say it: the keys left at their defaults left out."""
    defaults = {
        k: f.get_default(call_default_factory=True) for k, f in MergeSpec.model_fields.items() if not f.is_required()
    }
    return _pruned({k: v for k, v in spec.items() if not (k in defaults and v == defaults[k])})


def model_card(plan: Plan) -> bytes:
    """The card's text: front matter (base_model, library_name, tags), then the method, the
    models (with their pinned commits), the config as given, and the budget, the bytes read,
    the error bound and the plan's digest."""
    front = {
        "base_model": _models(plan.spec),
        "base_model_relation": "merge",
        "library_name": "transformers",
        "tags": ["merge", "mergepipe"],
    }
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", ""]
    lines += [
        "# Merged model",
        "",
        f"This model was merged with [mergepipe]({LINK}), `{plan.merge_method}` method.",
        "",
        "## Models",
        "",
    ]
    for i in plan.inputs:
        commit = commit_of(i.root)
        where = f"`{i.uri}`" + (f" at commit `{commit}`" if commit else "")
        lines.append(f"- {i.role}: {where}")
    config = yaml.safe_dump(as_given(plan.spec), sort_keys=False).rstrip()
    lines += ["", "## Configuration", "", "```yaml", config, "```", ""]
    share = 100 * plan.expert_bytes_planned / plan.full_expert_bytes if plan.full_expert_bytes else 100.0
    kind = "guaranteed" if plan.bound_guaranteed else "a heuristic: the method is not additive"
    lines += [
        "## What mergepipe read",
        "",
        f"- Budget: {_size(plan.budget_bytes)} of {_size(plan.full_expert_bytes)} of expert bytes.",
        f"- Expert bytes read: {_size(plan.expert_bytes_planned)} ({share:.1f}%), as planned, in "
        f"{plan.n_pairs} (expert, block) pairs of {_size(plan.block_size)} blocks.",
        f"- Error bound against reading every expert byte: ‖θ̂ − θ_full‖_F ≤ {plan.error_bound:.6g} ({kind}).",
        f"- Plan digest: `{plan.plan_digest}`.",
        "",
        f"`{MANIFEST_FILE}` beside this card holds the merge's digest, the SHA-256 of every file "
        "(this card's too), and what `mergepipe replay` needs to make it again; `mergepipe verify` "
        "checks the files against it.",
        "",
    ]
    return "\n".join(lines).encode()
