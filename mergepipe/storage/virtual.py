"""Tensors no file holds as they are, made when read from the bytes they need: a weight a LoRA
adapter changes (storage.adapters), a model's vocabulary-indexed tensor on the output's rows
(storage.vocab_rows). A view gives each one a file name, its recipe's; the recipe is registered
under it in every process that reads it (from the view, or from the plan's inputs)."""

from __future__ import annotations

import threading

from mergepipe.storage.adapters import PREFIX as LORA
from mergepipe.storage.adapters import LoraTensor
from mergepipe.storage.vocab_rows import PREFIX as VOCAB
from mergepipe.storage.vocab_rows import VocabTensor

KINDS = {"lora": LoraTensor, "vocab": VocabTensor}

_recipes: dict[str, LoraTensor | VocabTensor] = {}
_lock = threading.Lock()


def is_virtual(file: str) -> bool:
    return file.startswith((LORA, VOCAB))


def register(recipe: LoraTensor | VocabTensor) -> str:
    """Make the recipe readable by its name in this process; returns the name."""
    name = recipe.name
    with _lock:
        _recipes.setdefault(name, recipe)
    return name


def recipe(file: str) -> LoraTensor | VocabTensor:
    with _lock:
        found = _recipes.get(file)
    if found is None:
        raise KeyError(f"{file}: no recipe of that name in this process")
    return found


def from_json(data: dict) -> LoraTensor | VocabTensor:
    return KINDS[data["kind"]].from_json(data)
