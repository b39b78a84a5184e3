"""What each input of a merge reads: a model as it is, or, for a `slices:` config, the output's
layers taken in turn from layer ranges of models (a view), as typed data for index/family."""

from __future__ import annotations

from dataclasses import dataclass

from mergepipe.config.spec import MergeSpec, lora_parts
from mergepipe.config.vocabulary import VocabularySpec


@dataclass(frozen=True)
class Piece:
    """Layers [start, end) of a model, which become the view's next end - start layers."""

    model: str
    start: int
    end: int


@dataclass(frozen=True)
class ModelView:
    """One input of a merge as the output's tensor names see it.

    home: the model whose files the view's own are named relative to; its config and tokenizer
    files are the ones an output copies when the view is its base. pieces: None for a model as
    it is; else the output's layers in order, the tensors before the layers (embeddings) from
    `pre` and those after them (final norm, head) from `post`, as mergekit takes them from the
    first and the last slice. adapter: a LoRA adapter folder applied to the home model (the
    `models:` form's MODEL+ADAPTER)."""

    home: str
    pieces: tuple[Piece, ...] | None = None
    pre: str = ""
    post: str = ""
    adapter: str | None = None

    @property
    def models(self) -> list[str]:
        """Every model (and adapter) the view reads from, each once, home first."""
        if self.pieces is None:
            return [self.home] if self.adapter is None else [self.home, self.adapter]
        return list(dict.fromkeys([self.home, self.pre, *(p.model for p in self.pieces), self.post]))

    def describe(self) -> str:
        """The view as plans and the catalog name it: the home model, then each piece's layers
        (and its model where that is not the home)."""
        if self.pieces is None:
            return self.home if self.adapter is None else f"{self.home}+{self.adapter}"
        where = ",".join(f"{'' if p.model == self.home else p.model + ':'}{p.start}-{p.end}" for p in self.pieces)
        ends = "" if self.pre == self.post == self.home else f";pre={self.pre};post={self.post}"
        return f"{self.home}#layers={where}{ends}"


@dataclass(frozen=True)
class InputViews:
    """The base's view and each expert's, in the order of the merge's inputs; vocabulary: the
    output vocabulary the config asks for (None: the base's, as it is)."""

    base: ModelView
    experts: tuple[ModelView, ...]
    vocabulary: VocabularySpec | None = None

    @property
    def all(self) -> list[ModelView]:
        return [self.base, *self.experts]

    @property
    def expert_names(self) -> list[str]:
        """Each expert as results name it: its location, or its view's description."""
        return [v.describe() for v in self.experts]


def input_views(spec: MergeSpec) -> InputViews:
    """The inputs of a merge: the base and the experts as they are for the `models:` form; for
    `slices:`, the base's view and the k-th expert's from each slice's roles (spec.slice_roles)."""
    if not spec.slices:

        def view(ref: str) -> ModelView:
            home, adapter = lora_parts(ref)
            return ModelView(home, adapter=adapter)

        return InputViews(view(spec.base_model), tuple(map(view, spec.expert_uris)), spec.vocabulary)
    roles = spec.slice_roles()
    first, last = spec.slices[0], spec.slices[-1]

    def view(home: str, pick) -> ModelView:
        pieces = []
        for sl, r in zip(spec.slices, roles):
            s = sl.sources[pick(r)]
            pieces.append(Piece(s.model, *s.layer_range))
        return ModelView(home, tuple(pieces), first.sources[pick(roles[0])].model, last.sources[pick(roles[-1])].model)

    base = view(spec.base_model, lambda r: r.base)
    experts = tuple(
        view(first.sources[roles[0].experts[k]].model, lambda r, k=k: r.experts[k])
        for k in range(len(roles[0].experts))
    )
    return InputViews(base, experts)
