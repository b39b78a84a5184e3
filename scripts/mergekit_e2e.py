#!/usr/bin/env python3
"""Generate end-to-end mergekit 0.1.5 fixtures: a tiny Llama family, merge configs, and the
checkpoints `mergekit-yaml` produces from them.

What it does (deterministic; every tensor comes from a seeded `torch.Generator`):

1. Builds four tiny LlamaForCausalLM checkpoints (hidden 16, intermediate 32, 4 layers, 2 heads,
   2 KV heads, vocab 64, untied lm_head, all float32) under `tests/data/mergekit_e2e/`, at the
   relative paths of the Hugging Face ids used in mergekit's examples/ties.yml, so the configs
   resolve when run from that folder:

       TheBloke/Llama-2-13B-fp16      base: 2-D weights ~ N(0, 0.02), norms ~ 1
       psmathur/orca_mini_v3_13b      expert: base + low-rank + noise delta; norms untouched
       garage-bAInd/Platypus2-13B     expert: different delta; layer-3 o_proj untouched
       WizardLM/WizardMath-13B-V1.0   expert: different delta; embed_tokens untouched

   Each is a folder with `config.json` and `model.safetensors` (no tokenizer files). Deltas are
   1-5% of the weight's scale and differ per expert and per layer. Beside them, two PEFT LoRA
   adapters for the base's shapes (mergepipe.devtools.synthetic.write_adapter) under adapters/.

2. Writes the merge configs (ties.yml is mergekit's examples/ties.yml verbatim) next to them.

3. Runs `mergekit-yaml <config> <tmp dir> --no-copy-tokenizer --no-write-model-card` (and
   `--lora-merge-cache` in a temporary folder for the LoRA configs) for each
   config with cwd = tests/data/mergekit_e2e and HF_HUB_OFFLINE=1 / TRANSFORMERS_OFFLINE=1,
   gathers the (possibly sharded) output into `expected/<case>.safetensors` (tensor names and
   dtypes exactly as mergekit wrote them) and records every case in `cases.json` (config,
   mergekit version, command line with the output folder written as OUT, dtype per tensor, or
   mergekit's error message when it failed; then there is no expected file).

Re-running overwrites everything with byte-identical files.

How to run, from the repository root:

    .venv/bin/python scripts/mergekit_e2e.py             # write the fixtures
    .venv/bin/python scripts/mergekit_e2e.py --probes    # also run the behaviour probes
                                                         # (temporary folders; printed only)

The script itself needs torch and safetensors (the project venv). mergekit runs as a subprocess
from the interpreter in `$MERGEKIT_PYTHON` if set, otherwise `.venv-mergekit/bin/python` at the
repository root (`scripts/mergekit_parity.py` creates that venv); `mergekit-yaml` is taken from
the same bin/ folder. It must be mergekit 0.1.5.

Licensing: mergekit is LGPL-3.0. It is only run as an external program to produce reference
outputs; no mergekit code is copied here and mergepipe never imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mergepipe.devtools.synthetic import write_adapter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "tests" / "data" / "mergekit_e2e"
VENV_PYTHON = ROOT / ".venv-mergekit" / "bin" / "python"
MERGEKIT_VERSION = "0.1.5"
SEED = 20240607

BASE = "TheBloke/Llama-2-13B-fp16"
ORCA = "psmathur/orca_mini_v3_13b"
PLATYPUS = "garage-bAInd/Platypus2-13B"
WIZARD = "WizardLM/WizardMath-13B-V1.0"
MODELS = [BASE, ORCA, PLATYPUS, WIZARD]

HIDDEN = 16
INTERMEDIATE = 32
LAYERS = 4
HEADS = 2
KV_HEADS = 2
VOCAB = 64

# --no-write-model-card is required offline: the model card looks the (HF-id-shaped) model paths up on
# the Hub and mergekit exits 1 with OfflineModeIsEnabled after writing the tensors. --no-copy-tokenizer
# only avoids a logged, non-fatal error (there are no tokenizer files).
MERGEKIT_FLAGS = ["--no-copy-tokenizer", "--no-write-model-card"]

# --------------------------------------------------------------------------- model family


def llama_config(num_layers: int = LAYERS) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": 128,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": KV_HEADS,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": VOCAB,
    }


def tensor_shapes(num_layers: int = LAYERS) -> dict[str, tuple[int, ...]]:
    head_dim = HIDDEN // HEADS
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (HEADS * head_dim, HIDDEN)
        shapes[p + "self_attn.k_proj.weight"] = (KV_HEADS * head_dim, HIDDEN)
        shapes[p + "self_attn.v_proj.weight"] = (KV_HEADS * head_dim, HIDDEN)
        shapes[p + "self_attn.o_proj.weight"] = (HIDDEN, HEADS * head_dim)
        shapes[p + "mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[p + "mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[p + "mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
        shapes[p + "input_layernorm.weight"] = (HIDDEN,)
        shapes[p + "post_attention_layernorm.weight"] = (HIDDEN,)
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else None


# tensors an expert leaves exactly equal to the base
UNTOUCHED = {
    ORCA: lambda n: _is_norm(n),
    PLATYPUS: lambda n: n == "model.layers.3.self_attn.o_proj.weight",
    WIZARD: lambda n: n == "model.embed_tokens.weight",
}


def _gen(tag: str) -> torch.Generator:
    return torch.Generator().manual_seed(SEED ^ zlib.crc32(tag.encode()))


def build_base() -> dict[str, torch.Tensor]:
    g = _gen(BASE)
    out = {}
    for name, shape in tensor_shapes().items():
        x = torch.randn(shape, generator=g, dtype=torch.float32)
        out[name] = (1.0 + 0.05 * x) if _is_norm(name) else 0.02 * x
    return out


def build_expert(model: str, base: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """base + a fine-tune-like delta: rank-2 term + noise, 1-5% of the weight's scale."""
    g = _gen(model)
    out = {}
    for name, w in base.items():
        layer = _layer(name)
        # relative size: differs per expert and per layer, within [1%, 5%]
        rel = 0.01 + 0.04 * ((index * 0.37 + (0 if layer is None else layer + 1) * 0.23) % 1.0)
        if w.ndim == 2:
            rows, cols = w.shape
            u = torch.randn((rows, 2), generator=g, dtype=torch.float32)
            v = torch.randn((2, cols), generator=g, dtype=torch.float32)
            noise = torch.randn(w.shape, generator=g, dtype=torch.float32)
            direction = (u @ v) / (2**0.5) + 0.5 * noise
            delta = rel * 0.02 * direction
        else:
            delta = rel * torch.randn(w.shape, generator=g, dtype=torch.float32)
        out[name] = w.clone() if UNTOUCHED[model](name) else (w + delta).contiguous()
    return out


