"""Calibration statistics of a base model over calibration texts, keyed by the checkpoint's tensor
names: per-channel input moments of its linear layers and row frequencies of its embeddings, and
with gradients, the second moments of the gradient at each linear layer's output channels and at
each embedding row's uses."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import numpy as np

from mergepipe import torch
from mergepipe.catalog.calibration import TensorWeights
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
    # With gradients (empty without): weight name -> E[g_r^2] at the Linear's output channels,
    # and embedding weight name -> E[1{token = r} * mean_j g_j^2] per row, over the positions
    # back-propagated; g the gradient of `objective` (below).
    output_moments: dict[str, np.ndarray] = field(default_factory=dict)
    token_gradients: dict[str, np.ndarray] = field(default_factory=dict)
    objective: str = ""  # "loss" (a causal LM's summed token loss) or "projection" (see _objective)

    def tensor_weights(self) -> dict[str, TensorWeights]:
        """What the index pass weighs each reached tensor's delta blocks by (index/stats.py
        weighted_energy): input moments on the columns; with gradients, the output moments on
        the rows and the token weights, both relative to gradient_scale."""
        scale = self.gradient_scale()
        weights = {}
        for n in sorted(set(self.moments) | set(self.frequencies)):
            outputs = self.output_moments.get(n)
            token = self.token_gradients.get(n)
            weights[n] = TensorWeights(
                columns=self.moments.get(n),
                # The token's weight, relative like the outputs': its frequency times the
                # gradient's moment at its uses; a frequency alone where no gradient reached it.
                rows=token / scale if token is not None and scale > 0 else self.frequencies.get(n),
                outputs=outputs / scale if outputs is not None and scale > 0 else None,
            )
        return weights

    def gradient_scale(self) -> float:
        """The mean of E[g_r^2] over every output channel of every Linear reached: what makes the
        gradient weights relative (1 = an average channel), so that tensors no hook reached,
        which keep their data-free value, rank on the same scale."""
        found = [m for m in self.output_moments.values() if m.size]
        return float(np.concatenate(found).mean()) if found else 0.0


class _Sums:
    """One checkpoint tensor's running sums; a tied tensor gets both kinds."""

    def __init__(self) -> None:
        self.sum_sq = None  # float64 (in_features,), on the model's device
        self.inputs = 0  # tokens seen by the Linear(s) using this weight
        self.counts = None  # float64 (rows,), on the model's device
        self.ids = 0  # ids seen by the Embedding(s) using this weight
        self.out_features = 0
        self.grad_sq = None  # float64 (out_features,): sum of g_r^2 at the Linear's outputs
        self.grads = 0  # positions back-propagated through the Linear(s)
        self.token_grad = None  # float64 (rows,): sum of mean_j g_j^2 at each row's uses
        self.token_grads = 0  # positions back-propagated through the Embedding(s)


def calibrate_model(
    model_dir: str, texts: list[str], max_length: int, tensor_names: Collection[str], gradients: bool = False
) -> Calibration:
    """Run the base model in `model_dir` over `texts` one at a time (no padding) and return the
    statistics of every nn.Linear / nn.Embedding whose weight is one of `tensor_names`; with
    `gradients`, also back-propagate each text's objective (_objective) and gather the gradients'
    second moments at those modules' outputs. A folder transformers cannot load, texts with no
    token, or a model in which no Linear or Embedding was reached raise BadInput."""
    transformers = _transformers()
    start = time.monotonic()
    try:
        model, tokenizer, limit, causal = _load(transformers, model_dir, set(tensor_names))
    except Exception as err:
        raise BadInput(f"{model_dir}: cannot load the model: {type(err).__name__}: {err}") from None
    device = model.device

    def inputs():
        for text in texts:
            enc = tokenizer(text, truncation=True, max_length=int(min(max_length, limit)), return_tensors="pt")
            kwargs = {k: enc[k].to(device) for k in ("attention_mask", "token_type_ids") if k in enc}
            yield enc["input_ids"].to(device), kwargs

    objective = None
    if gradients:
        generator = torch.Generator().manual_seed(0)  # the projections' draws: the same on every machine

        def objective(out, ids, _kwargs):
            return _objective(out, ids, causal, generator)

    try:
        return gather_statistics(
            model,
            inputs(),
            tensor_names,
            objective,
            "loss" if causal else "projection",
            where=model_dir,
            started=start,
        )
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the merge that follows needs the memory


