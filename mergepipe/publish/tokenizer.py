"""The output's tokenizer where its vocabulary is built (tokenizer_source, tokenizer:): made again
from the inputs' tokenizer files as the plan's views were (index/vocabulary), saved by
transformers as mergekit saves it, and config.json's vocab_size set to the output's rows."""

from __future__ import annotations

import json
import os
import tempfile

from mergepipe.config.spec import validate_spec
from mergepipe.config.views import input_views
from mergepipe.index.family import model_tokenizers
from mergepipe.index.vocabulary import build_tokenizer
from mergepipe.plan.record import Plan
from mergepipe.storage.model_files import ModelFiles
from mergepipe.storage.staging import Staging


def vocabulary_rows(plan: Plan) -> int | None:
    """The output's vocabulary rows where the plan maps the inputs' rows to a built vocabulary
    (None: the base's vocabulary, as it is)."""
    for recipe in plan.inputs[0].virtual.values():
        if recipe.get("kind") == "vocab":
            return recipe["place"][2][0]
    return None


def write_tokenizer(plan: Plan, staging: Staging, template: str | None) -> list[dict]:
    """The built tokenizer's files into staging (with `template` as its chat template, where
    one is chosen); returns their entries (file, size, sha256). Their bytes depend on the
    transformers version that saved them, so the manifest keeps them outside the digest."""
    spec = validate_spec(plan.spec, source="the plan's spec")
    views = input_views(spec)
    homes = [
        ModelFiles(uri=v.home, root=i.root, shards=[], sidecars=list(i.sidecars))
        for v, i in zip(views.all, plan.inputs)
    ]
    tokenizers, sizes = model_tokenizers(homes)
    out, _ = build_tokenizer(views.vocabulary, [v.home for v in views.all], 0, tokenizers, sizes)
    if template is not None:
        out.chat_template = template
    entries = []
    with tempfile.TemporaryDirectory(prefix="mergepipe-tokenizer-") as folder:
        out.save_pretrained(folder)
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), "rb") as f:
                staging.put(name, f.read())
            digest, size = staging.sha256(name)
            entries.append({"file": name, "size": size, "sha256": digest})
    return entries


def with_vocab_size(config: bytes, rows: int) -> bytes:
    """A config.json that states the output's vocabulary rows where the base's states its own
    (top level, or a multimodal model's text_config)."""
    try:
        data = json.loads(config)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return config
    if not isinstance(data, dict):
        return config
    for holder in (data, data.get("text_config")):
        if isinstance(holder, dict) and isinstance(holder.get("vocab_size"), int):
            holder["vocab_size"] = rows
            break
    return (json.dumps(data, indent=2) + "\n").encode()