def write_model(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )


def build_family(dest: Path) -> dict[str, dict[str, torch.Tensor]]:
    base = build_base()
    family = {BASE: base}
    for i, m in enumerate([ORCA, PLATYPUS, WIZARD]):
        family[m] = build_expert(m, base, i)
    for m, tensors in family.items():
        write_model(dest / m, tensors, llama_config())
    for folder, spec in ADAPTERS.items():
        write_adapter(dest / folder, base, SEED ^ zlib.crc32(folder.encode()), scale=0.1, **spec)
    return family


# PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors, keys as PEFT saves them)
# for the family's shapes: fp32 factors on q and v; bf16 factors with rsLoRA on the MLP and the
# embedding (PEFT's lora_embedding_A/B), with an alpha pattern for one module.
ADAPTERS = {
    "adapters/qv": {"targets": ("q_proj", "v_proj"), "rank": 4, "alpha": 8, "dtype": torch.float32},
    "adapters/mlp-rs": {
        "targets": ("gate_proj", "down_proj"),
        "rank": 8,
        "alpha": 16,
        "dtype": torch.bfloat16,
        "use_rslora": True,
        "embedding": True,
        "alpha_pattern": {"layers.1.mlp.gate_proj": 24},
    },
}


# --------------------------------------------------------------------------- configs

CONFIGS: dict[str, str] = {}

