"""Small helpers shared by tests."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mergepipe.synthetic import FamilyPaths, make_family, write_config, write_model

from .reference import load_model


def config_for(tmp: Path, family: FamilyPaths, method: str, *, weights=None, density=None, name="merge.yaml", **extra) -> Path:
    extra.setdefault("block_size", "4KiB")
    extra.setdefault("out_shard_size", "64KB")
    return write_config(tmp / name, family, method, weights=weights or [0.5, 0.3, 0.8], density=density, **extra)


def frobenius_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return math.sqrt(
        math.fsum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a if a[k].is_floating_point())
    )


def assert_bit_identical(out_dir: Path, expected: dict[str, torch.Tensor]) -> None:
    got = load_model(out_dir)
    assert sorted(got) == sorted(expected)
    for k in expected:
        assert got[k].dtype == expected[k].dtype, k
        assert got[k].shape == expected[k].shape, k
        a = got[k].contiguous().reshape(-1).view(torch.uint8)
        b = expected[k].contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{k}: bytes differ"


def tiny_family(root: Path) -> FamilyPaths:
    """One dense expert, one layer, one shard: for tests that damage the expert."""
    return make_family(root, experts=("dense",), n_layers=1, hidden=32, intermediate=64, vocab=64, shards=1)


def replace_model(folder: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """Rewrite a model folder in place with other tensors (new content, same location)."""
    import shutil

    shutil.rmtree(folder)
    write_model(folder, tensors, shards=shards, sidecars=False)
