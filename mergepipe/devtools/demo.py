"""`mergepipe demo`: a small family merged end to end on local disk, no server needed."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from mergepipe.flows.index_family import index_family
from mergepipe.flows.merge import merge, plan
from mergepipe.flows.orchestration import run_flow
from mergepipe.publish.manifest import verify_output
from mergepipe.devtools.synthetic import make_family, write_config


def _load_output(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            tensors.update({k: h.get_tensor(k).clone() for k in h.keys()})
    return tensors


def deviation(a: Path, b: Path) -> float:
    """‖a − b‖_F over all float tensors of two outputs, in fp64."""
    ta, tb = _load_output(a), _load_output(b)
    total = math.fsum(
        float(((ta[k].double() - tb[k].double()) ** 2).sum()) for k in ta if ta[k].is_floating_point()
    )
    return math.sqrt(total)


def run_demo(out: Path, echo: Callable[[str], None] | None = None) -> dict:
    say = echo or (lambda _msg: None)
    out = Path(out).resolve()
    family_dir = out / "family"
    if not (family_dir / "base").exists():
        say(f"building a family of 1 base + 3 experts (2 dense fine-tunes, 1 LoRA-style) in {family_dir}")
        family = make_family(family_dir, experts=("dense", "dense", "lora"), n_layers=4, hidden=256, intermediate=512, vocab=1024)
    else:
        from mergepipe.devtools.synthetic import FamilyPaths

        family = FamilyPaths(family_dir / "base", sorted(p for p in family_dir.iterdir() if p.name.startswith("expert-")))
    config = write_config(
        out / "merge.yaml", family, "task_arithmetic",
        weights=[0.5, 0.3, 0.8], block_size="64KiB", out_shard_size="4MB", out_dtype="float32",
    )
    catalog = str(out / "catalog.duckdb")

    idx = run_flow(index_family, config=str(config), catalog=catalog)
    say(f"index: {len(idx['indexed_now'])} expert(s) indexed now, {len(idx['already_indexed'])} cached; "
        f"read {idx['bytes']['expert'] / 2**20:.2f} MiB of experts")
    p = run_flow(plan, config=str(config), budget="25%", catalog=catalog)
    say(f"plan at 25%: {p['expert_bytes_planned'] / 2**20:.2f} of {p['full_expert_bytes'] / 2**20:.2f} MiB, "
        f"{p['pairs']} (expert, block) pairs, error bound {p['error_bound']:.4g}")

    results = {}
    for label, budget in (("full", "100%"), ("25pct", "25%")):
        r = run_flow(merge, config=str(config), out=str(out / f"merged-{label}"), budget=budget, overwrite=True, catalog=catalog)
        v = verify_output(r["out"])
        results[label] = {**r, "verified": v.ok}
        say(f"merge at {budget}: read {r['expert_bytes_read'] / 2**20:.2f} MiB of experts "
            f"(planned {r['expert_bytes_planned'] / 2**20:.2f}), digest {r['digest'][:16]}…, verify {'ok' if v.ok else 'FAILED'}")
    measured = deviation(out / "merged-25pct", out / "merged-full")
    bound = results["25pct"]["error_bound"]
    say(f"‖θ̂(25%) − θ(full)‖_F = {measured:.4g} ≤ bound {bound:.4g}: {'yes' if measured <= bound * (1 + 1e-6) else 'NO'}")
    return {"out": str(out), "index": idx, "merges": results, "measured_deviation": measured, "error_bound": bound}
