#!/usr/bin/env python3
"""Generate mergekit 0.1.5 reference outputs for mergepipe's operator parity tests.

What it does: builds small fp32 inputs from a fixed seed (a base ~ N(0, 0.02) and K = 2 or 3
experts = base + deltas of ~0.002, some rows of some experts exactly equal to the base, one
expert exactly equal to the base, one expert that is all zeros), merges them with mergekit's
in-memory API (`mergekit.merge_methods.merge_tensors`) and writes

    tests/data/mergekit_parity.safetensors   inputs, DARE/DELLA masks and probabilities, outputs
    tests/data/mergekit_parity.json          one record per case (method, parameters, shape, ...)

Tensor names are `<case>/base`, `<case>/x<i>` (experts in the order mergekit got them),
`<case>/out`, and for the random methods `<case>/mask<i>` (the 0/1 keep-mask mergekit drew for
expert i) and, for della/della_linear, `<case>/probs<i>` (the keep probabilities it drew them
from). All fp32. `inputs` in a JSON record lists, in order, the tensors mergekit received;
`base_index` indexes that list (null: no base was given to mergekit).

Random masks are captured by replacing the `torch` name inside `mergekit.sparsify` (the only
module of mergekit that calls `torch.bernoulli`) with a proxy whose `bernoulli` records each
returned mask. Before anything is written the script checks that every case is reproducible:
random cases are re-run with the recorded masks replayed (under a different RNG seed) and must
give the same output bit for bit; deterministic cases are run twice and must agree bit for bit.
Any mismatch aborts without writing.

How to run, from any python (e.g. the project's `.venv/bin/python`):

    python scripts/mergekit_parity.py            # write the fixtures
    python scripts/mergekit_parity.py --check    # regenerate in memory, compare with the files

Without mergekit importable it uses the interpreter in `$MERGEKIT_PYTHON` if set (it must have
mergekit 0.1.5), otherwise it creates `.venv-mergekit/` at the repository root (CPU torch
2.13.0 first, or `$MERGEKIT_TORCH`; then mergekit==0.1.5) and re-runs itself there with
`--generate`.

Licensing: mergekit is LGPL-3.0. It is used only as an oracle, installed in its own venv and
imported only by this script; mergepipe and its tests never import it (the tests read the two
fixture files). No mergekit code is copied here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-mergekit"
DEFAULT_OUT = ROOT / "tests" / "data"
STEM = "mergekit_parity"
MERGEKIT_VERSION = "0.1.5"
TORCH_REQUIREMENT = os.environ.get("MERGEKIT_TORCH", "torch==2.13.0")
SEED = 20240531
BASE_SCALE = 0.02
DELTA_SCALE = 0.002

_PROBE = (
    "import importlib.metadata as m, sys; import mergekit.merge_methods; "
    f"sys.exit(0 if m.version('mergekit') == '{MERGEKIT_VERSION}' else 3)"
)


# --------------------------------------------------------------------------- launcher


def _has_mergekit(python: str | Path) -> bool:
    try:
        result = subprocess.run([str(python), "-c", _PROBE], capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def _mergekit_here() -> bool:
    if importlib.util.find_spec("mergekit") is None:
        return False
    from importlib.metadata import version

    return version("mergekit") == MERGEKIT_VERSION


def _oracle_python() -> Path:
    """An interpreter with mergekit 0.1.5: $MERGEKIT_PYTHON, else .venv-mergekit (made if needed)."""
    override = os.environ.get("MERGEKIT_PYTHON")
    if override:
        if not Path(override).exists():
            sys.exit(f"MERGEKIT_PYTHON={override} does not exist")
        if not _has_mergekit(override):
            sys.exit(f"MERGEKIT_PYTHON={override} cannot import mergekit {MERGEKIT_VERSION}")
        return Path(override)
    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {VENV}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    if not _has_mergekit(python):
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        print(f"installing {TORCH_REQUIREMENT} into {VENV}", file=sys.stderr)
        subprocess.run([*pip, TORCH_REQUIREMENT], check=True)
        print(f"installing mergekit=={MERGEKIT_VERSION} into {VENV}", file=sys.stderr)
        subprocess.run([*pip, f"mergekit=={MERGEKIT_VERSION}"], check=True)
        if not _has_mergekit(python):
            sys.exit(f"{python} still cannot import mergekit {MERGEKIT_VERSION}")
    return python


# --------------------------------------------------------------------------- cases

# Each case: name, mergekit method, parameters (exactly as passed), K, shape, and options:
#   base_input: "base" (base given to mergekit as its base, the default), "none" (only the
#   experts are inputs), "weighted" (linear: the base is an ordinary first input with a weight),
#   "alone" (the base is the only input: passthrough)
#   zero_expert: index of an expert exactly equal to the base
#   zero_tensor: index of an expert that is all zeros
#   zero_rows: False to keep every delta nonzero
#   delta_scale: override of DELTA_SCALE for that case


def _case(name: str, method: str, parameters: dict, k: int, shape: tuple, note: str, **options: Any) -> dict:
    return {
        "case": name,
        "method": method,
        "parameters": parameters,
        "n_experts": k,
        "shape": list(shape),
        "note": note,
        **options,
    }


def _w(k: int) -> list[float]:
    return [1.0, 0.5, 0.75][:k]


CASES: list[dict] = [
    # linear: base_index is ignored by mergekit (BasePolicy.IGNORED); weight binds to all inputs
    _case(
        "linear_norm_k3",
        "linear",
        {"weight": [0.5, 1.0, 0.25], "normalize": True},
        3,
        (16, 24),
        "experts only; weights do not sum to 1 so normalisation matters",
        base_input="none",
    ),
    _case(
        "linear_nonorm_k2",
        "linear",
        {"weight": [0.5, 1.0], "normalize": False},
        2,
        (3, 4, 5),
        "experts only; plain weighted sum",
        base_input="none",
    ),
    _case(
        "linear_default_k2",
        "linear",
        {"weight": [0.3, 0.9]},
        2,
        (7,),
        "experts only; normalize defaults to true",
        base_input="none",
    ),
    _case(
        "linear_negw_k3",
        "linear",
        {"weight": [1.0, -0.4, 0.6], "normalize": True},
        3,
        (7,),
        "experts only; a negative weight",
        base_input="none",
    ),
    _case(
        "linear_with_base_norm",
        "linear",
        {"weight": [0.2, 0.5, 0.3], "normalize": True},
        2,
        (16, 24),
        "the base is input 0 with its own weight (weights bind to every input)",
        base_input="weighted",
    ),
    _case(
        "linear_with_base_nonorm",
        "linear",
        {"weight": [-1.0, 0.7, 0.6], "normalize": False},
        2,
        (3, 4, 5),
        "base as weighted input 0 with weight -1: out = sum_i w_i x_i with the base included",
        base_input="weighted",
    ),
    _case(
        "linear_zero_tensor",
        "linear",
        {"weight": [0.5, 0.5], "normalize": True},
        2,
        (7,),
        "experts only; expert 1 is all zeros",
        base_input="none",
        zero_tensor=1,
    ),
    # task_arithmetic
    _case(
        "ta_lambda",
        "task_arithmetic",
        {"weight": [1.0, 0.5], "lambda": 0.7},
        2,
        (16, 24),
        "lambda != 1, normalize default false",
    ),
    _case(
        "ta_norm_lambda_k3",
        "task_arithmetic",
        {"weight": [0.6, 0.3, 0.9], "normalize": True, "lambda": 1.3},
        3,
        (3, 4, 5),
        "normalize by the sum of weights, then lambda",
    ),
    _case(
        "ta_default_k3",
        "task_arithmetic",
        {"weight": [1.0, -0.5, 0.8]},
        3,
        (7,),
        "defaults (lambda 1, normalize false); a negative weight",
    ),
    _case(
        "ta_zero_expert",
        "task_arithmetic",
        {"weight": [1.0, 1.0, 0.5], "normalize": True},
        3,
        (16, 24),
        "expert 1 exactly equals the base",
        zero_expert=1,
    ),
    # ties
    _case(
        "ties_d05_k3",
        "ties",
        {"weight": [1.0, 0.8, 0.6], "density": [0.5, 0.5, 0.5]},
        3,
        (16, 24),
        "density 0.5, normalize default true",
    ),
    _case(
        "ties_d10_k2",
        "ties",
        {"weight": [0.7, 0.3], "density": [1.0, 1.0]},
        2,
        (16, 24),
        "density 1.0: no pruning, sign election only",
    ),
    _case(
        "ties_d05_nonorm",
        "ties",
        {"weight": [1.0, 0.5], "density": [0.5, 0.7], "normalize": False},
        2,
        (3, 4, 5),
        "normalize false, per-expert densities",
    ),
    _case(
        "ties_negw_k3",
        "ties",
        {"weight": [1.0, -0.5, 0.8], "density": [0.5, 0.5, 0.5]},
        3,
        (3, 4, 5),
        "a negative weight (election on weighted deltas)",
    ),
    _case(
        "ties_lambda_1d",
        "ties",
        {"weight": [1.0, 1.0], "density": [0.5, 0.5], "lambda": 0.5},
        2,
        (7,),
        "1-D tensor, k = max(1, int(0.5 * 7)) = 3, lambda 0.5",
    ),
    _case(
        "ties_rescale",
        "ties",
        {"weight": [1.0, 0.5], "density": [0.3, 0.6], "rescale": True},
        2,
        (16, 24),
        "magnitude pruning with L1 rescale",
    ),
    _case(
        "ties_zero_expert",
        "ties",
        {"weight": [1.0, 1.0, 1.0], "density": [0.5, 0.5, 0.5]},
        3,
        (16, 24),
        "expert 2 exactly equals the base",
        zero_expert=2,
    ),
    _case(
        "ties_large",
        "ties",
        {"weight": [1.0, 0.6, 0.8], "density": [0.3, 0.3, 0.5]},
        3,
        (64, 48),
        "the one larger tensor",
    ),
    # dare_linear
    _case(
        "dare_linear_d06",
        "dare_linear",
        {"weight": [0.5, 0.5], "density": [0.6, 0.6]},
        2,
        (16, 24),
        "density 0.6, rescale default true (L1 norm matching, not 1/density)",
    ),
    _case(
        "dare_linear_d06_norescale",
        "dare_linear",
        {"weight": [1.0, 0.5, 0.75], "density": [0.6, 0.6, 0.6], "rescale": False},
        3,
        (3, 4, 5),
        "rescale false",
    ),
    _case(
        "dare_linear_mixed_density",
        "dare_linear",
        {"weight": [1.0, 0.5, 0.75], "density": [0.6, 1.0, 0.4], "normalize": True},
        3,
        (16, 24),
        "expert 1 has density 1.0: no bernoulli call for it (masks for experts 0 and 2 only)",
    ),
    _case(
        "dare_linear_zero_expert",
        "dare_linear",
        {"weight": [1.0, 1.0], "density": [0.6, 0.6]},
        2,
        (7,),
        "expert 0 exactly equals the base (a mask is still drawn for it)",
        zero_expert=0,
    ),
    # dare_ties
    _case(
        "dare_ties_d06",
        "dare_ties",
        {"weight": [1.0, 0.8, 0.6], "density": [0.6, 0.6, 0.6]},
        3,
        (16, 24),
        "density 0.6, rescale default true, normalize default false",
    ),
    _case(
        "dare_ties_d06_norescale",
        "dare_ties",
        {"weight": [1.0, 0.5], "density": [0.6, 0.6], "rescale": False, "normalize": True},
        2,
        (16, 24),
        "rescale false, normalize true",
    ),
    _case(
        "dare_ties_negw_1d",
        "dare_ties",
        {"weight": [1.0, -0.7, 0.5], "density": [0.6, 0.5, 0.6]},
        3,
        (7,),
        "1-D, a negative weight",
    ),
    _case(
        "dare_ties_zero_expert",
        "dare_ties",
        {"weight": [1.0, 1.0, 1.0], "density": [0.6, 0.6, 0.6]},
        3,
        (3, 4, 5),
        "expert 1 exactly equals the base",
        zero_expert=1,
    ),
    # breadcrumbs
    _case(
        "breadcrumbs_d08_g005",
        "breadcrumbs",
        {"weight": [1.0, 0.5, 0.75], "density": [0.8, 0.8, 0.8], "gamma": [0.05, 0.05, 0.05]},
        3,
        (16, 24),
        "density 0.8, gamma 0.05: drop the top 5% and the bottom 15%",
    ),
    _case(
        "breadcrumbs_default",
        "breadcrumbs",
        {"weight": [1.0, 0.5]},
        2,
        (16, 24),
        "default density 1.0 (and gamma 0.01): mergekit skips sparsification entirely at density >= 1",
    ),
    _case(
        "breadcrumbs_gamma_clip",
        "breadcrumbs",
        {"weight": [1.0, 0.5], "density": [0.9, 0.9], "gamma": [0.2, 0.2], "normalize": True},
        2,
        (3, 4, 5),
        "density + gamma > 1: the bottom cut is clamped to 0, so only the top 10% are dropped",
    ),
    _case(
        "breadcrumbs_ties_d08_g005",
        "breadcrumbs_ties",
        {"weight": [1.0, -0.5, 0.75], "density": [0.8, 0.8, 0.8], "gamma": [0.05, 0.05, 0.05]},
        3,
        (16, 24),
        "density 0.8, gamma 0.05, a negative weight",
    ),
    _case(
        "breadcrumbs_ties_default",
        "breadcrumbs_ties",
        {"weight": [1.0, 0.5]},
        2,
        (3, 4, 5),
        "default density 1.0: sign election only",
    ),
    _case(
        "breadcrumbs_ties_norm_1d",
        "breadcrumbs_ties",
        {"weight": [1.0, 0.5], "density": [0.8, 0.6], "gamma": [0.05, 0.1], "normalize": True},
        2,
        (7,),
        "1-D, normalize true, per-expert density and gamma",
    ),
    # della
    _case(
        "della_d05_e01",
        "della",
        {"weight": [1.0, 0.8, 0.6], "density": [0.5, 0.5, 0.5], "epsilon": [0.1, 0.1, 0.1]},
        3,
        (16, 24),
        "density 0.5, epsilon 0.1, rescale and normalize default true",
    ),
    _case(
        "della_norescale",
        "della",
        {"weight": [1.0, 0.5], "density": [0.5, 0.5], "epsilon": [0.1, 0.1], "rescale": False},
        2,
        (16, 24),
        "rescale false",
    ),
    _case(
        "della_3d",
        "della",
        {"weight": [1.0, 0.5], "density": [0.5, 0.5], "epsilon": [0.1, 0.1]},
        2,
        (3, 4, 5),
        "3-D: mergekit ranks magnitudes along dim 1 (not the last dim)",
    ),
    _case(
        "della_zero_expert",
        "della",
        {"weight": [1.0, 1.0, 1.0], "density": [0.5, 0.5, 0.5], "epsilon": [0.1, 0.1, 0.1]},
        3,
        (16, 24),
        "expert 0 exactly equals the base: its ranks are all ties (its probs are not meaningful)",
        zero_expert=0,
    ),
    _case(
        "della_linear_d05_e01",
        "della_linear",
        {"weight": [1.0, 0.5, 0.75], "density": [0.5, 0.5, 0.5], "epsilon": [0.1, 0.1, 0.1]},
        3,
        (16, 24),
        "density 0.5, epsilon 0.1, rescale default true, normalize default false",
    ),
    _case(
        "della_linear_norescale_1d",
        "della_linear",
        {"weight": [1.0, 0.5], "density": [0.5, 0.5], "epsilon": [0.1, 0.1], "rescale": False},
        2,
        (7,),
        "1-D (ranked as one row), rescale false",
    ),
    _case(
        "della_linear_norm_lambda",
        "della_linear",
        {"weight": [0.6, 0.4], "density": [0.5, 0.6], "epsilon": [0.1, 0.2], "normalize": True, "lambda": 1.5},
        2,
        (16, 24),
        "normalize true, lambda 1.5, per-expert density and epsilon",
    ),
    # model_stock: the base is required; at least 2 experts
    _case("model_stock_k2", "model_stock", {}, 2, (16, 24), "filter_wise default false: one angle per tensor"),
    _case("model_stock_k3", "model_stock", {"filter_wise": False}, 3, (3, 4, 5), "K=3: mean of the 3 pairwise cosines"),
    _case(
        "model_stock_k2_fw",
        "model_stock",
        {"filter_wise": True},
        2,
        (16, 24),
        "filter_wise: one angle per row (last dim); rows where an expert equals the base get t = 0",
    ),
    _case("model_stock_k3_fw", "model_stock", {"filter_wise": True}, 3, (16, 24), "filter_wise, K=3"),
    _case(
        "model_stock_k3_fw_3d",
        "model_stock",
        {"filter_wise": True},
        3,
        (3, 4, 5),
        "filter_wise on 3-D: angles over the last dim, shape (3, 4)",
    ),
    _case(
        "model_stock_k2_fw_1d",
        "model_stock",
        {"filter_wise": True},
        2,
        (7,),
        "filter_wise on 1-D: the tensor is one row",
    ),
    # slerp: inputs [base, x0]; t=0 gives the base, t=1 the expert; whole tensor is one vector
    _case("slerp_t03", "slerp", {"t": 0.3}, 1, (16, 24), "t 0.3, spherical branch"),
    _case("slerp_t0", "slerp", {"t": 0.0}, 1, (16, 24), "t 0: the base"),
    _case("slerp_t1", "slerp", {"t": 1.0}, 1, (16, 24), "t 1: the expert"),
    _case("slerp_t07_3d", "slerp", {"t": 0.7}, 1, (3, 4, 5), "3-D, t 0.7"),
    _case(
        "slerp_t03_nearly_colinear",
        "slerp",
        {"t": 0.3},
        1,
        (7,),
        "tiny delta: |cos| > 0.9995, so linear interpolation",
        delta_scale=1e-5,
        zero_rows=False,
    ),
    _case(
        "slerp_t03_far",
        "slerp",
        {"t": 0.3},
        1,
        (16, 24),
        "expert delta as large as the base (angle far from 0)",
        delta_scale=0.02,
    ),
    # nuslerp: exactly 2 non-base inputs, base optional; t = w1 / (w0 + w1)
    _case(
        "nuslerp_base_flat",
        "nuslerp",
        {"weight": [0.3, 0.7]},
        2,
        (16, 24),
        "with base (slerp of the deltas); nuslerp_flatten default true",
    ),
    _case(
        "nuslerp_base_rows",
        "nuslerp",
        {"weight": [0.3, 0.7], "nuslerp_flatten": False, "nuslerp_row_wise": False},
        2,
        (16, 24),
        "with base, not flattened: one angle per vector along the last dim",
    ),
    _case(
        "nuslerp_base_rowwise",
        "nuslerp",
        {"weight": [0.3, 0.7], "nuslerp_flatten": False, "nuslerp_row_wise": True},
        2,
        (16, 24),
        "with base, row_wise: one angle per vector along dim 0 (i.e. per column)",
    ),
    _case(
        "nuslerp_base_rowwise_3d",
        "nuslerp",
        {"weight": [0.3, 0.7], "nuslerp_flatten": False, "nuslerp_row_wise": True},
        2,
        (3, 4, 5),
        "with base, 3-D row_wise: dim 0 swapped with the last dim",
    ),
    _case(
        "nuslerp_base_flat_rowwise",
        "nuslerp",
        {"weight": [0.3, 0.7], "nuslerp_flatten": True, "nuslerp_row_wise": True},
        2,
        (3, 4, 5),
        "flatten wins over row_wise",
    ),
    _case(
        "nuslerp_nobase_flat",
        "nuslerp",
        {"weight": [0.3, 0.7]},
        2,
        (16, 24),
        "no base: slerp of the expert tensors themselves",
        base_input="none",
    ),
    _case(
        "nuslerp_nobase_rows",
        "nuslerp",
        {"weight": [0.3, 0.7], "nuslerp_flatten": False, "nuslerp_row_wise": False},
        2,
        (3, 4, 5),
        "no base, not flattened, last dim; fibre [1, 2] is identical in both experts, so that fibre "
        "takes the colinear (linear interpolation) branch",
        base_input="none",
    ),
    _case(
        "nuslerp_nobase_rowwise",
        "nuslerp",
        {"weight": [0.3, 0.7], "nuslerp_flatten": False, "nuslerp_row_wise": True},
        2,
        (16, 24),
        "no base, row_wise",
        base_input="none",
    ),
    _case(
        "nuslerp_nobase_zero_tensor",
        "nuslerp",
        {"weight": [0.3, 0.7], "nuslerp_flatten": False},
        2,
        (16, 24),
        "no base; expert 1 is all zeros (its norm is clamped, so cos = 0)",
        base_input="none",
        zero_tensor=1,
    ),
    _case(
        "nuslerp_base_zero_expert",
        "nuslerp",
        {"weight": [0.3, 0.7]},
        2,
        (7,),
        "with base; expert 0 exactly equals the base",
        zero_expert=0,
    ),
    # nearswap: inputs [base, x0]; w = clamp(t / max(|base - x0|, 1e-6), 0, 1) per element
    _case("nearswap_t001", "nearswap", {"t": 0.001}, 1, (16, 24), "t of the order of the deltas: w spans (0, 1]"),
    _case(
        "nearswap_t1e7_3d", "nearswap", {"t": 1e-7}, 1, (3, 4, 5), "t below the 1e-6 floor: w < 1 even where x0 = base"
    ),
    _case("nearswap_t0", "nearswap", {"t": 0.0}, 1, (7,), "t 0: the base"),
    # ram / ramplus_tl: deltas above epsilon; unique ones added, shared ones averaged
    _case("ram_k3", "ram", {}, 3, (16, 24), "epsilon default 1e-5, below every nonzero delta"),
    _case(
        "ram_k3_eps",
        "ram",
        {"epsilon": 0.002},
        3,
        (3, 4, 5),
        "epsilon near the deltas' scale: elements with one, two or three contributors",
    ),
    _case("ram_k2_1d", "ram", {"epsilon": 0.001}, 2, (7,), "1-D, K=2"),
    _case("ramplus_tl_k3", "ramplus_tl", {}, 3, (16, 24), "defaults r 0.1, alpha 0.2, epsilon 1e-5"),
    _case(
        "ramplus_tl_k3_eps",
        "ramplus_tl",
        {"r": 0.5, "alpha": 0.9, "epsilon": 0.002},
        3,
        (3, 4, 5),
        "a larger boost; epsilon near the deltas' scale so every expert has unique elements",
    ),
    _case(
        "ramplus_tl_k2_no_unique",
        "ramplus_tl",
        {},
        2,
        (16, 24),
        "no element is changed by one expert alone outside the zero rows: rho is large, clipped at alpha",
    ),
    # karcher: the base is one of the inputs (mergekit adds it to a base-ignoring method's inputs)
    _case("karcher_k2", "karcher", {}, 2, (16, 24), "base + 2 models, defaults max_iter 10, tol 1e-5"),
    _case("karcher_k3_far_3d", "karcher", {}, 3, (3, 4, 5), "deltas as large as the base", delta_scale=0.02),
    _case(
        "karcher_k2_one_iter",
        "karcher",
        {"max_iter": 1, "tol": 1e-9},
        2,
        (16, 24),
        "one step, a tolerance too small to stop it",
        delta_scale=0.05,
    ),
    _case(
        "karcher_k2_zero_model", "karcher", {}, 2, (7,), "model 1 is all zeros: dropped from the mean", zero_tensor=1
    ),
    # multislerp: deltas from the base; normalized weights by default
    _case("multislerp_k3", "multislerp", {"weight": [1.0, 0.5, 0.75]}, 3, (16, 24), "K=3, normalized weights"),
    _case(
        "multislerp_k2_raw_3d",
        "multislerp",
        {"weight": [0.3, 0.9], "normalize_weights": False},
        2,
        (3, 4, 5),
        "weights as given",
        delta_scale=0.02,
    ),
    _case("multislerp_k1", "multislerp", {"weight": [0.5]}, 1, (16, 24), "one expert: returned as it is"),
    # sce: variance top-k over the experts, energy shares, sign election; no weights
    _case("sce_k3", "sce", {}, 3, (16, 24), "select_topk default 1: every element, election and energy shares"),
    _case("sce_k3_topk_3d", "sce", {"select_topk": 0.3}, 3, (3, 4, 5), "the 30% of elements that vary most"),
    _case("sce_k2_topk_1d", "sce", {"select_topk": 0.5}, 2, (7,), "1-D, K=2"),
    _case(
        "sce_k2_tiny", "sce", {}, 2, (16, 24), "deltas so small the energy sum is below 1e-6: uniform", delta_scale=1e-5
    ),
    # arcee_fusion: importance |delta| x KL of the rows' softmaxes; keep above median + 1.5 IQR
    _case("arcee_fusion_2d", "arcee_fusion", {}, 1, (16, 24), "quartiles of 384 importances, sorted whole"),
    _case("arcee_fusion_3d", "arcee_fusion", {}, 1, (3, 4, 5), "softmax over the last dim of a 3-D tensor"),
    # passthrough: its one input as it is, or times its scale (mergepipe: the base, alone)
    _case("passthrough_plain", "passthrough", {}, 0, (7,), "the one input, untouched", base_input="alone"),
    _case(
        "passthrough_scale",
        "passthrough",
        {"scale": 0.37},
        0,
        (16, 24),
        "the one input times scale",
        base_input="alone",
    ),
    _case("arcee_fusion_1d", "arcee_fusion", {}, 1, (7,), "1-D: one row, one KL for the whole tensor"),
]

# Above 10^6 elements arcee_fusion reads its quartiles off 10^6 positions that mergekit draws
# from torch's global generator (torch.randint, right after the seed below). Such inputs are too
# large to store: they are made again from `inputs_seed` and the record keeps the SHA-256 of the
# inputs' and the output's bits, as mergekit made them on the machine that ran this script. The
# test no longer reads those digests (torch.randn and mergekit's arithmetic both change with the
# CPU's kernels): it makes inputs of its own from the seed with torch.rand and runs mergekit's
# formula beside mergepipe with the same draw (tests/test_mergekit_parity.py).
SAMPLED_CASES = [
    {
        "case": "arcee_fusion_sampled",
        "method": "arcee_fusion",
        "shape": [1001, 1000],
        "inputs_seed": 7,
        "rng_seed": 11,
        "note": "1,001,000 elements: the quartiles of a sample of 10^6 positions drawn with replacement",
    }
]


def sampled_inputs(shape: tuple, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g, dtype=torch.float32) * BASE_SCALE
    return base, base + torch.randn(shape, generator=g, dtype=torch.float32) * DELTA_SCALE


def bits_sha256(*tensors) -> str:
    import hashlib

    import torch

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(-1).view(torch.int32).numpy().tobytes())
    return h.hexdigest()


def generate_sampled_case(case: dict) -> dict:
    import torch

    base, x = sampled_inputs(tuple(case["shape"]), case["inputs_seed"])
    outs = []
    for _ in range(2):
        torch.manual_seed(case["rng_seed"])
        outs.append(_run(case["method"], [base, x], 0, {}))
    if not _same_bits(*outs):
        raise AssertionError(f"{case['case']}: two runs from the same seed differ")
    return {
        **case,
        "sampled": True,
        "mergekit_version": MERGEKIT_VERSION,
        "inputs_sha256": bits_sha256(base, x),
        "out_sha256": bits_sha256(outs[0]),
    }


RANDOM_METHODS = {"dare_linear", "dare_ties", "della", "della_linear"}


# --------------------------------------------------------------------------- generation


def _bits(t):
    import torch

    return t.contiguous().view(torch.int32)


def _same_bits(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _zero_positions(shape: tuple, k: int) -> dict[int, list[tuple[int, ...]]]:
    """Leading indices where expert i equals the base (x[idx] = base[idx], an exactly-zero delta).

    Every expert equals the base at the first position (so all deltas are zero there) plus one
    position of its own. For 1-D and 2-D tensors these are elements / whole rows; for 3-D,
    whole last-dim fibres.
    """
    if len(shape) <= 2:
        n = shape[0]
        own = [n - 2, n // 2, 0]
        return {i: sorted({(1,), (own[i % 3],)}) for i in range(k)}
    own = [[0, 0], [1, 0], [2, 3]]
    return {i: sorted({(1, 2), tuple(own[i % 3])}) for i in range(k)}


def _make_inputs(case: dict):
    import torch

    shape = tuple(case["shape"])
    k = case["n_experts"]
    g = torch.Generator().manual_seed(SEED ^ zlib.crc32(case["case"].encode()))
    base = torch.randn(shape, generator=g, dtype=torch.float32) * BASE_SCALE
    common = torch.randn(shape, generator=g, dtype=torch.float32)
    scale = case.get("delta_scale", DELTA_SCALE)
    zero_rows = _zero_positions(shape, k) if case.get("zero_rows", True) else {}
    experts = []
    for i in range(k):
        own = torch.randn(shape, generator=g, dtype=torch.float32)
        delta = scale * (0.6 * common + 0.8 * own)
        x = base + delta
        for idx in zero_rows.get(i, []):
            x[idx] = base[idx]
        if case.get("zero_expert") == i:
            x = base.clone()
        if case.get("zero_tensor") == i:
            x = torch.zeros(shape, dtype=torch.float32)
        experts.append(x.contiguous())
    return base.contiguous(), experts, zero_rows


class _Capture:
    """Replaces `mergekit.sparsify.torch` with a proxy whose `bernoulli` records or replays masks."""

    def __init__(self, replay: list | None = None):
        self.calls: list[tuple[Any, Any]] = []  # (probability tensor, returned mask)
        self.replay = None if replay is None else list(replay)

    def __enter__(self):
        import mergekit.sparsify as sp
        import torch

        if sp.torch is not torch:
            raise RuntimeError("mergekit.sparsify.torch is not the torch module; cannot patch it")
        capture = self

        class _TorchProxy:
            def __getattr__(self, name):
                return getattr(torch, name)

            @staticmethod
            def bernoulli(p, *args, **kwargs):
                if args or kwargs:
                    raise RuntimeError(f"unexpected torch.bernoulli arguments {args} {kwargs}")
                if capture.replay is None:
                    mask = torch.bernoulli(p)
                else:
                    if len(capture.calls) >= len(capture.replay):
                        raise RuntimeError("more bernoulli calls on replay than were recorded")
                    mask = capture.replay[len(capture.calls)].clone()
                    if mask.shape != p.shape or mask.dtype != p.dtype:
                        raise RuntimeError("replayed mask does not match the bernoulli argument")
                capture.calls.append((p.detach().clone(), mask.detach().clone()))
                return mask

        self._module = sp
        sp.torch = _TorchProxy()
        return self

    def __exit__(self, *exc):
        import torch

        self._module.torch = torch
        return False


def _run(method: str, tensors, base_index, parameters: dict):
    import copy

    from mergekit.merge_methods import merge_tensors

    return merge_tensors(list(tensors), method, base_index=base_index, parameters=copy.deepcopy(parameters))


def _resolved(method_name: str, tensors, base_index, parameters: dict) -> tuple[dict, dict]:
    """Parameters as mergekit binds them (defaults filled in; per-input values as lists)."""
    from mergekit import merge_methods
    from mergekit.merge_methods.base import PerInputValues, TensorGroup

    method = merge_methods.get(method_name)
    group = TensorGroup.from_tensors(list(tensors), base_index=base_index)
    (bound,) = method._bind_parameters((group,), dict(parameters))
    values, scopes = {}, {}
    for spec in method.spec.parameters:
        value = bound[spec.name]
        values[spec.name] = list(value.values()) if isinstance(value, PerInputValues) else value
        scopes[spec.name] = spec.scope.value
    return values, scopes


def _expected_calls(case: dict, resolved: dict) -> list[int]:
    """Experts (in input order) for which mergekit draws a mask: one call each, density < 1."""
    if case["method"] not in RANDOM_METHODS:
        return []
    return [i for i, d in enumerate(resolved["density"]) if d < 1]


def generate_case(case: dict) -> tuple[dict, dict]:
    import torch

    name, method, params = case["case"], case["method"], case["parameters"]
    shape = tuple(case["shape"])
    base, experts, zero_rows = _make_inputs(case)
    mode = case.get("base_input", "base")
    named = {"base": base, **{f"x{i}": x for i, x in enumerate(experts)}}
    if mode == "base":
        inputs, base_index = ["base", *[f"x{i}" for i in range(len(experts))]], 0
    elif mode == "none":
        inputs, base_index = [f"x{i}" for i in range(len(experts))], None
    elif mode == "weighted":
        inputs, base_index = ["base", *[f"x{i}" for i in range(len(experts))]], None
    elif mode == "alone":
        inputs, base_index = ["base"], None
    else:
        raise ValueError(mode)
    tensors = [named[n] for n in inputs]
    resolved, scopes = _resolved(method, tensors, base_index, params)
    expected_calls = _expected_calls(case, resolved)

    torch.manual_seed(SEED ^ zlib.crc32(name.encode()) ^ 0x5EED)
    with _Capture() as cap:
        out = _run(method, tensors, base_index, params)
    if out.dtype != torch.float32 or tuple(out.shape) != shape:
        raise AssertionError(f"{name}: output {out.dtype} {tuple(out.shape)}, expected float32 {shape}")
    if not torch.isfinite(out).all():
        raise AssertionError(f"{name}: non-finite output")
    out = out.detach().contiguous().clone()
    if len(cap.calls) != len(expected_calls):
        raise AssertionError(f"{name}: {len(cap.calls)} bernoulli calls, expected {len(expected_calls)}")

    record_tensors = {f"{name}/{n}": t for n, t in named.items()}
    record_tensors[f"{name}/out"] = out
    if expected_calls:
        is_della = method.startswith("della")
        for (p, mask), i in zip(cap.calls, expected_calls):
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise AssertionError(f"{name}: mask {i} is not 0/1")
            if is_della:
                # 1-D tensors are ranked as a single row of shape (1, n)
                if p.numel() != base.numel():
                    raise AssertionError(f"{name}: della probs {i} has shape {tuple(p.shape)}")
                record_tensors[f"{name}/probs{i}"] = p.reshape(shape).to(torch.float32).contiguous()
            else:
                density = resolved["density"][i]
                if tuple(p.shape) != shape or not bool((p == torch.tensor(density, dtype=p.dtype)).all()):
                    raise AssertionError(f"{name}: bernoulli {i} was not called on full_like(delta, {density})")
            record_tensors[f"{name}/mask{i}"] = mask.reshape(shape).to(torch.float32).contiguous()
        # Replay the recorded masks under an unrelated seed: the output must not change by a bit.
        torch.manual_seed(12345)
        with _Capture(replay=[m for _, m in cap.calls]) as rep:
            again = _run(method, tensors, base_index, params)
        if len(rep.calls) != len(cap.calls) or not _same_bits(out, again):
            raise AssertionError(f"{name}: replaying the recorded masks does not reproduce the output")
        for (p0, _), (p1, _) in zip(cap.calls, rep.calls):
            if not _same_bits(p0.float(), p1.float()):
                raise AssertionError(f"{name}: bernoulli arguments differ on replay")
    else:
        with _Capture() as cap2:
            again = _run(method, tensors, base_index, params)
        if cap2.calls or not _same_bits(out, again):
            raise AssertionError(f"{name}: a second run differs (or drew random numbers)")
    if mode == "weighted":
        # mergekit's linear ignores base_index; check that claim on this very case
        marked = _run(method, tensors, 0, params)
        if not _same_bits(out, marked):
            raise AssertionError(f"{name}: linear with base_index=0 differs from base_index=None")

    record = {
        "case": name,
        "method": method,
        "parameters": params,
        "n_experts": len(experts),
        "shape": list(shape),
        "masks": bool(expected_calls),
        "mergekit_version": MERGEKIT_VERSION,
        "note": case["note"],
        "inputs": inputs,
        "base_index": base_index,
        "mask_experts": expected_calls,
        "probs": bool(expected_calls) and method.startswith("della"),
        "resolved_parameters": resolved,
        "parameter_scopes": scopes,
        "zero_delta_at": {
            str(i): [list(idx) for idx in rows]
            for i, rows in zero_rows.items()
            if i not in (case.get("zero_expert"), case.get("zero_tensor"))
        },
        "zero_expert": case.get("zero_expert"),
        "zero_tensor": case.get("zero_tensor"),
    }
    return record, record_tensors


def generate(out_dir: Path, check: bool) -> int:
    from importlib.metadata import version

    import torch
    from safetensors.torch import load_file, save_file

    if version("mergekit") != MERGEKIT_VERSION:
        sys.exit(f"need mergekit {MERGEKIT_VERSION}, found {version('mergekit')}")
    torch.set_num_threads(1)
    names = [c["case"] for c in CASES]
    if len(set(names)) != len(names):
        raise AssertionError("duplicate case names")
    records, tensors = [], {}
    for case in CASES:
        record, ts = generate_case(case)
        records.append(record)
        tensors.update(ts)
        print(
            f"{record['case']:32s} {record['method']:16s} {str(tuple(record['shape'])):12s}"
            f" bernoulli calls: {len(record['mask_experts'])}",
            file=sys.stderr,
        )
    for case in SAMPLED_CASES:
        records.append(generate_sampled_case(case))
        print(f"{case['case']:32s} {case['method']:16s} {str(tuple(case['shape'])):12s} sampled", file=sys.stderr)
    text = json.dumps(records, indent=1) + "\n"
    st_path, json_path = out_dir / f"{STEM}.safetensors", out_dir / f"{STEM}.json"
    # One metadata key: safetensors writes several keys in hash order, so the bytes would vary.
    metadata = {
        "mergekit_parity": json.dumps(
            {
                "generator": "scripts/mergekit_parity.py",
                "seed": SEED,
                "mergekit_version": MERGEKIT_VERSION,
                "torch_version": torch.__version__,
            },
            sort_keys=True,
        )
    }
    if check:
        ok = json_path.exists() and st_path.exists() and json_path.read_text() == text
        if ok:
            stored = load_file(str(st_path))
            ok = set(stored) == set(tensors) and all(_same_bits(stored[k], v) for k, v in tensors.items())
        print("fixtures are up to date" if ok else "fixtures differ from a fresh generation", file=sys.stderr)
        return 0 if ok else 1
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(st_path), metadata=metadata)
    os.chmod(st_path, 0o644)  # safetensors creates the file 0600
    json_path.write_text(text)
    print(
        f"wrote {len(records)} cases, {len(tensors)} tensors: {st_path} ({st_path.stat().st_size} B), "
        f"{json_path} ({json_path.stat().st_size} B)",
        file=sys.stderr,
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--generate",
        action="store_true",
        help="generate now (needs mergekit importable); without it, find or make an interpreter",
    )
    parser.add_argument("--check", action="store_true", help="compare a fresh generation with the files")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.generate or _mergekit_here():
        return generate(args.out_dir.resolve(), args.check)
    python = _oracle_python()
    command = [str(python), str(Path(__file__).resolve()), "--generate", "--out-dir", str(args.out_dir.resolve())]
    if args.check:
        command.append("--check")
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
