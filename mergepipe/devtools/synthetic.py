"""Small synthetic checkpoint families (for the demo and the tests).

Llama-shaped names, bf16 matrices and fp32 norms, tied embeddings (no lm_head), an int64
buffer, a 0-d scalar and a zero-size tensor, sharded with an index json. Experts are fine-tune-like: dense
low-rank-plus-noise deltas whose size varies by layer, norms left untouched, or LoRA-style
deltas in a few attention projections only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from mergepipe import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class FamilyPaths:
    base: Path
    experts: list[Path]


def base_tensors(
    n_layers: int, hidden: int, intermediate: int, vocab: int, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    t = {"model.embed_tokens.weight": w(vocab, hidden)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{name}.weight"] = w(hidden, hidden)
        t[p + "mlp.gate_proj.weight"] = w(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = w(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, intermediate)
        t[p + "input_layernorm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.01
        t[p + "post_attention_layernorm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.01
    t["model.norm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.01
    t["model.logit_scale"] = torch.tensor(1.0)  # 0-d scalar
    t["model.unused_bias"] = torch.zeros(0, hidden)  # zero-size
    t["model.position_ids"] = torch.arange(32, dtype=torch.int64).reshape(1, 32)  # non-float buffer
    return t


def dense_expert(base: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Low rank plus noise on every matrix, larger in later layers; norms and buffers untouched."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in base.items():
        if t.dim() == 2 and t.is_floating_point() and "position" not in name:
            layer = int(name.split(".")[2]) + 1 if ".layers." in name else 1
            rows, cols = t.shape
            a, b = torch.randn(rows, 4, generator=g), torch.randn(4, cols, generator=g)
            delta = (a @ b) / 2 + torch.randn(rows, cols, generator=g)
            delta = delta * (0.02 * scale * layer / 2)
            out[name] = (t.float() + delta).to(t.dtype)
        else:
            out[name] = t.clone()
    return out


def lora_expert(
    base: dict[str, torch.Tensor], seed: int, rank: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj")
) -> dict[str, torch.Tensor]:
    """Delta B @ A only in the targeted attention projections; everything else equals the base."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in base.items():
        if any(f"self_attn.{x}." in name for x in targets):
            rows, cols = t.shape
            delta = torch.randn(rows, rank, generator=g) @ torch.randn(rank, cols, generator=g) * 0.002
            out[name] = (t.float() + delta).to(t.dtype)
        else:
            out[name] = t.clone()
    return out


