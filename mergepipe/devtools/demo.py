"""The demo's family: a base, two dense fine-tunes and one LoRA-style expert, and the config
that merges them (task arithmetic). `mergepipe demo` builds it here and runs the flows itself."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from mergepipe.devtools.synthetic import FamilyPaths, make_family, write_config


def demo_config(out: Path, say: Callable[[str], None]) -> Path:
    """The family under out/family (built once, reused after) and its config, out/merge.yaml."""
    family_dir = out / "family"
    if not (family_dir / "base").exists():
        say(f"building a family of 1 base + 3 experts (2 dense fine-tunes, 1 LoRA-style) in {family_dir}")
        family = make_family(
            family_dir, experts=("dense", "dense", "lora"), n_layers=4, hidden=256, intermediate=512, vocab=1024
        )
    else:
        family = FamilyPaths(
            family_dir / "base", sorted(p for p in family_dir.iterdir() if p.name.startswith("expert-"))
        )
    return write_config(
        out / "merge.yaml",
        family,
        "task_arithmetic",
        weights=[0.5, 0.3, 0.8],
        block_size="64KiB",
        out_shard_size="4MB",
        out_dtype="float32",
    )
