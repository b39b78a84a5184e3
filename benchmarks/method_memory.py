"""What the methods merged whole hold at their peak, per element, against the memory plan's
estimate (execute/memory.py: the operator's work_buffers_per_expert, or for an elementwise one
its elementwise_temporaries).

    .venv/bin/python benchmarks/method_memory.py [--elements 4000000] [--runs 3]

Each method merges one fp32 tensor of --elements elements (K = 3 experts, 1 for the methods
that take one) in a fresh process; the figure is the growth of peak RSS during the merge, per
element, beside the estimate of what the merge adds to the base and the experts' fp32 values
(and its fp32 output). RSS moves with the allocator: the largest of --runs is printed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

METHODS = {
    "ram": (3, {}),
    "ramplus_tl": (3, {}),
    "sce": (3, {"select_topk": 0.5}),
    "karcher": (3, {}),
    "multislerp": (3, {"weight": (0.5, 0.5, 0.5)}),
    "arcee_fusion": (1, {}),
    "nearswap": (1, {"t": 0.001}),
    "model_stock": (3, {}),
}

CHILD = """
import gc, resource, sys
import torch
from mergepipe.operators import OPERATORS, TensorContext
method, k, n, params = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), eval(sys.argv[4])
op = OPERATORS[method]
torch.manual_seed(0)
base = torch.randn(2000, n // 2000) * 0.02
experts = [base + torch.randn_like(base) * 0.002 for _ in range(k)]
p, ctx = op.params(k, **params), TensorContext("t", ((0, 2000),), seed=0)
gc.collect()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
op.merge(base, experts, p, ctx)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before) / base.numel())
"""


def estimate(method: str, k: int) -> float:
    """Bytes per element the memory plan counts beyond the fp32 base and experts' values."""
    from mergepipe.operators import OPERATORS

    op = OPERATORS[method]
    if op.elementwise:
        return 4 * (3 + op.elementwise_temporaries) - 8 + 4  # less the base and the expert, plus the output
    return 4 * (3 + op.work_buffers_per_expert * k) - 4 * k + 4  # less the experts' values, plus the output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=4_000_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"{'method':14s} {'K':>2s} {'measured B/elt':>15s} {'estimate B/elt':>15s}")
    for method, (k, params) in METHODS.items():
        runs = [
            float(
                subprocess.check_output([sys.executable, "-c", CHILD, method, str(k), str(args.elements), repr(params)])
            )
            for _ in range(args.runs)
        ]
        print(f"{method:14s} {k:2d} {max(runs):15.1f} {estimate(method, k):15.1f}")


if __name__ == "__main__":
    main()
