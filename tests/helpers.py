"""Small helpers shared by tests."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import torch

from mergepipe.devtools.synthetic import FamilyPaths, make_family, write_config, write_model

from .reference import load_model


def config_for(
    tmp: Path, family: FamilyPaths, method: str, *, weights=None, density=None, name="merge.yaml", **extra
) -> Path:
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


# Invariants a crash must never break. Each query lists what breaks one; a consistent catalog
# gives no rows for any of them.
CATALOG_INVARIANTS = {
    "a stat_sets row whose block_stats are missing or incomplete": """
        SELECT ss.expert_fp FROM stat_sets ss
        LEFT JOIN (SELECT base_fp, expert_fp, block_size, count(*) AS n, sum(bytes) AS b FROM block_stats GROUP BY ALL) s
            USING (base_fp, expert_fp, block_size)
        WHERE coalesce(s.n, 0) <> ss.n_blocks OR coalesce(s.b, 0) <> ss.bytes""",
    "block_stats without a stat_sets row": """
        SELECT DISTINCT expert_fp FROM block_stats ANTI JOIN stat_sets USING (base_fp, expert_fp, block_size)""",
    "block_stats of a block the layout lacks": """
        SELECT expert_fp FROM block_stats ANTI JOIN blocks USING (base_fp, block_size, tensor, block)""",
    "statistics of a model that is not registered": """
        SELECT expert_fp FROM stat_sets ANTI JOIN models ON model_fp = expert_fp
        UNION ALL SELECT base_fp FROM stat_sets ANTI JOIN models ON model_fp = base_fp""",
    "a model without files, tensors or content digest": """
        SELECT model_fp FROM models WHERE content_sha256 IS NULL
            OR model_fp NOT IN (SELECT model_fp FROM model_files) OR model_fp NOT IN (SELECT model_fp FROM tensors)""",
    "a plan without its experts or its whole access set": """
        SELECT plan_digest FROM plans p
        WHERE n_pairs <> (SELECT count(*) FROM access_sets a WHERE a.plan_digest = p.plan_digest)
            OR NOT EXISTS (SELECT 1 FROM plan_experts e WHERE e.plan_digest = p.plan_digest)""",
    "a run without its manifest": "SELECT run_id FROM runs WHERE merge_digest NOT IN (SELECT merge_digest FROM manifests)",
}


def catalog_problems(where: Path | str) -> list[str]:
    """What breaks the invariants in a catalog file or a shared catalog (postgresql://…)."""
    from mergepipe.catalog import db

    if "://" not in str(where) and not Path(where).exists():
        return []
    with db.connect(where, read_only=True) as con:
        return [f"{what}: {rows[:3]}" for what, q in CATALOG_INVARIANTS.items() if (rows := con.execute(q).fetchall())]


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache (flushed first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_bytes(path: Path) -> int:
    """Bytes of the file in the page cache (fincore)."""
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return int(out[0])


def saved_plan(result: dict, catalog: str | None = None):
    """The plan (and its output layout) that a plan or merge result names, from its catalog."""
    from mergepipe.config.environment import catalog_location
    from mergepipe.plan import saved

    return saved.load(saved.PlanRef(result["plan_key"], catalog_location(catalog)))
