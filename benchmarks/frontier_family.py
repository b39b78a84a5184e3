"""A family with a 70B-class model's largest tensors, written a chunk of rows at a time (nothing
downloaded, nothing held whole: generating it needs little memory).

Per checkpoint, bf16: the embedding and an untied lm_head of 128256 × 8192 (2.1 GB each) and,
unless --no-layer, one decoder layer of a 70B-class model (hidden 8192, intermediate 28672, 64
query heads and 8 key/value heads of 128): 6.2 GB in all, or 4.2 GB without the layer. Experts:
full fine-tunes move about 10% of the embedding's rows, the lm_head and every layer weight by
small dense noise (relative size 0.1–0.3%); every fourth expert is LoRA-style and moves only
q_proj and v_proj. Deterministic: each chunk is seeded by (model, tensor, chunk).

    .venv/bin/python benchmarks/frontier_family.py --out /work/bench-data/frontier --experts 4
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import time
import zlib
from pathlib import Path

import torch

VOCAB, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 128256, 8192, 28672, 64, 8, 128
CHUNK_ELEMENTS = 1 << 25  # rows are generated and written about this many elements at a time


def tensor_shapes(layer: bool, vocab: int = VOCAB, hidden: int = HIDDEN) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    if layer:
        p = "model.layers.0."
        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (q, hidden),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.o_proj.weight": (hidden, q),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "mlp.gate_proj.weight": (INTERMEDIATE, hidden),
                p + "mlp.up_proj.weight": (INTERMEDIATE, hidden),
                p + "mlp.down_proj.weight": (hidden, INTERMEDIATE),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _gen(*keys: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(keys).encode()))


def _base_chunk(name: str, rows: tuple[int, int], shape: tuple[int, ...]) -> torch.Tensor:
    n = (rows[1] - rows[0],) + tuple(shape[1:])
    x = torch.randn(n, generator=_gen("base", name, rows[0]))
    return (1 + 0.05 * x if name.endswith("norm.weight") else 0.02 * x).to(torch.bfloat16)


def _moves(name: str, expert: int) -> bool:
    if name.endswith("norm.weight"):
        return False
    if expert % 4 == 3:  # LoRA-style
        return name.endswith("q_proj.weight") or name.endswith("v_proj.weight")
    return True


def _expert_chunk(name: str, rows: tuple[int, int], shape: tuple[int, ...], expert: int) -> torch.Tensor:
    w = _base_chunk(name, rows, shape)
    if not _moves(name, expert):
        return w
    g = _gen("delta", expert, name, rows[0])
    scale = 0.02 * (0.001 + 0.002 * ((expert * 7 + zlib.crc32(name.encode())) % 10) / 9)
    d = torch.randn(w.shape, generator=g).mul_(scale)
    if name == "model.embed_tokens.weight":  # only the rows of tokens the fine-tune saw
        d[torch.rand(w.shape[0], generator=g) >= 0.10] = 0
    return w.float().add_(d).to(torch.bfloat16)


def write_checkpoint(folder: Path, shapes: dict[str, tuple[int, ...]], expert: int | None) -> int:
    """One model.safetensors, header first, then each tensor a chunk of rows at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = folder / "model.safetensors.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in shapes.items():
            width = math.prod(shape[1:])
            step = max(1, CHUNK_ELEMENTS // width)
            for r0 in range(0, shape[0], step):
                rows = (r0, min(shape[0], r0 + step))
                t = _base_chunk(name, rows, shape) if expert is None else _expert_chunk(name, rows, shape, expert)
                f.write(t.contiguous().view(torch.int16).numpy().tobytes())
    tmp.rename(folder / "model.safetensors")
    return 8 + len(raw) + offset


def write_model_config(folder: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A Llama config.json that matches the tensors: mergekit reads the layer count and sizes
    from it to find every tensor it merges."""
    vocab, hidden = shapes["model.embed_tokens.weight"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "bfloat16",
        "num_hidden_layers": sum(1 for n in shapes if n.endswith("mlp.down_proj.weight")),
        "hidden_size": hidden,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--no-layer", action="store_true", help="only the embedding, lm_head and norm (4.2 GB each)")
    ap.add_argument("--vocab", type=int, default=VOCAB, help="fewer rows for a quick try")
    args = ap.parse_args()
    torch.set_num_threads(2)
    shapes = tensor_shapes(not args.no_layer, vocab=args.vocab)
    t0 = time.perf_counter()
    sizes = {}
    for label, expert in [("base", None)] + [(f"expert-{k}", k) for k in range(args.experts)]:
        folder = args.out / label
        if not (folder / "model.safetensors").exists():
            sizes[label] = write_checkpoint(folder, shapes, expert)
            write_model_config(folder, shapes)
            print(f"{label}: {sizes[label] / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    (args.out / "family.json").write_text(
        json.dumps({"experts": args.experts, "layer": not args.no_layer, "shapes": shapes}, indent=1)
    )


if __name__ == "__main__":
    main()