CONFIGS["ties"] = """\
models:
  - model: psmathur/orca_mini_v3_13b
    parameters:
      density: [1, 0.7, 0.1] # density gradient
      weight: 1.0
  - model: garage-bAInd/Platypus2-13B
    parameters:
      density: 0.5
      weight: [0, 0.3, 0.7, 1] # weight gradient
  - model: WizardLM/WizardMath-13B-V1.0
    parameters:
      density: 0.33
      weight:
        - filter: mlp
          value: 0.5
        - value: 0
merge_method: ties
base_model: TheBloke/Llama-2-13B-fp16
parameters:
  normalize: true
  int8_mask: true
dtype: float16
"""

CONFIGS["ties_fp32"] = CONFIGS["ties"].replace("dtype: float16", "dtype: float32")

# orca: gradient-valued filter + "*" catch-all; platypus: filters only, no catch-all (unmatched
# tensors fall through to the global weight 0.25); wizard: full-name-substring filter + catch-all.
CONFIGS["task_arithmetic_filters"] = """\
models:
  - model: TheBloke/Llama-2-13B-fp16
  - model: psmathur/orca_mini_v3_13b
    parameters:
      weight:
        - filter: self_attn
          value: [0.2, 0.6, 1.0]
        - filter: "*"
          value: 0.8
  - model: garage-bAInd/Platypus2-13B
    parameters:
      weight:
        - filter: mlp
          value: 0.5
        - filter: embed_tokens
          value: -0.3
  - model: WizardLM/WizardMath-13B-V1.0
    parameters:
      weight:
        - filter: layers.1.
          value: -0.4
        - value: 0.6
merge_method: task_arithmetic
base_model: TheBloke/Llama-2-13B-fp16
parameters:
  weight: 0.25
  lambda: [0.5, 1.0, 1.5]
dtype: float32
"""

CONFIGS["linear_base_weighted"] = """\
models:
  - model: TheBloke/Llama-2-13B-fp16
    parameters:
      weight: 0.4
  - model: psmathur/orca_mini_v3_13b
    parameters:
      weight: [0.1, 0.5, 0.9]
  - model: garage-bAInd/Platypus2-13B
    parameters:
      weight: 0.3
merge_method: linear
base_model: TheBloke/Llama-2-13B-fp16
parameters:
  normalize: true
dtype: float32
"""

CONFIGS["linear"] = """\
models:
  - model: psmathur/orca_mini_v3_13b
    parameters:
      weight: 1.0
  - model: WizardLM/WizardMath-13B-V1.0
    parameters:
      weight: 0.3
  - model: garage-bAInd/Platypus2-13B
    parameters:
      weight: 0.5
merge_method: linear
dtype: float32
"""

CONFIGS["slerp_gradient"] = """\
models:
  - model: TheBloke/Llama-2-13B-fp16
  - model: psmathur/orca_mini_v3_13b
merge_method: slerp
base_model: TheBloke/Llama-2-13B-fp16
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 0.3, 0.7, 1]
    - filter: mlp
      value: [1, 0.5, 0.7, 0.3, 0]
    - value: 0.5
dtype: float32
"""

# The methods added after the first parity round, each as its users write it.
CONFIGS["karcher"] = """\
models:
  - model: psmathur/orca_mini_v3_13b
  - model: garage-bAInd/Platypus2-13B
merge_method: karcher
base_model: TheBloke/Llama-2-13B-fp16
parameters:
  max_iter: 20
  tol: 1.0e-6
dtype: float32
"""

CONFIGS["multislerp"] = """\
models:
  - model: psmathur/orca_mini_v3_13b
    parameters:
      weight: 0.5
  - model: garage-bAInd/Platypus2-13B
    parameters:
      weight: 0.3
  - model: WizardLM/WizardMath-13B-V1.0
    parameters:
      weight: [0.2, 0.8]
merge_method: multislerp
base_model: TheBloke/Llama-2-13B-fp16
dtype: float32
"""

# Without a base_model (mergekit's multislerp base is optional): every model is an input.
CONFIGS["multislerp_no_base"] = """\
models:
  - model: TheBloke/Llama-2-13B-fp16
    parameters:
      weight: 0.4
  - model: psmathur/orca_mini_v3_13b
    parameters:
      weight: 0.3
  - model: WizardLM/WizardMath-13B-V1.0
    parameters:
      weight: [0.1, 0.5]
merge_method: multislerp
dtype: float32
"""

