"""An independent full-read reference merge: every tensor loaded whole with safetensors, the
operator's formula applied directly (mergekit 0.1.5 semantics, fp32, sequential sums)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open


def load_model(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k).clone()
    return out


def _seed(seed: int, expert: int, tensor: str, block: int) -> int:
    # The documented seeding contract: SHA-256 of "seed/expert/tensor/block", first 8 bytes LE, 63 bits.
    h = hashlib.sha256(f"{seed}/{expert}/{tensor}/{block}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def _block_rows(shape, itemsize, block_size):
    if len(shape) == 0:
        return [(0, 1)]
    if math.prod(shape) == 0:
        return []
    if len(shape) == 1:
        return [(0, shape[0])]
    per = max(1, block_size // (math.prod(shape[1:]) * itemsize))
    return [(r, min(r + per, shape[0])) for r in range(0, shape[0], per)]


def dare_mask(tau, density, seed, expert, name, base_dtype, block_size):
    rows = tau.reshape(tau.shape[0], -1) if tau.dim() else tau.reshape(1, 1)
    mask = torch.zeros(rows.shape, dtype=torch.bool)
    for b, (r0, r1) in enumerate(_block_rows(tuple(tau.shape), base_dtype.itemsize, block_size)):
        g = torch.Generator().manual_seed(_seed(seed, expert, name, b))
        mask[r0:r1] = torch.rand((r1 - r0, rows.shape[1]), generator=g, dtype=torch.float32) < density
    return mask.reshape(tau.shape)


def topk_mask(tau, density):
    flat = tau.reshape(-1).abs()
    n = flat.numel()
    k = max(1, int(density * n))
    if k >= n:
        return torch.ones_like(tau, dtype=torch.bool)
    order = torch.argsort(flat, descending=True, stable=True)  # ties: lowest index first
    mask = torch.zeros(n, dtype=torch.bool)
    mask[order[:k]] = True
    return mask.reshape(tau.shape)


def l1_rescale(orig, pruned):
    # fp64 pairwise sums (numpy), as the documented contract for the rescale factor.
    a = float(np.abs(orig.numpy()).sum(dtype=np.float64))
    b = float(np.abs(pruned.numpy()).sum(dtype=np.float64))
    if a < 1e-7 or b < 1e-7:
        return pruned
    return pruned * torch.tensor(a / b, dtype=torch.float32)


def den_of(weights):
    d = np.float32(0)
    for w in weights:  # in order, in fp32
        d = np.float32(d + np.float32(w))
    d = float(d)
    return 1.0 if abs(d) < 1e-8 else d


def merge_tensor(
    method,
    name,
    base,
    experts,
    weights,
    densities,
    lam,
    normalize,
    rescale,
    seed,
    base_dtype,
    block_size,
    compute_dtype=None,
):
    def load(t):
        return (t.to(compute_dtype) if compute_dtype is not None else t).float()

    b = load(base)
    xs = [load(x) for x in experts]
    if method == "linear":
        acc = torch.zeros_like(b)
        for w, x in zip(weights, xs):
            acc += x * torch.tensor(w, dtype=torch.float32)  # each product rounded, then added
        return acc / den_of(weights) if normalize else acc
    deltas = []
    for i, x in enumerate(xs):
        tau = x - b
        d = densities[i]
        if method == "ties" and d < 1.0 and tau.numel():
            tau = tau * topk_mask(tau, d).float()
            if rescale:
                tau = l1_rescale(x - b, tau)
        elif method.startswith("dare") and d < 1.0 and tau.numel():
            kept = tau * dare_mask(tau, d, seed, i, name, base_dtype, block_size).float()
            tau = l1_rescale(x - b, kept) if rescale else kept
        deltas.append(tau * weights[i])
    if method in ("ties", "dare_ties"):
        total = torch.zeros_like(b)
        for d in deltas:
            total = total + d
        pos = total >= 0
        num, den = torch.zeros_like(b), torch.zeros_like(b)
        for i, d in enumerate(deltas):
            agree = torch.where(pos, d > 0, d < 0).float()
            num = num + d * agree
            den = den + agree * weights[i]
        den = torch.where(den == 0, torch.ones_like(den), den)
        mixed = num / den if normalize else num
    else:
        num = torch.zeros_like(b)
        for d in deltas:
            num = num + d
        mixed = num / den_of(weights) if normalize else num
    return b + mixed * lam


DEFAULTS = {  # (normalize, rescale) per method, mergekit 0.1.5
    "linear": (True, False),
    "task_arithmetic": (False, False),
    "ties": (True, False),
    "dare_linear": (False, True),
    "dare_ties": (False, True),
}


def reference_merge(
    method,
    base_dir,
    expert_dirs,
    weights,
    densities=None,
    lam=1.0,
    seed=0,
    block_size=2**20,
    out_dtype=None,
    compute_dtype=None,
):
    base = load_model(base_dir)
    experts = [load_model(e) for e in expert_dirs]
    densities = densities or [1.0] * len(expert_dirs)
    normalize, rescale = DEFAULTS[method]
    out = {}
    for name, t in base.items():
        if not t.is_floating_point():
            out[name] = t
            continue
        merged = merge_tensor(
            method,
            name,
            t,
            [e[name] for e in experts],
            weights,
            densities,
            lam,
            normalize,
            rescale,
            seed,
            t.dtype,
            block_size,
            compute_dtype,
        )
        out[name] = merged.to(out_dtype or compute_dtype or t.dtype)
    return out