def gather_statistics(
    model,
    inputs: Iterable[tuple],
    tensor_names: Collection[str],
    objective: Callable | None = None,
    objective_name: str = "",
    where: str = "the model",
    started: float | None = None,
) -> Calibration:
    """The statistics of `model` (a torch module in eval mode) over `inputs`, pairs (input_ids,
    other keyword arguments of its forward), for every nn.Linear / nn.Embedding whose weight is
    one of `tensor_names`. With `objective(output, input_ids, kwargs)` (a scalar to
    back-propagate, or None to skip the input), the gradients' second moments too, under
    `objective_name`; the model's parameters then stop requiring gradients. BadInput (naming
    `where`) when no input has a token or no module was reached."""
    names = set(tensor_names)
    start = time.monotonic() if started is None else started
    gradients = objective is not None
    sums: dict[str, _Sums] = {}
    handles = []
    try:
        if gradients:
            # Only the activations' gradients are wanted: no weight gets one, and the embeddings'
            # outputs become the leaves that back-propagation starts the graph from.
            for p in model.parameters():
                p.requires_grad_(False)
            for module in model.modules():
                if isinstance(module, torch.nn.Embedding):
                    handles.append(module.register_forward_hook(_leaf))
        for module, name in _mapped_modules(model, names):
            handles.extend(_hooks(module, sums.setdefault(name, _Sums()), gradients))
        tokens = used = 0
        with torch.enable_grad() if gradients else torch.no_grad():
            for ids, kwargs in inputs:
                n = int(ids.numel())
                if n == 0:
                    continue  # an empty input would fail inside the model and carries no statistic
                out = model(input_ids=ids, **kwargs)
                if gradients:
                    value = objective(out, ids, kwargs)
                    if value is not None:
                        value.backward()
                tokens += n
                used += 1
    finally:
        for handle in handles:
            handle.remove()
    if tokens == 0:
        raise BadInput(f"{where}: the calibration texts give no token")
    moments = {k: (s.sum_sq / s.inputs).cpu().numpy() for k, s in sums.items() if s.inputs}
    frequencies = {k: (s.counts / s.ids).cpu().numpy() for k, s in sums.items() if s.ids}
    # A Linear that ran but that no gradient reached (a pooler the objective does not use)
    # does not move the objective: its output channels weigh nothing.
    outputs = {
        k: (s.grad_sq / s.grads).cpu().numpy() if s.grads else np.zeros(s.out_features)
        for k, s in sums.items()
        if gradients and s.inputs
    }
    token_grads = {k: (s.token_grad / s.token_grads).cpu().numpy() for k, s in sums.items() if s.token_grads}
    if not moments and not frequencies:
        raise BadInput(
            f"{where}: no nn.Linear or nn.Embedding whose weight is in the checkpoint was reached "
            "by the calibration texts"
        )
    if gradients and not any(s.grads for s in sums.values()):
        raise BadInput(f"{where}: no gradient reached a linear layer (texts of one token each give none)")
    return Calibration(
        moments,
        frequencies,
        tokens,
        used,
        time.monotonic() - start,
        next(model.parameters()).device.type,
        output_moments=outputs,
        token_gradients=token_grads,
        objective=objective_name if gradients else "",
    )


