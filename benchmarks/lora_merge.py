"""LoRA experts read from their adapter files against the same experts stored as full models.

A 1B-class family (TinyLlama-1.1B's shapes: 22 layers, hidden 2048, intermediate 5632, 32 query
and 4 key/value heads of 64, vocab 32000, bf16, untied head): a base, one dense fine-tune, and
three rank-16 PEFT adapters on every attention and MLP projection (fp32 factors, alpha 32). Each
adapter is also written as the full model it makes of the base (mergepipe's own arithmetic,
storage.adapters.changed_rows, so both forms merge to the same bytes). Then, with a cold page
cache each time, the same task-arithmetic merge at 100% from the adapters and from the full
models: the index pass and the merge, wall time, peak RSS and bytes read per role.

    .venv/bin/python benchmarks/lora_merge.py --data /work/bench-data/lora --json benchmarks/results/lora/3-after.json

writes about 13 GB under --data (check `df` first) and deletes nothing: pass --clean to remove it
at the end. --layers and --hidden shrink it for a quick try.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.measure import evict, model_files, run  # noqa: E402
from mergepipe.devtools.synthetic import write_adapter  # noqa: E402
from mergepipe.storage.adapters import LoraTensor, changed_rows  # noqa: E402
from mergepipe.storage.safetensors_format import TensorPlace, encode  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shapes(layers: int, hidden: int, intermediate: int, kv: int, vocab: int) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    out["model.norm.weight"] = (hidden,)
    return out


def generate(data: Path, args) -> dict[str, Path]:
    g = torch.Generator().manual_seed(0)
    base = {
        n: (torch.randn(s, generator=g) * (0.02 if len(s) == 2 else 0.01) + (0 if len(s) == 2 else 1)).to(
            torch.bfloat16
        )
        for n, s in shapes(args.layers, args.hidden, args.intermediate, args.kv, args.vocab).items()
    }
    paths = {"base": data / "base"}
    paths["base"].mkdir(parents=True, exist_ok=True)
    save_file(base, str(paths["base"] / "model.safetensors"))
    dense = {
        n: (t.float() + torch.randn(t.shape, generator=g) * 2e-4).to(t.dtype) if t.dim() == 2 else t
        for n, t in base.items()
    }
    paths["dense"] = data / "dense"
    paths["dense"].mkdir(exist_ok=True)
    save_file(dense, str(paths["dense"] / "model.safetensors"))
    del dense
    for i in range(args.adapters):
        folder = write_adapter(
            data / f"adapter-{i}", base, 10 + i, rank=args.rank, targets=TARGETS, alpha=2 * args.rank
        )
        paths[f"adapter-{i}"] = folder
        factors = load_file(str(folder / "adapter_model.safetensors"))
        full = dict(base)
        scale = 2.0  # alpha / r
        for name, t in base.items():
            key = "base_model.model." + name.removesuffix(".weight")
            if key + ".lora_A.weight" not in factors:
                continue
            a, b = factors[key + ".lora_A.weight"], factors[key + ".lora_B.weight"]
            place = TensorPlace("w", "BF16", tuple(t.shape), 0, t.numel() * 2)
            lt = LoraTensor(
                "",
                place,
                "",
                TensorPlace("a", "F32", tuple(a.shape), 0, 0),
                TensorPlace("b", "F32", tuple(b.shape), 0, 0),
                scale,
                False,
            )
            full[name] = changed_rows(lt, encode(t), [encode(b)], a, 0, t.shape[0])
        paths[f"full-{i}"] = data / f"full-{i}"
        paths[f"full-{i}"].mkdir(exist_ok=True)
        save_file(full, str(paths[f"full-{i}"] / "model.safetensors"))
    return paths


def config(path: Path, paths: dict[str, Path], experts: list[str]) -> Path:
    models = [{"model": e, "parameters": {"weight": 0.25}} for e in experts]
    path.write_text(
        yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": str(paths["base"]), "models": models})
    )
    return path


def measure(label: str, cfg: Path, data: Path, files: list[Path]) -> dict:
    catalog, out = data / f"{label}.duckdb", data / f"out-{label}"
    shutil.rmtree(out, ignore_errors=True)
    catalog.unlink(missing_ok=True)
    mp = [str(Path(sys.executable).parent / "mergepipe")]
    evict(files)
    index = run([*mp, "index", str(cfg), "--catalog", str(catalog), "--json"])
    evict(files)
    merged = run([*mp, "merge", str(cfg), "--out", str(out), "--catalog", str(catalog), "--json"])
    result = merged.json()
    return {
        "index_seconds": round(index.seconds, 2),
        "merge_seconds": round(merged.seconds, 2),
        "merge_peak_rss": merged.peak_rss,
        "bytes": {k: v for k, v in result["bytes"].items() if v},
        "expert_bytes_read": result["expert_bytes_read"],
        "full_expert_bytes": result["full_expert_bytes"],
        "digest": result["digest"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--kv", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=3)
    ap.add_argument("--clean", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    paths = generate(args.data, args)
    made = time.perf_counter() - t0
    adapters = [f"{paths['base']}+{paths[f'adapter-{i}']}" for i in range(args.adapters)]
    fulls = [str(paths[f"full-{i}"]) for i in range(args.adapters)]
    files = [
        f
        for p in paths.values()
        for f in (model_files(p) if (p / "model.safetensors").exists() else [p / "adapter_model.safetensors"])
    ]
    results = {
        "shape": vars(args) | {"data": str(args.data), "json": str(args.json)},
        "generate_seconds": round(made, 1),
    }
    for label, experts in (("adapters", adapters), ("full-models", fulls)):
        cfg = config(args.data / f"{label}.yml", paths, [str(paths["dense"]), *experts])
        results[label] = measure(label, cfg, args.data, files)
        print(label, json.dumps(results[label]), flush=True)
    shards = [
        json.loads((args.data / f"out-{label}" / "mergepipe-manifest.json").read_text())["content"]["output"]["shards"]
        for label in ("adapters", "full-models")
    ]
    results["same_output_bytes"] = shards[0] == shards[1]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    if args.clean:
        shutil.rmtree(args.data)


if __name__ == "__main__":
    main()