# LoRA adapters (mergekit merges each into its model with PEFT first: --lora-merge-cache).
CONFIGS["lora_plus"] = """\
models:
  - model: TheBloke/Llama-2-13B-fp16+adapters/qv
    parameters:
      weight: 0.7
  - model: psmathur/orca_mini_v3_13b
    parameters:
      weight: 0.3
merge_method: task_arithmetic
base_model: TheBloke/Llama-2-13B-fp16
dtype: float32
"""

CONFIGS["lora_reference"] = """\
models:
  - model:
      model: psmathur/orca_mini_v3_13b
      lora: adapters/mlp-rs
    parameters:
      weight: 0.5
  - model: garage-bAInd/Platypus2-13B+adapters/qv
    parameters:
      weight: 0.5
merge_method: linear
dtype: float32
"""

CONFIGS["sce"] = """\
models:
  - model: psmathur/orca_mini_v3_13b
  - model: garage-bAInd/Platypus2-13B
  - model: WizardLM/WizardMath-13B-V1.0
merge_method: sce
base_model: TheBloke/Llama-2-13B-fp16
parameters:
  select_topk: 0.6
dtype: float32
"""

CONFIGS["ram"] = """\
models:
  - model: psmathur/orca_mini_v3_13b
  - model: garage-bAInd/Platypus2-13B
  - model: WizardLM/WizardMath-13B-V1.0
merge_method: ram
base_model: TheBloke/Llama-2-13B-fp16
parameters:
  epsilon: 0.0005
dtype: float32
"""

CONFIGS["ramplus_tl"] = """\
models:
  - model: psmathur/orca_mini_v3_13b
  - model: garage-bAInd/Platypus2-13B
merge_method: ramplus_tl
base_model: TheBloke/Llama-2-13B-fp16
parameters:
  r: 0.3
  alpha: 0.5
  epsilon: 0.0005
dtype: float32
"""

CONFIGS["nearswap"] = """\
models:
  - model: TheBloke/Llama-2-13B-fp16
  - model: psmathur/orca_mini_v3_13b
merge_method: nearswap
base_model: TheBloke/Llama-2-13B-fp16
parameters:
  t: [0.0001, 0.001, 0.01]
dtype: float32
"""

CONFIGS["karcher_base_listed"] = """\
models:
  - model: psmathur/orca_mini_v3_13b
  - model: TheBloke/Llama-2-13B-fp16
  - model: garage-bAInd/Platypus2-13B
merge_method: karcher
base_model: TheBloke/Llama-2-13B-fp16
dtype: float32
"""

CONFIGS["linear_global_weight"] = """\
models:
  - model: psmathur/orca_mini_v3_13b
    parameters:
      weight: 0.7
  - model: garage-bAInd/Platypus2-13B
    parameters:
      weight: 0.4
merge_method: linear
base_model: TheBloke/Llama-2-13B-fp16
parameters:
  weight: 0.25
dtype: float32
"""

CONFIGS["arcee_fusion"] = """\
models:
  - model: garage-bAInd/Platypus2-13B
merge_method: arcee_fusion
base_model: TheBloke/Llama-2-13B-fp16
dtype: float32
"""

# `slices:` configs of the kinds users publish. A frankenmerge: passthrough interleaving two
# models' layer ranges into more layers than either has (6 from 4).
CONFIGS["passthrough_frankenmerge"] = """\
slices:
  - sources:
      - model: psmathur/orca_mini_v3_13b
        layer_range: [0, 2]
  - sources:
      - model: garage-bAInd/Platypus2-13B
        layer_range: [1, 3]
  - sources:
      - model: psmathur/orca_mini_v3_13b
        layer_range: [2, 4]
        parameters:
          scale:
            - filter: o_proj
              value: 0.5
            - value: 1.0
merge_method: passthrough
dtype: float32
"""

