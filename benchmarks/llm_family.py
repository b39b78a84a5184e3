"""Family 2: an LLM-shaped checkpoint family with fine-tune-like experts (nothing downloaded).

The tensor names, shapes and dtype of a Qwen2.5-0.5B-style decoder: 24 layers, hidden 896,
intermediate 4864, 14 query heads and 2 key/value heads of 64, q/k/v biases, vocab 151936,
tied embeddings, bf16, one `model.safetensors` of about 1 GB per checkpoint, with a Qwen2
`config.json` so mergekit can merge the same folders.

Experts look like published fine-tunes:
- full fine-tunes: each 2-D weight moves by a rank-16 term plus noise, with a relative size
  ‖Δ‖/‖W‖ between 0.1% and 0.5% that grows with depth and varies per expert; norms untouched;
  about one tensor in ten untouched; the embedding moves only in the rows of ~10% of tokens;
- LoRA-style experts (every fourth): only q_proj and v_proj move, by a rank-16 term.
Deltas are added in fp32 and rounded to bf16, as a bf16 checkpoint stores them; `family.json`
records the measured ‖τ‖/‖θ₀‖ of each expert after that rounding.

    .venv/bin/python benchmarks/llm_family.py --out /work/bench-data/llm --experts 8

writes base/ and expert-0 … expert-7/ (about 9 GB) in a few minutes. `--layers`, `--hidden`,
`--intermediate` and `--vocab` shrink it for a quick try. Deterministic: seeded per tensor.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPE = dict(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, head_dim=64, vocab=151936)


def tensor_shapes(
    layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, vocab: int
) -> dict[str, tuple[int, ...]]:
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, hidden),
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (hidden, q),
                p + "mlp.gate_proj.weight": (intermediate, hidden),
                p + "mlp.up_proj.weight": (intermediate, hidden),
                p + "mlp.down_proj.weight": (hidden, intermediate),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def qwen2_config(
    layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, vocab: int
) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": layers,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
    }


def _gen(*keys: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(keys).encode()))


def base_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = _gen("base", name)
    if name.endswith("norm.weight"):
        return (1 + 0.05 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    if name.endswith(".bias"):
        return (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    return (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)


def _low_rank(shape: tuple[int, int], rank: int, g: torch.Generator) -> torch.Tensor:
    u = torch.randn(shape[0], rank, generator=g)
    v = torch.randn(rank, shape[1], generator=g)
    return u @ v


def expert_delta(name: str, w: torch.Tensor, expert: int, kind: str, layer_frac: float) -> torch.Tensor | None:
    """The fp32 delta of one tensor, or None where the expert leaves it untouched."""
    g = _gen("delta", expert, name)
    if name.endswith("norm.weight"):
        return None
    if kind == "lora":
        if not (name.endswith("q_proj.weight") or name.endswith("v_proj.weight")):
            return None
        d = _low_rank(tuple(w.shape), 16, g)
        return d * (0.005 * w.float().norm() / d.norm())
    if torch.rand((), generator=g) < 0.1:
        return None
    # Relative size 0.1%..0.5%: deeper layers move more; each expert has its own scale.
    scale = (0.001 + 0.003 * layer_frac) * (0.75 + 0.5 * torch.rand((), generator=g).item())
    wf = w.float()
    if w.dim() == 1:
        d = torch.randn(w.shape, generator=g)
    elif name == "model.embed_tokens.weight":
        d = torch.zeros_like(wf)
        rows = torch.rand(w.shape[0], generator=g) < 0.10  # tokens the fine-tune saw
        d[rows] = torch.randn(int(rows.sum()), w.shape[1], generator=g)
    else:
        lr = _low_rank(tuple(w.shape), 16, g)
        noise = torch.randn(w.shape, generator=g)
        d = lr / lr.norm() * 0.8 + noise / noise.norm() * 0.6  # most energy low-rank, as in fine-tunes
    return d * (scale * wf.norm() / d.norm())


def _layer_frac(name: str, layers: int) -> float:
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        return int(parts[2]) / max(layers - 1, 1)
    return 0.0


def write_model(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.rename(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def build(out: Path, experts: int, dims: dict) -> dict:
    shapes = tensor_shapes(**dims)
    config = qwen2_config(**dims)
    t0 = time.perf_counter()
    base = {n: base_tensor(n, s) for n, s in shapes.items()}
    if not (out / "base" / "model.safetensors").exists():
        write_model(out / "base", base, config)
    info = {"dims": dims, "experts": [], "base": str(out / "base")}
    base_sq = math.fsum(float(t.float().pow(2).sum()) for t in base.values())
    for k in range(experts):
        kind = "lora" if k % 4 == 3 else "full"
        folder = out / f"expert-{k}"
        tensors, delta_sq, changed = {}, [], 0
        for name, w in base.items():
            d = expert_delta(name, w, k, kind, _layer_frac(name, dims["layers"]))
            x = w if d is None else (w.float() + d).to(torch.bfloat16)
            tensors[name] = x
            if d is not None:
                tau = x.float() - w.float()
                delta_sq.append(float(tau.pow(2).sum()))
                changed += int((tau != 0).sum())
        if not (folder / "model.safetensors").exists():
            write_model(folder, tensors, config)
        n = sum(t.numel() for t in base.values())
        info["experts"].append(
            {
                "path": str(folder),
                "kind": kind,
                "relative_delta": math.sqrt(math.fsum(delta_sq) / base_sq),
                "changed_elements": changed / n,
            }
        )
        print(
            f"expert-{k} ({kind}): ‖τ‖/‖θ₀‖ = {info['experts'][-1]['relative_delta']:.2e}, "
            f"{100 * changed / n:.1f}% of elements changed",
            flush=True,
        )
    info["seconds"] = time.perf_counter() - t0
    info["bytes_per_checkpoint"] = (out / "base" / "model.safetensors").stat().st_size
    (out / "family.json").write_text(json.dumps(info, indent=1))
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--experts", type=int, default=8)
    for key in ("layers", "hidden", "intermediate", "vocab"):
        ap.add_argument(f"--{key}", type=int, default=SHAPE[key])
    args = ap.parse_args()
    torch.set_num_threads(2)
    dims = {**SHAPE, **{k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "vocab")}}
    build(args.out, args.experts, dims)


if __name__ == "__main__":
    main()
