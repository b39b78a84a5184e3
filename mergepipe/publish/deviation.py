"""How far a merge lies from another: ‖θ̂ − θ_full‖_F, relative to ‖θ_full‖_F and to the full
merge's own distance from the base, ‖θ_full − θ₀‖_F. Tensors are streamed in row chunks, so
memory stays at a few chunks whatever the model size; sums run in fp64 and are added exactly."""

from __future__ import annotations

import math

from mergepipe import torch
from mergepipe.errors import BadInput
from mergepipe.index.blocks import block_rows, byte_range
from mergepipe.plan.record import InputModel
from mergepipe.storage.location import join
from mergepipe.storage.model_files import ModelFiles, read_models
from mergepipe.storage.reader import RangeReader
from mergepipe.storage.safetensors_format import DTYPES, decode

CHUNK_BYTES = 64 << 20


def _chunks(model: ModelFiles | InputModel, name: str, reader: RangeReader, role: str):
    loc = model.tensors[name]
    shape, dtype = tuple(loc.shape), loc.dtype
    itemsize = DTYPES[dtype].itemsize
    width = math.prod(shape[1:]) if len(shape) > 1 else 1
    path = join(model.root, loc.file)
    for r0, r1 in block_rows(shape, itemsize, CHUNK_BYTES):
        start, end = byte_range(loc.start, shape, itemsize, r0, r1)
        # Counted as a verification read (this reader's ledger is not part of any merge's).
        raw = reader.read(path, start, end, role="checksum", model=role, file=loc.file)
        values = decode(raw, dtype, (r1 - r0, width) if len(shape) else ()).to(torch.float64, copy=True)
        reader.release([raw])
        yield values


def deviation(merged_uri: str, full_uri: str, base: str | InputModel) -> dict:
    """Frobenius distance of `merged` from `full` over the floating-point tensors, and the two
    ratios. The three models must share tensor names and shapes. `base`: a model's location, or
    a plan's base input (its tensors where that plan read them: a view, for slices)."""
    with RangeReader() as reader:
        wanted = [(merged_uri, "merged"), (full_uri, "full")] + ([(base, "base")] if isinstance(base, str) else [])
        merged, full, *read = read_models(wanted, reader)
        base = read[0] if read else base
        diff_sq, full_sq, delta_sq = [], [], []
        for name in sorted(full.tensors):
            if not DTYPES[full.tensors[name].dtype].is_float:
                continue
            for who in (merged, base):
                if name not in who.tensors or who.tensors[name].shape != full.tensors[name].shape:
                    raise BadInput(f"{who.uri}: tensor {name!r} is missing or has another shape than in {full.uri}")
            for m, f, b in zip(
                _chunks(merged, name, reader, "merged"),
                _chunks(full, name, reader, "full"),
                _chunks(base, name, reader, "base"),
            ):
                diff_sq.append(float(((m - f) ** 2).sum()))
                full_sq.append(float((f**2).sum()))
                delta_sq.append(float(((f - b) ** 2).sum()))
    diff, norm_full, norm_delta = (math.sqrt(math.fsum(v)) for v in (diff_sq, full_sq, delta_sq))
    return {
        "deviation": diff,
        "relative_to_full": diff / norm_full if norm_full else 0.0,
        "relative_to_delta": diff / norm_delta if norm_delta else 0.0,
        "full_norm": norm_full,
        "full_delta_norm": norm_delta,
    }
