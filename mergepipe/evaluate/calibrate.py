"""Calibration statistics of a base model: per-channel input moments of its linear layers and
row frequencies of its embeddings over calibration texts, keyed by the checkpoint's tensor names."""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from mergepipe import torch
from mergepipe.errors import BadInput
from mergepipe.evaluate.perplexity import _transformers


@dataclass
class Calibration:
    moments: dict[str, np.ndarray]  # weight name -> E[x_j^2] of the Linear's input, length in_features
    frequencies: dict[str, np.ndarray]  # embedding weight name -> count of each row's id / ids seen
    tokens: int  # tokens run through the model
    texts: int  # texts run (those that gave at least one token)
    seconds: float
    device: str  # "cuda" or "cpu"


class _Sums:
    """One checkpoint tensor's running sums; a tied tensor gets both kinds."""

    def __init__(self) -> None:
        self.sum_sq = None  # float64 (in_features,), on the model's device
        self.inputs = 0  # tokens seen by the Linear(s) using this weight
        self.counts = None  # float64 (rows,), on the model's device
        self.ids = 0  # ids seen by the Embedding(s) using this weight


def calibrate_model(model_dir: str, texts: list[str], max_length: int, tensor_names: Collection[str]) -> Calibration:
    """Run the base model in `model_dir` over `texts` one at a time (no padding) and return the
    statistics of every nn.Linear / nn.Embedding whose weight is one of `tensor_names`.
    A folder transformers cannot load, texts with no token, or a model in which no Linear or
    Embedding was reached raise BadInput."""
    transformers = _transformers()
    names = set(tensor_names)
    start = time.monotonic()
    try:
        model, tokenizer, limit = _load(transformers, model_dir, names)
    except Exception as err:
        raise BadInput(f"{model_dir}: cannot load the model: {type(err).__name__}: {err}") from None
    device = model.device
    sums: dict[str, _Sums] = {}
    handles = []
    try:
        for module, name in _mapped_modules(model, names):
            handles.append(_hook(module, sums.setdefault(name, _Sums())))
        tokens = used = 0
        with torch.no_grad():
            for text in texts:
                enc = tokenizer(text, truncation=True, max_length=int(min(max_length, limit)), return_tensors="pt")
                n = int(enc["input_ids"].numel())
                if n == 0:
                    continue  # an empty input would fail inside the model and carries no statistic
                kwargs = {k: enc[k].to(device) for k in ("attention_mask", "token_type_ids") if k in enc}
                model(input_ids=enc["input_ids"].to(device), **kwargs)
                tokens += n
                used += 1
        if tokens == 0:
            raise BadInput(f"{model_dir}: the calibration texts give no token ({len(texts)} texts)")
        moments = {k: (s.sum_sq / s.inputs).cpu().numpy() for k, s in sums.items() if s.inputs}
        frequencies = {k: (s.counts / s.ids).cpu().numpy() for k, s in sums.items() if s.ids}
    finally:
        for handle in handles:
            handle.remove()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the merge that follows needs the memory
    if not moments and not frequencies:
        raise BadInput(
            f"{model_dir}: no nn.Linear or nn.Embedding whose weight is in the checkpoint was reached "
            "by the calibration texts"
        )
    return Calibration(moments, frequencies, tokens, used, time.monotonic() - start, device.type)


def _load(transformers, model_dir: str, names: set[str]):
    """The model in eval mode (on the GPU when there is one), its tokenizer, and the longest
    input its positions allow."""
    transformers.utils.logging.disable_progress_bar()  # a bar per load would drown the run's progress
    config = transformers.AutoConfig.from_pretrained(model_dir)
    auto = _auto_class(transformers, config, names)
    cuda = torch.cuda.is_available()
    # As stored on a GPU; float32 on a CPU, where half-precision kernels are slow or missing.
    model = auto.from_pretrained(model_dir, config=config, dtype="auto" if cuda else torch.float32)
    model.to("cuda" if cuda else "cpu").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    limit = getattr(config, "max_position_embeddings", None) or math.inf
    return model, tokenizer, limit


def _auto_class(transformers, config, names: set[str]):
    """The head class config.json names, unless the checkpoint lacks that head's weights (an
    encoder saved without its pretraining head): then the bare model, so no random head runs."""
    architectures = list(getattr(config, "architectures", None) or [])
    if any(a.endswith("ForCausalLM") for a in architectures):
        auto = transformers.AutoModelForCausalLM
    elif any(a.endswith("ForMaskedLM") for a in architectures):
        auto = transformers.AutoModelForMaskedLM
    else:
        return transformers.AutoModel
    # A weightless skeleton tells which parameters the head adds beyond the base model.
    try:
        with torch.device("meta"):
            skeleton = auto.from_config(config)
    except Exception:  # the check is a refinement: a head runs last, so a random one is harmless
        return auto
    base = {id(p) for p in skeleton.base_model.parameters()}
    prefix = _prefix(skeleton)
    aliases = _aliases(skeleton)
    for p in skeleton.parameters():
        if id(p) not in base and _checkpoint_name(aliases[id(p)], prefix, names) is None:
            return transformers.AutoModel
    return auto


def _prefix(model) -> str:
    prefix = getattr(model, "base_model_prefix", "") or ""
    return prefix + "." if prefix else ""


def _aliases(model) -> dict[int, list[str]]:
    """Every name each parameter goes by: a tied tensor has one per module that uses it."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return aliases


def _checkpoint_name(candidates: list[str], prefix: str, names: set[str]) -> str | None:
    """The checkpoint's name for a parameter: one of its names as is, without the base model's
    prefix (a head class loading a bare checkpoint), or with it (a bare class loading a
    checkpoint saved with its head)."""
    for name in candidates:
        forms = [name]
        if prefix:
            forms.append(name[len(prefix) :] if name.startswith(prefix) else prefix + name)
        for form in forms:
            if form in names:
                return form
    return None


def _mapped_modules(model, names: set[str]):
    """(module, checkpoint name) for every Linear and Embedding whose weight is in the checkpoint.
    transformers' Conv1D (GPT-2, weight (in, out)) is not an nn.Linear and is left out."""
    prefix = _prefix(model)
    aliases = _aliases(model)
    for module_name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        own = f"{module_name}.weight" if module_name else "weight"
        # The module's own name first, then the tied tensor's other names (lm_head -> embed_tokens).
        candidates = [own, *(a for a in aliases.get(id(module.weight), []) if a != own)]
        name = _checkpoint_name(candidates, prefix, names)
        if name is not None:
            yield module, name


def _hook(module, sums: _Sums):
    if isinstance(module, torch.nn.Embedding):
        rows = module.num_embeddings

        def count(_module, args, kwargs):
            ids = (args[0] if args else kwargs["input"]).reshape(-1)
            found = torch.bincount(ids, minlength=rows).to(torch.float64)
            sums.counts = found if sums.counts is None else sums.counts + found
            sums.ids += ids.numel()

        return module.register_forward_pre_hook(count, with_kwargs=True)

    def square(_module, args, kwargs):
        x = args[0] if args else kwargs["input"]
        x = x.detach().reshape(-1, x.shape[-1]).double()
        found = (x * x).sum(dim=0)
        sums.sum_sq = found if sums.sum_sq is None else sums.sum_sq + found
        sums.inputs += x.shape[0]

    return module.register_forward_pre_hook(square, with_kwargs=True)
