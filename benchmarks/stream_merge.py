"""The plain full-read baseline: read every tensor of the base and of every expert whole
(safetensors, memory-mapped), apply the same operator with the same per-tensor parameters,
write one safetensors file. No catalog, no plan, no Prefect: what a careful script does.

    .venv/bin/python benchmarks/stream_merge.py CONFIG OUT_FOLDER
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mergepipe.config.spec import load_spec
from mergepipe.index.blocks import block_rows, layer_count, layer_position
from mergepipe.operators import OPERATORS, TensorContext
from mergepipe.plan.params import resolve_params


def _open(folder: str):
    files = sorted(Path(folder).glob("*.safetensors"))
    handles = [safe_open(str(f), framework="pt") for f in files]
    return {name: h for h in handles for name in h.keys()}


def stream_merge(config: str, out: str) -> None:
    spec = load_spec(config)
    op = OPERATORS[spec.merge_method]
    base = _open(spec.base_model)
    experts = [_open(u) for u in spec.expert_uris]
    names = sorted(base)
    n_layers = layer_count(names)
    merged = {}
    for name in names:
        b = base[name].get_tensor(name)
        if not b.is_floating_point():
            merged[name] = b
            continue
        params = resolve_params(spec, name, layer_position(name, n_layers))
        ctx = TensorContext(name, tuple(block_rows(tuple(b.shape), b.element_size(), spec.block_size_bytes)), spec.seed)
        xs = [e[name].get_tensor(name).float() for e in experts]
        merged[name] = op.merge(b.float(), xs, params, ctx).to(b.dtype)
        del xs
    Path(out).mkdir(parents=True, exist_ok=True)
    save_file(merged, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    torch.set_num_threads(max(1, len(__import__("os").sched_getaffinity(0))))
    stream_merge(sys.argv[1], sys.argv[2])
