"""Record the digests of mergepipe's own outputs on the mergekit fixtures
(tests/data/pinned_digests.json): the operator parity cases (tests/data/mergekit_parity.*) and
the configs mergekit-yaml ran (tests/data/mergekit_e2e), computed under every CPU kernel set
this machine has, each in a process of its own (ATEN_CPU_CAPABILITY set); refuses to write them
unless all kernel sets agree.

    .venv/bin/python scripts/pin_digests.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "pinned_digests.json"


def digests() -> dict[str, dict[str, str]]:
    sys.path.insert(0, str(ROOT))
    from mergepipe.flows.merge import merge
    from mergepipe.operators import OPERATORS, TensorContext
    from tests import test_mergekit_configs as configs
    from tests import test_mergekit_parity as parity

    operators = {c["case"]: parity.bits_sha256(parity.merged(c)) for c in parity.CASES}
    for case in parity.SAMPLED:
        base, x = parity.sampled_inputs(tuple(case["shape"]), case["inputs_seed"])
        op = OPERATORS[case["method"]]
        ctx = TensorContext("model.layers.0.mlp.up_proj.weight", ((0, case["shape"][0]),), seed=0)
        operators[case["case"]] = parity.bits_sha256(op.merge(base, [x], op.params(1), ctx))
    e2e = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in configs.E2E_CASES:
            done = merge(
                config=str(configs.E2E / case["config"]),
                out=f"{tmp}/{case['case']}",
                catalog=f"{tmp}/catalog.duckdb",
            )
            e2e[case["case"]] = done["digest"]
    return {"operators": operators, "mergekit_e2e": e2e}


def main() -> int:
    from mergepipe.operators.kernels import kernel_sets

    runs = {}
    for kernels in kernel_sets():
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MERGEPIPE_ORCHESTRATION")}
        env.update(ATEN_CPU_CAPABILITY=kernels, PREFECT_SERVER_EPHEMERAL_ENABLED="false")
        done = subprocess.run([sys.executable, __file__, "--one"], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        runs[kernels] = json.loads(done.stdout.splitlines()[-1])
    first = next(iter(runs.values()))
    differ = sorted(
        f"{part}/{case}"
        for found in runs.values()
        for part in first
        for case in first[part]
        if found[part][case] != first[part][case]
    )
    if differ:
        print(f"kernel sets {sorted(runs)} disagree on: {', '.join(differ)}", file=sys.stderr)
        return 1
    OUT.write_text(json.dumps(first, indent=1, sort_keys=True) + "\n")
    n = sum(len(v) for v in first.values())
    print(f"{n} digests, equal under {', '.join(runs)}: {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--one"]:
        print(json.dumps(digests()))
        sys.exit(0)
    sys.exit(main())
