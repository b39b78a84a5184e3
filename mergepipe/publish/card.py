"""The output's model card (README.md): Hugging Face metadata, and how the merge was made.

Written from the plan alone, so that a replay writes it again from what it replays. It names
the models where they were read (and the Hub commits), so it lies outside the merge's digest,
which does not depend on where the inputs live: the manifest records its hash in `run`, and
`verify` checks it with the rest.
"""

from __future__ import annotations

import yaml

from mergepipe.config.sizes import format_size
from mergepipe.config.spec import lora_parts, validate_spec
from mergepipe.plan.record import Plan
from mergepipe.storage.hub import commit_of, is_hub, parse
from mergepipe.storage.model_files import MANIFEST_FILE

CARD_FILE = "README.md"
LINK = "https://github.com/mergepipe/mergepipe"


def _hub_id(uri: str) -> str:
    return parse(uri).repo if is_hub(uri) else uri


def model_card(plan: Plan) -> bytes:
    """The card's text: front matter (base_model, library_name, tags), then the method, the
    models (with their pinned commits), the config as given, and the budget, the bytes read,
    the error bound and the plan's digest."""
    spec = validate_spec(plan.spec, source="the plan's spec")
    front = {
        # a LoRA input names its model and its adapter
        "base_model": list(dict.fromkeys(_hub_id(p) for m in spec.model_uris for p in lora_parts(m) if p)),
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
    # The config as a user would write it: the keys left at their defaults left out.
    given = spec.model_dump(by_alias=True, exclude_defaults=True, exclude={"storage_options"})
    if (given.get("tokenizer") or {}).get("tokens"):  # kept as pairs (for their order): shown as written
        given["tokenizer"]["tokens"] = dict(given["tokenizer"]["tokens"])
    config = yaml.safe_dump(given, sort_keys=False).rstrip()
    lines += ["", "## Configuration", "", "```yaml", config, "```", ""]
    share = 100 * plan.expert_bytes_planned / plan.full_expert_bytes if plan.full_expert_bytes else 100.0
    kind = "guaranteed" if plan.bound_guaranteed else "a heuristic: the method is not additive"
    lines += [
        "## What mergepipe read",
        "",
        f"- Budget: {format_size(plan.budget_bytes)} of {format_size(plan.full_expert_bytes)} of expert bytes.",
        f"- Expert bytes read: {format_size(plan.expert_bytes_planned)} ({share:.1f}%), as planned, in "
        f"{plan.n_pairs} (expert, block) pairs of {format_size(plan.block_size)} blocks.",
        f"- Error bound against reading every expert byte: ‖θ̂ − θ_full‖_F ≤ {plan.error_bound:.6g} ({kind}).",
        f"- Plan digest: `{plan.plan_digest}`.",
        "",
        f"`{MANIFEST_FILE}` beside this card holds the merge's digest, the SHA-256 of every file "
        "(this card's too), and what `mergepipe replay` needs to make it again; `mergepipe verify` "
        "checks the files against it.",
        "",
    ]
    return "\n".join(lines).encode()
