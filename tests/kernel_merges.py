"""Merge one family with every method, at full budget and at 30%, and again under a small memory
budget (TIES and slerp over windows of rows, linear in streamed runs), in this process's CPU
kernel set; print the digests as JSON.

    python -m tests.kernel_merges FAMILY_JSON WORK_DIR

test_kernels.py runs it once per kernel set (ATEN_CPU_CAPABILITY) on a family it made once:
torch's own random draws differ between kernel sets, so the family cannot be made again in
each process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from tests.test_operator_pipeline import CASES as ADDED_FOR_MERGEKIT

# method: (per-model parameters, experts, shared parameters); every method mergepipe has: the
# original ones, those added for mergekit (as test_operator_pipeline merges them), passthrough.
CASES = {
    "linear": ({}, 3, {}),
    "task_arithmetic": ({}, 3, {}),
    "ties": ({"density": 0.6}, 3, {}),
    "dare_linear": ({"density": 0.6}, 3, {}),
    "dare_ties": ({"density": 0.6}, 3, {}),
    **ADDED_FOR_MERGEKIT,
    "passthrough": ({}, 0, {"scale": 0.5}),
}
BUDGETS = ("100%", "30%")
SMALL_MEMORY = ("ties", "slerp", "linear")  # windows of rows in passes; streamed runs of elements


def write_config(path: Path, family: dict, method: str) -> Path:
    from mergepipe.operators import OPERATORS

    per_model, k, shared = CASES[method]
    takes_weight = OPERATORS[method].declared("weight") is not None
    models = [
        {"model": e, "parameters": {**per_model, **({"weight": w} if takes_weight else {})}}
        for e, w in zip(family["experts"][:k], [0.6, 0.9, 0.4])
    ]
    cfg = {"merge_method": method, "base_model": family["base"], "parameters": shared, "block_size": "2KiB"}
    if method == "passthrough":
        cfg = {"merge_method": method, "models": [{"model": family["base"], "parameters": shared}]}
    else:
        cfg["models"] = models
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run(family: dict, work: Path) -> dict:
    from mergepipe.execute import memory, streamed, windowed
    from mergepipe.flows.merge import merge
    from mergepipe.operators import slabs
    from mergepipe.operators.kernels import kernel_set

    catalog = str(work / "catalog.duckdb")
    digests: dict[str, str] = {}
    for method in CASES:
        cfg = write_config(work / f"{method}.yaml", family, method)
        for budget in BUDGETS:
            if method == "passthrough" and budget != "100%":
                continue
            out = merge(config=str(cfg), out=str(work / f"{method}-{budget[:-1]}"), budget=budget, catalog=catalog)
            digests[f"{method}@{budget}"] = out["digest"]
    # Windows of a few slabs each, every tensor's share below its whole size.
    slabs.SLAB_ELEMENTS, memory.PROCESS_BYTES, memory.MIN_SLAB_ELEMENTS = 256, 0, 64
    forms = {"windowed": 0, "streamed": 0}
    real_windows, real_streamed = windowed.merge_windows, streamed.merge_streamed

    def windows_spy(g, windows):
        done = real_windows(g, windows)
        forms["windowed"] += bool(done and len(windows.rows) > 1)
        return done

    def streamed_spy(g, reads):
        forms["streamed"] += 1
        return real_streamed(g, reads)

    windowed.merge_windows, streamed.merge_streamed = windows_spy, streamed_spy
    for method in SMALL_MEMORY:
        cfg = work / f"{method}.yaml"
        out = merge(config=str(cfg), out=str(work / f"{method}-small"), budget="100%", catalog=catalog, memory="48KiB")
        digests[f"{method}@100%/small-memory"] = out["digest"]
    return {"kernels": kernel_set(), "digests": digests, "forms": forms}


if __name__ == "__main__":
    family_json, work_dir = sys.argv[1:3]
    result = run(json.loads(Path(family_json).read_text()), Path(work_dir))
    print(json.dumps(result))
