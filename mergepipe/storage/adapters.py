"""LoRA adapters as PEFT saves them (adapter_config.json, adapter_model.safetensors): which
weights an adapter changes and how, and the rows of a changed weight as its model's rows plus
scale · B·A, made from only the factor rows they need (PEFT's definitions: its scaling, rsLoRA,
rank and alpha patterns, fan_in_fan_out, embeddings)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from mergepipe import torch
from mergepipe.errors import BadInput
from mergepipe.storage.canonical import digest_of
from mergepipe.storage.safetensors_format import DTYPES, TensorPlace, decode

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What PEFT puts before a module's name in the keys it saves (PeftModel, then its LoraModel).
KEY_PREFIX = "base_model.model."
# The file a changed weight lies in, in a view (storage.virtual): never opened, read through its
# recipe (storage.reader reads its factor rows and its model's rows, and computes the rest).
PREFIX = "lora:"
# Keys a LoRA adapter holds per module: PEFT's Linear (lora_A.weight, lora_B.weight) and
# Embedding (lora_embedding_A, lora_embedding_B) layers.
_FACTOR = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B)$")
# Rows of a changed weight computed at a time: bounds the fp32 scratch of a large read.
SLAB_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class LoraTensor:
    """One weight as an adapter changes it: rows r of the model's tensor (`home`, a shard's
    location, and `place` in it) plus scale · (B·A)[r], or scale · (B·A)ᵀ[r] when `transposed`
    (PEFT's fan_in_fan_out, and its embeddings), rounded once to the tensor's dtype as PEFT's
    merge rounds it. `a` and `b` are the factors' places in the adapter's weights file
    (`adapter`). The factor indexed by the weight's rows (B, or A's columns when transposed) is
    read for the rows wanted; the other one whole."""

    home: str
    place: TensorPlace
    adapter: str
    a: TensorPlace
    b: TensorPlace
    scale: float
    transposed: bool

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of the changed weight as stored."""
        return math.prod(self.place.shape[1:]) * DTYPES[self.place.dtype].itemsize

    @property
    def whole(self) -> TensorPlace:
        """The factor every row needs whole."""
        return self.b if self.transposed else self.a

    def factor_ranges(self, r0: int, r1: int) -> list[tuple[int, int]]:
        """The adapter file's byte ranges that rows [r0, r1) of the weight need of the other
        factor: B's rows, or each of A's rows' columns [r0, r1) when transposed."""
        if r1 <= r0:
            return []
        if not self.transposed:
            size = self.rank * DTYPES[self.b.dtype].itemsize
            return [(self.b.start + r0 * size, self.b.start + r1 * size)]
        size, width = DTYPES[self.a.dtype].itemsize, self.a.shape[1]
        return [
            (self.a.start + (j * width + r0) * size, self.a.start + (j * width + r1) * size) for j in range(self.rank)
        ]

    def cost(self, r0: int, r1: int) -> int:
        """What reading rows [r0, r1) costs besides the whole factor (the plan's pair bytes)."""
        return sum(e - s for s, e in self.factor_ranges(r0, r1))

    @property
    def whole_bytes(self) -> int:
        return self.whole.nbytes

    def whole_cost(self, rows: list[tuple[int, int]]) -> int:
        """What reading these row ranges reads once besides their cost(): the factor every
        row needs."""
        return self.whole.nbytes if rows else 0

    def as_json(self) -> dict:
        return {"kind": "lora", **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> "LoraTensor":
        data = {k: v for k, v in data.items() if k != "kind"}
        for key in ("place", "a", "b"):
            f, d, s, a, e = data[key]
            data[key] = TensorPlace(f, d, tuple(s), a, e)
        return cls(**data)

    @property
    def name(self) -> str:
        """Its file name in a view: the same recipe, the same name, in any process."""
        return f"{PREFIX}{digest_of(self.as_json())[:24]}"


def changed_rows(t: LoraTensor, home_rows: memoryview, factor: list[memoryview], whole: torch.Tensor, r0: int, r1: int):
    """Rows [r0, r1) of the changed weight, as stored: the model's rows widened to fp32, plus
    scale times the rank-r product summed one rank at a time in a fixed order (the same bits
    whatever kernels the CPU has), rounded once to the weight's dtype. `factor`: the buffers of
    factor_ranges(r0, r1); `whole`: the other factor, decoded."""
    n, width = r1 - r0, math.prod(t.place.shape[1:])
    out = decode(home_rows, t.place.dtype, (n, width)).clone()
    if t.transposed:  # A's columns [r0, r1), one buffer per rank: rows of the weight along dim 0
        rows = torch.stack([decode(b, t.a.dtype, (n,)) for b in factor], dim=1) if n else torch.empty(0, t.rank)
        other = whole.reshape(width, t.rank).t()  # B [width, r] -> [r, width]
    else:
        rows = decode(factor[0], t.b.dtype, (n, t.rank)) if n else torch.empty(0, t.rank)
        other = whole.reshape(t.rank, width)  # A [r, width]
    rows, other = rows.to(torch.float32), other.to(torch.float32)
    step = max(1, SLAB_ELEMENTS // max(1, width))
    for s in range(0, n, step):
        e = min(n, s + step)
        acc = rows[s:e, 0:1] * other[0:1]
        for j in range(1, t.rank):
            acc += rows[s:e, j : j + 1] * other[j : j + 1]
        acc *= t.scale
        acc += out[s:e].to(torch.float32)
        out[s:e] = acc.to(out.dtype)
    return out


def _pattern_key(patterns: dict, module: str) -> str:
    """PEFT's get_pattern_key: the first pattern that matches the module name's end."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def _refuse(uri: str, config: dict) -> None:
    """What this reading of PEFT's format does not cover, refused by name."""
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise BadInput(f"{uri}/{ADAPTER_CONFIG}: peft_type {kind!r}: only LoRA adapters are merged")
    for key, why in (
        ("use_dora", "DoRA rescales each weight's columns by a learned magnitude"),
        ("lora_bias", "the adapter changes biases too"),
        ("modules_to_save", "the adapter replaces whole modules"),
        ("trainable_token_indices", "the adapter replaces some embedding rows"),
    ):
        if config.get(key):
            raise BadInput(f"{uri}/{ADAPTER_CONFIG}: {key}: not supported by mergepipe ({why})")


def _number(uri: str, config: dict, key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise BadInput(f"{uri}/{ADAPTER_CONFIG}: {key} must be a positive number, got {value!r}")
    return float(value)


def adapter_targets(
    uri: str, config: dict, factors: dict[str, TensorPlace], weights: dict[str, TensorPlace]
) -> dict[str, tuple[TensorPlace, TensorPlace, float, bool]]:
    """The weights an adapter changes, by the model's tensor name: (A's place, B's place, scale,
    transposed), from its adapter_config.json (`config`) and its weights file's tensors
    (`factors`), checked against the model's tensors (`weights`). Exit 2 naming the adapter and
    the key or tensor that does not fit."""
    if not isinstance(config, dict):
        raise BadInput(f"{uri}/{ADAPTER_CONFIG}: not a JSON object")
    _refuse(uri, config)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    r_default = _number(uri, config, "r", config.get("r", 8))
    alpha_default = _number(uri, config, "lora_alpha", config.get("lora_alpha", 8))
    modules: dict[str, dict[str, TensorPlace]] = {}
    for key, place in factors.items():
        m = _FACTOR.match(key)
        if m is None or not m.group("module").startswith(KEY_PREFIX):
            raise BadInput(
                f"{uri}/{ADAPTER_WEIGHTS}: tensor {key!r} is not a LoRA factor (lora_A or lora_B of a module)"
            )
        kind = "A" if m.group("kind") in ("lora_A.weight", "lora_embedding_A") else "B"
        embedding = m.group("kind").startswith("lora_embedding")
        modules.setdefault(m.group("module").removeprefix(KEY_PREFIX), {})[kind + ("e" if embedding else "")] = place
    out = {}
    for module, got in sorted(modules.items()):
        embedding = "Ae" in got or "Be" in got
        a, b = (got.get("Ae"), got.get("Be")) if embedding else (got.get("A"), got.get("B"))
        if a is None or b is None:
            raise BadInput(f"{uri}/{ADAPTER_WEIGHTS}: module {module!r} has one LoRA factor, not both")
        name = f"{module}.weight"
        target = weights.get(name)
        if target is None:
            raise BadInput(f"{uri}: the adapter changes {name!r}, which the model does not have")
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise BadInput(
                f"{uri}: {module}: factors of shapes {list(a.shape)} (A) and {list(b.shape)} (B) do not multiply"
            )
        transposed = embedding or bool(config.get("fan_in_fan_out"))
        product = (a.shape[1], b.shape[0]) if transposed else (b.shape[0], a.shape[1])
        if tuple(target.shape) != product:
            raise BadInput(
                f"{uri}: {module}: B·A{'ᵀ' if transposed else ''} has shape {list(product)}, "
                f"the model's {name!r} has {list(target.shape)}"
            )
        for which, place in (("A", a), ("B", b)):
            if not DTYPES[place.dtype].is_float:
                raise BadInput(f"{uri}: {module}: factor {which} has dtype {place.dtype}, not a float")
        if not DTYPES[target.dtype].is_float:
            raise BadInput(f"{uri}: {module}: the model's {name!r} is a {target.dtype} tensor, not a float weight")
        rank = a.shape[0]
        r = float(rank_pattern.get(_pattern_key(rank_pattern, module), r_default))
        alpha = float(alpha_pattern.get(_pattern_key(alpha_pattern, module), alpha_default))
        if r != rank:
            raise BadInput(f"{uri}: {module}: factors of rank {rank}, the config says r = {r:g}")
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        out[name] = (a, b, scale, transposed)
    if not out:
        raise BadInput(f"{uri}/{ADAPTER_WEIGHTS}: holds no LoRA factors")
    return out