def write_model(folder: Path, tensors: dict[str, torch.Tensor], shards: int, sidecars: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards <= 1:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    else:
        per = -(-len(names) // shards)
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n].contiguous() for n in names[i * per : (i + 1) * per]}
            save_file(part, folder / fname, metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    if sidecars:
        (folder / "config.json").write_text(
            json.dumps({"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True}, indent=2)
        )
        (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel"}}))
    return folder


def make_family(
    root: str | Path,
    *,
    experts: tuple[str, ...] = ("dense", "dense", "lora"),
    n_layers: int = 2,
    hidden: int = 64,
    intermediate: int = 128,
    vocab: int = 256,
    dtype: str = "bfloat16",
    shards: int = 2,
    seed: int = 0,
) -> FamilyPaths:
    root = Path(root)
    base = base_tensors(n_layers, hidden, intermediate, vocab, DTYPES[dtype], seed)
    base_dir = write_model(root / "base", base, shards)
    expert_dirs = []
    for i, kind in enumerate(experts):
        if kind == "dense":
            tensors = dense_expert(base, seed + 100 + i)
        elif kind == "lora":
            tensors = lora_expert(base, seed + 100 + i)
        else:
            raise ValueError(f"unknown expert kind {kind!r}")
        expert_dirs.append(write_model(root / f"expert-{i}-{kind}", tensors, shards, sidecars=False))
    return FamilyPaths(base_dir, expert_dirs)


def write_adapter(
    folder: str | Path,
    base: dict[str, torch.Tensor],
    seed: int,
    *,
    rank: int = 4,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    alpha: float = 8,
    use_rslora: bool = False,
    dtype: torch.dtype = torch.float32,
    embedding: bool = False,
    scale: float = 0.05,
    **config,
) -> Path:
    """A PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) for the base's
    weights named by `targets` (and its embedding with `embedding`), as PEFT saves one: factors
    lora_A [r, in] and lora_B [out, r] per module under base_model.model.<module>, entries
    N(0, scale²). `config`: further adapter_config.json keys."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors, modules = {}, []
    for name in sorted(base):
        module = name.removesuffix(".weight")
        if base[name].dim() == 2 and module.rsplit(".", 1)[-1] in targets:
            out, inp = base[name].shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) * scale).to(
                dtype
            )
            tensors[f"base_model.model.{module}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * scale).to(
                dtype
            )
            modules.append(module.rsplit(".", 1)[-1])
        elif embedding and name == "model.embed_tokens.weight":
            vocab, hidden = base[name].shape
            tensors[f"base_model.model.{module}.lora_embedding_A"] = (torch.randn(rank, vocab, generator=g) * scale).to(
                dtype
            )
            tensors[f"base_model.model.{module}.lora_embedding_B"] = (
                torch.randn(hidden, rank, generator=g) * scale
            ).to(dtype)
            modules.append("embed_tokens")
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    settings = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": use_rslora,
        "target_modules": sorted(set(modules)),
        "fan_in_fan_out": False,
        "bias": "none",
        "lora_dropout": 0.0,
        **config,
    }
    (folder / "adapter_config.json").write_text(json.dumps(settings, indent=2))
    return folder


def write_tokenizer(
    folder: str | Path,
    letters: str = "abcdefghijklmnop",
    merges: int = 24,
    special: tuple[str, ...] = (),
    added: tuple[str, ...] = (),
    vocab_size: int | None = None,
    chat_template: str | None = None,
) -> int:
    """A small real BPE tokenizer (tokenizers' BPE, saved by transformers: tokenizer.json and
    tokenizer_config.json) over `letters` and their first `merges` pairs, with `special` tokens
    added as special and `added` as plain added tokens, and a chat template if given;
    config.json's vocab_size is set to `vocab_size` (default: the tokenizer's size) when the
    folder has one. Returns its size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in letters:
        vocab[c] = len(vocab)
    pairs = [(a, b) for a in letters for b in letters][:merges]
    for a, b in pairs:
        vocab.setdefault(a + b, len(vocab))
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if special:
        fast.add_special_tokens({"additional_special_tokens": list(special)})
    if added:
        fast.add_tokens(list(added))
    if chat_template is not None:
        fast.chat_template = chat_template
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    size = len(fast.get_vocab())
    config = folder / "config.json"
    if config.exists():
        data = json.loads(config.read_text())
        data["vocab_size"] = vocab_size or size
        config.write_text(json.dumps(data, indent=2))
    return size


def tokenizer_meaning(folder: str | Path) -> dict:
    """What a saved tokenizer means, as outputs are compared with mergekit's (the files differ
    with the transformers version that saved them): the vocabulary by id, the added tokens with
    their flags, the special tokens, the chat template, and config.json's vocab_size."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    vocab = tok.get_vocab()
    added = {
        str(i): {k: getattr(t, k) for k in ("content", "special", "single_word", "lstrip", "rstrip", "normalized")}
        for i, t in sorted(tok.added_tokens_decoder.items())
    }
    return {
        "tokens": sorted(vocab, key=vocab.get),
        "added": added,
        "special": sorted(tok.all_special_tokens),
        "chat_template": tok.chat_template,
        "vocab_size": json.loads((Path(folder) / "config.json").read_text())["vocab_size"],
    }


def write_config(path: str | Path, family: FamilyPaths, merge_method: str = "task_arithmetic", **extra) -> Path:
    import yaml

    path = Path(path)
    weights = extra.pop("weights", None) or [round(1.0 / len(family.experts), 6)] * len(family.experts)
    density = extra.pop("density", None)
    models = []
    for w, e in zip(weights, family.experts):
        params = {"weight": w}
        if density is not None:
            params["density"] = density
        models.append({"model": str(e), "parameters": params})
    cfg = {"merge_method": merge_method, "base_model": str(family.base), "models": models, **extra}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path
