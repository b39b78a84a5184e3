"""What a config says of the output's vocabulary (mergekit's `tokenizer_source`, or `tokenizer:`
with `source`, `tokens` and `pad_to_multiple_of`), as typed data for index/vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field

UNION, BASE = "union", "base"


@dataclass(frozen=True)
class TokenSource:
    """A `tokens:` entry: where the token's default row comes from, and whether every model
    takes it (force) rather than its own. kind: `model` (the model's row for this token),
    `model_token` (the model's row for `token` or `token_id`), `zero`, or None (no source)."""

    kind: str | None = None
    model: str | None = None
    token: str | None = None
    token_id: int | None = None
    force: bool = False


@dataclass(frozen=True)
class VocabularySpec:
    """The output vocabulary's source (`union`, `base`, or a model's location), the `tokens:`
    entries in order, and the padding multiple."""

    source: str
    tokens: dict[str, TokenSource] = field(default_factory=dict)
    pad_to_multiple_of: int | None = None

    @property
    def models(self) -> list[str]:
        """The model locations it names."""
        named = [] if self.source in (UNION, BASE) else [self.source]
        return named + [t.model for t in self.tokens.values() if t.model is not None]