# slerp with a gradient of t per slice (each over its own layers), filters, and a global t for
# what no slice setting matches.
CONFIGS["slerp_slices"] = """\
slices:
  - sources:
      - model: TheBloke/Llama-2-13B-fp16
        layer_range: [0, 2]
      - model: psmathur/orca_mini_v3_13b
        layer_range: [0, 2]
    parameters:
      t:
        - filter: self_attn
          value: [0, 0.6]
        - value: 0.3
  - sources:
      - model: TheBloke/Llama-2-13B-fp16
        layer_range: [2, 4]
      - model: psmathur/orca_mini_v3_13b
        layer_range: [2, 4]
    parameters:
      t:
        - filter: mlp
          value: [0.8, 0.2]
merge_method: slerp
base_model: TheBloke/Llama-2-13B-fp16
parameters:
  t: 0.5
dtype: float32
"""

# Per-slice overrides (mergekit 0.1.5 has no per-slice merge_method; a slice overrides
# parameters): each slice its own sources, layer ranges that pair an expert's layer j with the
# base's layer i, the base listed at another place, and slice-level weight and lambda.
CONFIGS["task_arithmetic_slices"] = """\
slices:
  - sources:
      - model: TheBloke/Llama-2-13B-fp16
        layer_range: [0, 2]
      - model: psmathur/orca_mini_v3_13b
        layer_range: [0, 2]
        parameters:
          weight: 0.7
      - model: garage-bAInd/Platypus2-13B
        layer_range: [0, 2]
        parameters:
          weight: [0.2, 0.6]
  - sources:
      - model: WizardLM/WizardMath-13B-V1.0
        layer_range: [1, 3]
      - model: TheBloke/Llama-2-13B-fp16
        layer_range: [2, 4]
      - model: garage-bAInd/Platypus2-13B
        layer_range: [2, 4]
    parameters:
      weight: 0.4
      lambda: 0.8
merge_method: task_arithmetic
base_model: TheBloke/Llama-2-13B-fp16
parameters:
  weight: 0.5
dtype: float32
"""

# Filters that name a layer: a source's settings (its own, and the slice's and global ones it
# falls through to) are tested against the source's tensor name (orca's layer 2 becomes the
# output's layer 0 here), the method's shared lambda against the output's.
CONFIGS["slices_source_filters"] = """\
slices:
  - sources:
      - model: TheBloke/Llama-2-13B-fp16
        layer_range: [0, 2]
      - model: psmathur/orca_mini_v3_13b
        layer_range: [2, 4]
        parameters:
          weight:
            - filter: layers.2.
              value: 0.1
            - value: 0.6
  - sources:
      - model: TheBloke/Llama-2-13B-fp16
        layer_range: [2, 4]
      - model: psmathur/orca_mini_v3_13b
        layer_range: [0, 2]
    parameters:
      weight:
        - filter: layers.1.
          value: 0.9
        - value: 0.3
      lambda:
        - filter: layers.2.
          value: 0.5
        - value: 1.0
merge_method: task_arithmetic
base_model: TheBloke/Llama-2-13B-fp16
dtype: float32
"""

# passthrough's scale is the one source's parameter: its filter names orca's layer 3, which
# becomes the output's layer 1 in the first slice and layer 5 in the last (the output's layer 3,
# Platypus's layer 1, keeps its scale of 1).
CONFIGS["passthrough_source_filters"] = """\
slices:
  - sources:
      - model: psmathur/orca_mini_v3_13b
        layer_range: [2, 4]
        parameters:
          scale:
            - filter: layers.3.
              value: 0.5
            - value: 1.0
  - sources:
      - model: garage-bAInd/Platypus2-13B
        layer_range: [0, 2]
  - sources:
      - model: psmathur/orca_mini_v3_13b
        layer_range: [2, 4]
    parameters:
      scale:
        - filter: layers.3.
          value: 2.0
        - value: 1.0
merge_method: passthrough
dtype: float32
"""

# --------------------------------------------------------------------------- running mergekit


