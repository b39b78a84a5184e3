"""The output vocabulary and each model's rows on it (index/vocabulary.py) against mergekit 0.1.5's
build_tokenizer and PermutedVocabulary on real tokenizers (scripts/mergekit_vocab.py wrote the
fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mergepipe.config.vocabulary import TokenSource, VocabularySpec
from mergepipe.errors import BadInput
from mergepipe.index.vocabulary import build_vocabulary, load_tokenizer, permuted

pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data" / "vocab"
CASES = json.loads((DATA / "cases.json").read_text())
TOKENS = json.loads((DATA / "tokens.json").read_text())


def _entry(value: dict) -> TokenSource:
    source = value.get("source")
    force = bool(value.get("force"))
    if isinstance(source, str):
        return TokenSource("model", str(DATA / source), force=force)
    if source and source["kind"] == "zero":
        return TokenSource("zero", force=force)
    if source:
        return TokenSource(
            "model_token", str(DATA / source["model"]), source.get("token"), source.get("token_id"), force
        )
    return TokenSource(force=force)


def _build(models, base, source, tokens, pad):
    names = [str(DATA / m) for m in models]
    spec = VocabularySpec(
        source if source in ("union", "base") else str(DATA / source),
        {t: _entry(v) for t, v in tokens.items()},
        pad,
    )
    embeds = [load_file(DATA / m / "embed.safetensors")["embed"] for m in models]
    out, vocab = build_vocabulary(
        spec,
        names,
        models.index(base),
        [load_tokenizer(n) for n in names],
        [CASES["sizes"][m] for m in models],
        [e.shape[0] for e in embeds],
    )
    return out, vocab, embeds


@pytest.mark.parametrize("case", sorted(CASES["cases"]))
def test_vocabulary_and_rows_as_mergekit_builds_them(case):
    models, base, source, tokens, pad = CASES["cases"][case]
    out, vocab, embeds = _build(models, base, source, tokens, pad)
    want = TOKENS[case]
    assert sorted(vocab.tokens) == sorted(want)
    if source != "union":  # a union numbers other models' tokens in the order mergekit's set and dicts give
        assert list(vocab.tokens) == want
    assert list(out.get_vocab()) and sorted(out.get_vocab(), key=out.get_vocab().get) == list(vocab.tokens)
    expected = load_file(DATA / "expected.safetensors")
    n = len(want)
    for m, model in enumerate(models):
        mine, theirs = permuted(vocab, embeds, m), expected[f"{case}/{model}"]
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
        at = {t: i for i, t in enumerate(want)}
        for i, token in enumerate(vocab.tokens):
            assert torch.equal(mine[i], theirs[at[token]]), (model, token)
        # padding: each model's mean row (its rows summed in another order where the ids differ)
        assert torch.allclose(mine[n:], theirs[n:], rtol=1e-5, atol=1e-6)


def test_token_sources_mergekit_cannot_follow_are_refused_by_name():
    models, base, _, _, _ = CASES["cases"]["tokens"]
    with pytest.raises(BadInput, match=r"tokenizer.tokens.<brand-new>: some model lacks"):
        _build(models, base, "union", {"<brand-new>": {}}, None)
    with pytest.raises(BadInput, match=r"tokenizer.tokens.<x>: source model .*nowhere.* is not among"):
        _build(
            models, base, "union", {"<x>": {"source": {"kind": "model_token", "model": "nowhere", "token": "a"}}}, None
        )
    with pytest.raises(BadInput, match="tokenizer source .* is not among the merge's models"):
        _build(models, base, "padded", {}, None)
