"""Small helpers shared by tests."""

from __future__ import annotations

import math
import os
import subprocess
import time
from pathlib import Path
from typing import Callable, TypeVar

import torch

from mergepipe.devtools.synthetic import FamilyPaths, make_family, write_config, write_model

from .reference import load_model

T = TypeVar("T")

# How long a test waits for something a process or server must do before it is taken for
# never happening: far beyond what it takes on an idle machine, so that a busy one (2 cores
# and another CPU-heavy process beside the suite) still gets there; below pytest-timeout's
# per-test limit (pyproject), so a test that waits in vain fails saying what it waited for.
START_S = 300  # a server, worker or other process to start (or to stop)
EVENT_S = 180  # something a running process or server does next (a log line, a row, a file)


def wait_until(
    condition: Callable[[], T],
    deadline_s: float,
    what: str,
    detail: Callable[[], object] | None = None,
    every: float = 0.2,
) -> T:
    """Poll `condition` every `every` s until it returns something true, and return that. After
    `deadline_s` s, fail saying `what` was awaited (and `detail()`, such as a log's tail).
    Wait on the condition itself, never on a fixed sleep: a loaded machine is slow, not wrong."""
    deadline = time.monotonic() + deadline_s
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"waited {deadline_s:g} s for {what}, in vain{extra}")
        time.sleep(every)


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


# mergekit uses torch's kernels as they come (fused multiply-adds on AVX, reductions grouped by
# SIMD width, SLEEF's exp and sin), so its bits change with the CPU; mergepipe's do not
# (docs/operators.md, "The same bytes on every CPU"). Outputs are compared with mergekit's within
# this many fp32 ulps of each tensor's magnitude, and mergepipe's own bytes pinned by digests.
MERGEKIT_ULPS = 8


def assert_close_to_mergekit(got: torch.Tensor, want: torch.Tensor, name: str, ulps: int = MERGEKIT_ULPS) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, name
    if torch.equal(got, want) or not want.is_floating_point():
        assert torch.equal(got, want), name
        return
    tol = ulps * torch.finfo(want.dtype).eps * float(want.abs().max())
    assert float((got.double() - want.double()).abs().max()) <= tol, name


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