def _objective(out, ids, causal: bool, generator):
    """What a text's gradients are taken of. A causal LM: its next-token loss summed over the
    positions (so a weight's sensitivity is the loss's: the empirical Fisher's factors). Any
    other model (a bare encoder, a masked LM): each of its tensor outputs (hidden states,
    pooled output, logits) projected on a fresh standard normal draw per element, whose
    gradient's second moment at a channel is the diagonal of JᵀJ: how far a change there moves
    the model's outputs. None for a causal text of one token, which predicts nothing."""
    if causal:
        if ids.shape[-1] < 2:
            return None
        first = out[0] if isinstance(out, tuple) else out["logits"]
        logits = first[..., :-1, :].float().reshape(-1, first.shape[-1])
        return torch.nn.functional.cross_entropy(logits, ids[..., 1:].reshape(-1), reduction="sum")
    total = None
    for value in out.values() if hasattr(out, "values") else out:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad:
            draw = torch.randn(value.shape, generator=generator, dtype=torch.float32).to(value.device)
            term = (value.float() * draw).sum()
            total = term if total is None else total + term
    return total


def _load(transformers, model_dir: str, names: set[str]):
    """The model in eval mode (on the GPU when there is one), its tokenizer, the longest input its
    positions allow, and whether it is a causal LM."""
    transformers.utils.logging.disable_progress_bar()  # a bar per load would drown the run's progress
    config = transformers.AutoConfig.from_pretrained(model_dir)
    auto = _auto_class(transformers, config, names)
    cuda = torch.cuda.is_available()
    # As stored on a GPU; float32 on a CPU, where half-precision kernels are slow or missing.
    model = auto.from_pretrained(model_dir, config=config, dtype="auto" if cuda else torch.float32)
    model.to("cuda" if cuda else "cpu").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    limit = getattr(config, "max_position_embeddings", None) or math.inf
    return model, tokenizer, limit, auto is transformers.AutoModelForCausalLM


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


def _leaf(_module, _args, output):
    """An embedding's output, made a leaf that gradients reach (no weight requires one)."""
    return output.detach().requires_grad_()


def _hooks(module, sums: _Sums, gradients: bool) -> list:
    if isinstance(module, torch.nn.Embedding):
        rows = module.num_embeddings

        def count(_module, args, kwargs):
            ids = (args[0] if args else kwargs["input"]).reshape(-1)
            found = torch.bincount(ids, minlength=rows).to(torch.float64)
            sums.counts = found if sums.counts is None else sums.counts + found
            sums.ids += ids.numel()

        def uses(_module, args, kwargs, output):
            ids = (args[0] if args else kwargs["input"]).reshape(-1)

            def gathered(g):
                per = g.detach().reshape(-1, g.shape[-1]).double().pow(2).mean(dim=1)
                found = torch.zeros(rows, dtype=torch.float64, device=per.device).index_add_(0, ids, per)
                sums.token_grad = found if sums.token_grad is None else sums.token_grad + found
                sums.token_grads += ids.numel()

            if output.requires_grad:
                output.register_hook(gathered)

        handles = [module.register_forward_pre_hook(count, with_kwargs=True)]
        if gradients:
            handles.append(module.register_forward_hook(uses, with_kwargs=True))
        return handles

    def square(_module, args, kwargs):
        x = args[0] if args else kwargs["input"]
        x = x.detach().reshape(-1, x.shape[-1]).double()
        found = (x * x).sum(dim=0)
        sums.sum_sq = found if sums.sum_sq is None else sums.sum_sq + found
        sums.inputs += x.shape[0]

    sums.out_features = module.out_features

    def outputs(_module, _args, output):
        def gathered(g):
            g = g.detach().reshape(-1, g.shape[-1]).double()
            found = (g * g).sum(dim=0)
            sums.grad_sq = found if sums.grad_sq is None else sums.grad_sq + found
            sums.grads += g.shape[0]

        if output.requires_grad:
            output.register_hook(gathered)

    handles = [module.register_forward_pre_hook(square, with_kwargs=True)]
    if gradients:
        handles.append(module.register_forward_hook(outputs))
    return handles