def mergekit_python() -> Path:
    override = os.environ.get("MERGEKIT_PYTHON")
    python = Path(override) if override else VENV_PYTHON
    if not python.exists():
        sys.exit(
            f"no mergekit interpreter at {python}: set MERGEKIT_PYTHON to a python with "
            f"mergekit {MERGEKIT_VERSION}, or create .venv-mergekit (scripts/mergekit_parity.py does)"
        )
    probe = "import importlib.metadata as m; print(m.version('mergekit'))"
    res = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if res.returncode != 0 or res.stdout.strip() != MERGEKIT_VERSION:
        sys.exit(f"{python} does not have mergekit {MERGEKIT_VERSION} ({res.stdout.strip() or res.stderr.strip()})")
    if not (python.parent / "mergekit-yaml").exists():
        sys.exit(f"no mergekit-yaml next to {python}")
    return python


def _env() -> dict:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONHASHSEED="0",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _error_message(stderr: str, scrub: list[str]) -> str:
    """The exception of the last traceback (with its continuation lines), else the last line."""
    lines = [ln.rstrip() for ln in stderr.strip().splitlines() if ln.strip()]
    start = next(
        (i for i in range(len(lines) - 1, -1, -1) if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b", lines[i])), None
    )
    msg = " ".join(lines[start:]) if start is not None else (lines[-1] if lines else "")
    for s in scrub:
        msg = msg.replace(s, "OUT")
    return msg.strip()


def run_mergekit(
    python: Path, config: str, cwd: Path, extra: list[str] | None = None
) -> tuple[dict[str, torch.Tensor] | None, str | None, list[str]]:
    """Run mergekit-yaml on `config` (relative to cwd); return (tensors, error, argv with OUT)."""
    exe = python.parent / "mergekit-yaml"
    flags = MERGEKIT_FLAGS + (extra or [])
    if config.startswith("lora"):
        flags += ["--lora-merge-cache", "CACHE"]  # where mergekit keeps the models it merged adapters into
    with tempfile.TemporaryDirectory(prefix="mk-e2e-") as tmp:
        out = Path(tmp) / "out"
        argv = [str(exe), config, str(out), *(str(Path(tmp) / "cache") if f == "CACHE" else f for f in flags)]
        res = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True)
        shown = ["mergekit-yaml", config, "OUT", *flags]
        if res.returncode != 0:
            return None, _error_message(res.stderr, [str(out), tmp]) or f"exit status {res.returncode}", shown
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(out.glob("*.safetensors")):
            for k, v in load_file(str(f)).items():
                if k in tensors:
                    raise RuntimeError(f"tensor {k} appears in more than one shard")
                tensors[k] = v
        if not tensors:
            return None, "mergekit exited 0 but wrote no .safetensors", shown
        return tensors, None, shown


def generate(python: Path) -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for top in {m.split("/")[0] for m in MODELS} | {"expected", "adapters"}:
        shutil.rmtree(OUT_DIR / top, ignore_errors=True)
    build_family(OUT_DIR)
    for name, text in CONFIGS.items():
        (OUT_DIR / f"{name}.yml").write_text(text)
    (OUT_DIR / "expected").mkdir()

    records = []
    for name in CONFIGS:
        config = f"{name}.yml"
        print(f"mergekit-yaml {config}", file=sys.stderr)
        tensors, error, argv = run_mergekit(python, config, OUT_DIR)
        rec = {
            "case": name,
            "config": config,
            "mergekit_version": MERGEKIT_VERSION,
            "cwd": "tests/data/mergekit_e2e",
            "command": " ".join(argv),
            "ok": error is None,
        }
        if error is None:
            expected = f"expected/{name}.safetensors"
            save_file(
                {k: tensors[k].contiguous() for k in sorted(tensors)},
                str(OUT_DIR / expected),
                metadata={"format": "pt"},
            )
            rec["expected"] = expected
            rec["dtypes"] = {k: str(tensors[k].dtype).removeprefix("torch.") for k in sorted(tensors)}
        else:
            print(f"  failed: {error}", file=sys.stderr)
            rec["error"] = error
        records.append(rec)

    doc = {
        "generator": "scripts/mergekit_e2e.py",
        "mergekit_version": MERGEKIT_VERSION,
        "note": "run each command with cwd = tests/data/mergekit_e2e (model paths are relative); "
        "OUT is a fresh output folder; expected/<case>.safetensors gathers all output shards",
        "models": {"base": BASE, "experts": [ORCA, PLATYPUS, WIZARD]},
        "cases": records,
    }
    (OUT_DIR / "cases.json").write_text(json.dumps(doc, indent=2) + "\n")


