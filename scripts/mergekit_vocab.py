#!/usr/bin/env python3
"""Generate mergekit 0.1.5 references for mergepipe's vocabulary rules (index/vocabulary.py).

Writes tests/data/vocab/: four models with real tokenizers (tokenizers' BPE saved by
transformers) and a Llama config.json each, and an embedding of distinct fp32 rows:

    base     the tokenizer, vocab_size = its size
    chat     the same plus two special tokens (<|im_start|>, <|im_end|>) and one added token
    padded   the base's tokenizer with config vocab_size 48 (rows past the tokenizer: padding)
    other    other letters first: the shared tokens at other ids, some tokens of its own

then runs, with mergekit's own code in its venv (`.venv-mergekit`, as scripts/mergekit_parity.py
makes it), mergekit.tokenizer.build_tokenizer and PermutedVocabulary on those embeddings for
each case in CASES, and writes cases.json (the output tokens by id) and expected.safetensors
(each model's permuted embedding, `<case>/<model>`).

    .venv/bin/python scripts/mergekit_vocab.py

Licensing: mergekit (LGPL-3.0) runs in its own venv as an oracle; nothing of it is copied here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mergepipe.devtools.synthetic import write_tokenizer  # noqa: E402

OUT = ROOT / "tests" / "data" / "vocab"
MODELS = ["base", "chat", "padded", "other"]
HIDDEN = 4

# name -> (models in config order, base, source, tokens, pad_to_multiple_of)
CASES = {
    "union": (["base", "chat", "other"], "base", "union", {}, None),
    "base": (["base", "chat", "padded"], "base", "base", {}, None),
    "model": (["base", "chat", "other"], "base", "chat", {}, None),
    "tokens": (
        ["base", "chat", "other"],
        "base",
        "union",
        {
            "<|im_start|>": {"source": {"kind": "zero"}, "force": True},
            "ab": {"source": "chat", "force": True},
            "<new>": {"source": {"kind": "model_token", "model": "other", "token": "q"}},
        },
        8,
    ),
    "padded": (["padded", "chat"], "padded", "union", {}, 64),
}


def build() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for name in MODELS:
        folder = OUT / name
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(
            json.dumps(
                {
                    "architectures": ["LlamaForCausalLM"],
                    "model_type": "llama",
                    "hidden_size": HIDDEN,
                    "num_attention_heads": 1,
                    "num_key_value_heads": 1,
                }
            )
            + "\n"
        )
        kwargs = {
            "chat": {"special": ("<|im_start|>", "<|im_end|>"), "added": ("zz",)},
            "padded": {"vocab_size": 48},
            "other": {"letters": "qrstabcdefgh"},
        }.get(name, {})
        write_tokenizer(folder, **kwargs)
        sizes[name] = json.loads((folder / "config.json").read_text())["vocab_size"]
        g = torch.Generator().manual_seed(len(name) * 1000 + sum(map(ord, name)))
        save_file({"embed": torch.randn(sizes[name], HIDDEN, generator=g)}, str(folder / "embed.safetensors"))
    (OUT / "cases.json").write_text(json.dumps({"cases": CASES, "sizes": sizes}, indent=2) + "\n")


ORACLE = r"""
import json, sys, torch
from safetensors.torch import load_file, save_file
from mergekit.common import ModelReference
from mergekit.tokenizer.build import build_tokenizer
from mergekit.tokenizer.config import TokenEmbeddingConfig
from mergekit.tokenizer.embed import PermutedVocabulary

out = sys.argv[1]
cases = json.load(open(f"{out}/cases.json"))["cases"]
ref = lambda name: ModelReference.parse(f"{out}/{name}")
tensors, tokens = {}, {}
for case, (models, base, source, toks, pad) in cases.items():
    refs = [ref(m) for m in models]
    src = source if source in ("union", "base") else ref(source)
    info = build_tokenizer(ref(base), refs, src, False, add_tokens=tuple(toks))
    cfg = {}
    for t, c in toks.items():
        c = dict(c)
        s = c.get("source")
        if isinstance(s, str):
            c["source"] = f"{out}/{s}"
        elif isinstance(s, dict) and "model" in s:
            c["source"] = {**s, "model": f"{out}/{s['model']}"}
        cfg[t] = TokenEmbeddingConfig.model_validate(c)
    task = PermutedVocabulary.model_construct(tokens=cfg, pad_to_multiple_of=pad, base_model=ref(base), vocabulary_axis=0)
    embeds = {r: load_file(f"{out}/{m}/embed.safetensors")["embed"] for r, m in zip(refs, models)}
    done = task.execute(tokenizer_info=info, tensors=embeds)
    for r, m in zip(refs, models):
        tensors[f"{case}/{m}"] = done[r].contiguous()
    vocab = info.tokenizer.get_vocab()
    tokens[case] = sorted(vocab, key=vocab.get)
save_file(tensors, f"{out}/expected.safetensors")
json.dump(tokens, open(f"{out}/tokens.json", "w"), indent=1)
"""


def main() -> None:
    build()
    python = ROOT / ".venv-mergekit" / "bin" / "python"
    subprocess.run(
        [str(python), "-c", ORACLE, str(OUT)], check=True, env={"PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1"}
    )


if __name__ == "__main__":
    main()
