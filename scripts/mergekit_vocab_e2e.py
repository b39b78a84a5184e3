#!/usr/bin/env python3
"""Generate end-to-end mergekit 0.1.5 fixtures for merges whose vocabularies differ.

Writes tests/data/vocab_e2e/: five tiny Llama checkpoints (hidden 16, 2 layers, fp32) whose
tokenizers are real (tokenizers' BPE saved by transformers, as scripts/mergekit_vocab.py makes
them) and whose embedding and head have their config's vocab_size rows:

    base     the tokenizer, vocab_size = its size
    chat     base + a delta, and two special tokens (<|im_start|>, <|im_end|>) and an added token
    padded   base + a delta, the base's tokenizer with config vocab_size 48 (rows past it: padding)
    other    base + a delta, other letters first: shared tokens at other ids, some of its own
    twin     chat's tokenizer, another delta

then one config per case (CONFIGS), run by `mergekit-yaml CONFIG OUT --no-write-model-card`
(cwd = that folder, the tokenizer written by mergekit), and a two-stage config (MULTI) run by
`mergekit-multi`, and records in cases.json each case's
output: its tensors in expected/<case>.safetensors, and its tokenizer as what it means (the
vocabulary by id, the added tokens with their flags, the chat template, config.json's
vocab_size).

    .venv/bin/python scripts/mergekit_vocab_e2e.py

A re-run writes the union cases with other ids for the new tokens (mergekit takes them in a hash
map's order, another in each process); the tests compare rows by token.

mergekit (LGPL-3.0) runs from `.venv-mergekit` (or $MERGEKIT_PYTHON) as an external program.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from mergekit_e2e import MERGEKIT_VERSION, _env, _error_message, llama_config, mergekit_python  # noqa: E402

from mergepipe.devtools.synthetic import tokenizer_meaning, write_tokenizer  # noqa: E402

OUT = ROOT / "tests" / "data" / "vocab_e2e"
LAYERS = 2
# chat templates: two models share one, a third has another, the base has none (chat_auto)
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
TOKENIZERS = {
    "base": {},
    "chat": {"special": ("<|im_start|>", "<|im_end|>"), "added": ("zz",), "chat_template": TEMPLATE},
    "padded": {"vocab_size": 48, "chat_template": TEMPLATE},
    "other": {"letters": "qrstabcdefgh", "chat_template": OTHER_TEMPLATE},
}
TOKENIZERS["twin"] = TOKENIZERS["chat"]  # chat's tokenizer, other weights

CONFIGS = {
    "union": """\
base_model: base
models:
  - model: base
    parameters: {weight: 0.5}
  - model: chat
    parameters: {weight: 0.3}
  - model: other
    parameters: {weight: 0.2}
merge_method: linear
tokenizer_source: union
dtype: float32
""",
    "base_source": """\
base_model: base
models:
  - model: chat
    parameters: {weight: 0.6}
  - model: padded
    parameters: {weight: 0.4}
merge_method: task_arithmetic
tokenizer_source: base
dtype: float32
""",
    "model_source": """\
base_model: base
models:
  - model: chat
    parameters: {weight: 0.5}
  - model: other
    parameters: {weight: 0.5}
merge_method: task_arithmetic
tokenizer_source: chat
dtype: float32
""",
    "tokens": """\
base_model: base
models:
  - model: chat
    parameters: {weight: 0.7}
  - model: other
    parameters: {weight: 0.3}
merge_method: task_arithmetic
tokenizer:
  source: union
  tokens:
    <|im_start|>:
      source: {kind: zero}
      force: true
    ab:
      source: chat
      force: true
    <new>:
      source: {kind: model_token, model: other, token: q}
  pad_to_multiple_of: 8
dtype: float32
""",
    "padded_union": """\
base_model: padded
models:
  - model: chat
    parameters: {weight: 1.0}
merge_method: task_arithmetic
tokenizer:
  source: union
  pad_to_multiple_of: 64
dtype: float32
""",
    # chat templates: the inputs' most common, with a built tokenizer
    "chat_auto": """\