# --------------------------------------------------------------------------- probes


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _interp(values: list[float], t: float) -> float:
    scaled = t * (len(values) - 1)
    i0 = int(scaled)
    i1 = min(len(values) - 1, i0 + 1)
    frac = scaled - i0
    return (1 - frac) * values[i0] + frac * values[i1]


def run_probes(python: Path) -> None:
    family = {m: load_file(str(OUT_DIR / m / "model.safetensors")) for m in MODELS}
    base, orca, plat = family[BASE], family[ORCA], family[PLATYPUS]
    names = list(tensor_shapes())
    report: dict[str, object] = {}

    with tempfile.TemporaryDirectory(prefix="mk-probe-") as tmp:
        tmp = Path(tmp)

        def merge(text: str, tag: str, cwd: Path = OUT_DIR, extra: list[str] | None = None):
            path = tmp / f"{tag}.yml"
            path.write_text(text)
            tensors, error, _ = run_mergekit(python, str(path), cwd, extra)
            return tensors, error

        lin2 = (
            f"models:\n  - model: {ORCA}\n    parameters:\n      weight: 0.6\n"
            f"  - model: {PLATYPUS}\n    parameters:\n      weight: 0.3\n"
            f"merge_method: linear\nbase_model: {BASE}\n"
        )
        # a. base_model set, base not among models, no global weight
        t_a, e_a = merge(lin2 + "dtype: float32\n", "a")
        report["a"] = {"error": e_a} if e_a else {"ok": True}
        if t_a:
            ref = {k: (0.6 * orca[k] + 0.3 * plat[k]) / 0.9 for k in names}
            report["a"]["maxdiff_vs_experts_only"] = max(_maxdiff(t_a[k], ref[k]) for k in names)

        # b. same with a global weight 0.2
        t_b, e_b = merge(lin2 + "parameters:\n  weight: 0.2\ndtype: float32\n", "b")
        report["b"] = {"error": e_b} if e_b else {}
        if t_b:
            with_base = {k: (0.6 * orca[k] + 0.3 * plat[k] + 0.2 * base[k]) / 1.1 for k in names}
            without = {k: (0.6 * orca[k] + 0.3 * plat[k]) / 0.9 for k in names}
            report["b"]["maxdiff_vs_base_weight_0.2"] = max(_maxdiff(t_b[k], with_base[k]) for k in names)
            report["b"]["maxdiff_vs_experts_only"] = max(_maxdiff(t_b[k], without[k]) for k in names)

        # c. ties with the base listed among models with parameters
        ties = CONFIGS["ties_fp32"]
        with_base_entry = ties.replace(
            "merge_method: ties",
            f"  - model: {BASE}\n    parameters:\n      weight: 0.7\n      density: 0.5\nmerge_method: ties",
        )
        t_c0, e_c0 = merge(ties, "c0")
        t_c1, e_c1 = merge(with_base_entry, "c1")
        report["c"] = (
            {"error": e_c0 or e_c1}
            if (e_c0 or e_c1)
            else {
                "bit_identical": all(torch.equal(t_c0[k], t_c1[k]) for k in t_c0) and t_c0.keys() == t_c1.keys(),
                "maxdiff": max(_maxdiff(t_c0[k], t_c1[k]) for k in t_c0),
            }
        )

        # d. one layer: which t does a gradient use for layer tensors?
        one = tmp / "one"
        for m in MODELS:
            sub = {k: v for k, v in family[m].items() if _layer(k) in (None, 0)}
            write_model(one / m, sub, llama_config(1))
        t_d, e_d = merge(
            f"models:\n  - model: {ORCA}\n    parameters:\n      weight: [0.2, 0.8]\n"
            f"  - model: {PLATYPUS}\n    parameters:\n      weight: 1.0\n"
            "merge_method: linear\nparameters:\n  normalize: false\ndtype: float32\n",
            "d",
            cwd=one,
        )
        report["d"] = {"error": e_d} if e_d else {}
        if t_d:
            # out = w * orca + plat  ->  least-squares w per tensor
            for k in [
                "model.embed_tokens.weight",
                "model.layers.0.mlp.up_proj.weight",
                "model.layers.0.input_layernorm.weight",
                "model.norm.weight",
                "lm_head.weight",
            ]:
                a = orca[k].double().flatten()
                w = ((t_d[k].double().flatten() - plat[k].double().flatten()) @ a / (a @ a)).item()
                report["d"][k] = round(w, 6)

        # e. tokenizer_source: base without tokenizer files
        tok = lin2 + "parameters:\n  weight: 0.2\ntokenizer_source: base\ndtype: float32\n"
        _, e_e1 = merge(tok, "e1")
        report["e"] = {"with --no-copy-tokenizer": e_e1 or "ok"}
        path = tmp / "e2.yml"
        path.write_text(tok)
        with tempfile.TemporaryDirectory() as o:
            res = subprocess.run(
                [str(python.parent / "mergekit-yaml"), str(path), o],
                cwd=OUT_DIR,
                env=_env(),
                capture_output=True,
                text=True,
            )
            report["e"]["default flags"] = "ok" if res.returncode == 0 else _error_message(res.stderr, [o])
            report["e"]["default flags files"] = sorted(os.listdir(o)) if res.returncode == 0 else None

        # f. per-model filter substring vs full tensor name
        t_f, e_f = merge(
            f"models:\n  - model: {ORCA}\n    parameters:\n      weight:\n"
            "        - filter: layers.1.\n          value: 1.0\n"
            "        - filter: model.layers.0.mlp.up_proj.weight\n          value: 2.0\n"
            "        - filter: model.norm\n          value: 3.0\n"
            "        - value: 0.0\n"
            f"  - model: {PLATYPUS}\n    parameters:\n      weight: 1.0\n"
            "merge_method: linear\nparameters:\n  normalize: false\ndtype: float32\n",
            "f",
        )
        report["f"] = {"error": e_f} if e_f else {}
        if t_f:
            weights = {}
            for k in names:
                a = orca[k].double().flatten()
                weights[k] = round(((t_f[k].double().flatten() - plat[k].double().flatten()) @ a / (a @ a)).item(), 6)
            report["f"]["nonzero_orca_weights"] = {k: w for k, w in weights.items() if abs(w) > 1e-6}

        # g. ties.yml gradients: compare against runs with the gradients replaced by scalars at t
        for variant, cfg in (("fp32", CONFIGS["ties_fp32"]), ("fp16", CONFIGS["ties"])):
            t_grad, e_g = merge(cfg, f"g_{variant}")
            if e_g:
                report[f"g_{variant}"] = {"error": e_g}
                continue
            scalar_runs = {}
            for i in range(LAYERS):
                t = i / (LAYERS - 1)
                d = _interp([1, 0.7, 0.1], t)
                w = _interp([0, 0.3, 0.7, 1], t)
                text = cfg.replace("density: [1, 0.7, 0.1] # density gradient", f"density: {d!r}").replace(
                    "weight: [0, 0.3, 0.7, 1] # weight gradient", f"weight: {w!r}"
                )
                scalar_runs[i], err = merge(text, f"g_{variant}_{i}")
                if err:
                    raise RuntimeError(err)
            # per group (a layer, or a non-layer tensor): the scalar runs every tensor of it equals
            matches: dict[str, set] = {}
            for k in names:
                hit = {i for i in range(LAYERS) if torch.equal(t_grad[k], scalar_runs[i][k])}
                key = f"layer {_layer(k)}" if _layer(k) is not None else k
                matches[key] = matches[key] & hit if key in matches else hit
            report[f"g_{variant}"] = {
                "scalar t runs (density, weight)": {
                    i: (round(_interp([1, 0.7, 0.1], i / 3), 6), round(_interp([0, 0.3, 0.7, 1], i / 3), 6))
                    for i in range(LAYERS)
                },
                "bit-identical to scalar run(s)": {k: sorted(v) for k, v in matches.items()},
            }

    print(json.dumps(report, indent=2, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probes", action="store_true", help="also run the behaviour probes (printed only)")
    args = ap.parse_args()
    python = mergekit_python()
    generate(python)
    if args.probes:
        run_probes(python)


if __name__ == "__main__":
    main()