base_model: base
models:
  - model: chat
    parameters: {weight: 0.4}
  - model: other
    parameters: {weight: 0.3}
  - model: padded
    parameters: {weight: 0.3}
merge_method: task_arithmetic
tokenizer_source: union
chat_template: auto
dtype: float32
""",
    # ... given as is, and by name, on a tokenizer copied (mergekit re-saves it)
    "chat_jinja": """\
models:
  - model: chat
    parameters: {weight: 0.5}
  - model: twin
    parameters: {weight: 0.5}
merge_method: linear
chat_template: "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}"
dtype: float32
""",
    "chat_named": """\
models:
  - model: chat
    parameters: {weight: 0.5}
  - model: twin
    parameters: {weight: 0.5}
merge_method: linear
chat_template: chatml
dtype: float32
""",
}

# mergekit-multi: a first stage unions two vocabularies, the final one merges it with a third
# model (its output an input, its vocabulary built from the first stage's tokenizer)
MULTI = {
    "two_stages": """\
name: first
base_model: base
models:
  - model: chat
    parameters: {weight: 0.5}
merge_method: task_arithmetic
tokenizer_source: union
dtype: float32
---
base_model: base
models:
  - model: first
    parameters: {weight: 0.6}
  - model: other
    parameters: {weight: 0.4}
merge_method: task_arithmetic
tokenizer_source: union
dtype: float32
""",
}


def _shapes(vocab: int) -> dict[str, tuple[int, ...]]:
    config = llama_config(LAYERS)
    h, inter = config["hidden_size"], config["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{n}.weight"] = (h, h)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    return shapes


def build() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    base_layers = None
    for name, kwargs in TOKENIZERS.items():
        folder = OUT / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(llama_config(LAYERS), indent=2) + "\n")
        write_tokenizer(folder, **kwargs)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        tensors = {}
        for t, shape in _shapes(vocab).items():
            x = torch.randn(shape, generator=g)
            if base_layers is not None and t in base_layers:  # an expert: the base + a small delta
                x = base_layers[t] + 0.01 * x
            elif t.endswith("norm.weight"):
                x = 1 + 0.05 * x
            else:
                x = 0.02 * x
            tensors[t] = x.contiguous()
        if base_layers is None:
            base_layers = {t: v for t, v in tensors.items() if "embed" not in t and "lm_head" not in t}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def run(case: str, text: str, argv: list[str]) -> dict:
    """Write the case's config, run mergekit on it (argv: its command, OUT and STAGES standing
    for a fresh output and intermediate folder), keep its tensors in expected/<case>.safetensors
    and return its record: the command and what the output's tokenizer means."""
    (OUT / f"{case}.yml").write_text(text)
    with tempfile.TemporaryDirectory(prefix="mk-vocab-") as tmp:
        out = Path(tmp) / "out"
        where = {"OUT": str(out), "STAGES": str(Path(tmp) / "stages")}
        res = subprocess.run([where.get(a, a) for a in argv], cwd=OUT, env=_env(), capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"{case}: {_error_message(res.stderr, [str(out), tmp])}")
        tensors = {}
        for f in sorted(out.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        save_file(dict(sorted(tensors.items())), str(OUT / "expected" / f"{case}.safetensors"))
        command = " ".join([Path(argv[0]).name, *argv[1:]])
        return {"command": command, **tokenizer_meaning(out)}


def main() -> None:
    python = mergekit_python()
    build()
    (OUT / "expected").mkdir()
    records = {}
    for case, text in CONFIGS.items():
        argv = [str(python.parent / "mergekit-yaml"), f"{case}.yml", "OUT", "--no-write-model-card"]
        records[case] = run(case, text, argv)
    for case, text in MULTI.items():
        argv = [str(python.parent / "mergekit-multi"), f"{case}.yml", "--out-path", "OUT"]
        records[case] = run(case, text, argv + ["--intermediate-dir", "STAGES", "--no-write-model-card"])
    doc = {"generator": "scripts/mergekit_vocab_e2e.py", "mergekit_version": MERGEKIT_VERSION, "cases": records}
    (OUT / "cases.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
