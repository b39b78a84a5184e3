"""The output's vocabulary as mergekit 0.1.5 builds it (`tokenizer_source`, or `tokenizer:` with
`source`, `tokens` and `pad_to_multiple_of`), built by transformers from the models' tokenizer
files, and where each output token's embedding row comes from in each model.

The rule, as mergekit's: a model that has a token (below its config's vocab_size) and is not
forced elsewhere takes its own row; every other model takes the token's default row, which is
the row of the one model that has it, else the base's, else the average of the models that have
it, else a `tokens:` entry's source (a model's row for the token, or for another token or id, or
zero). Rows past the vocabulary, up to a multiple of `pad_to_multiple_of`, are each model's mean
row. index/family makes each model's vocabulary-indexed tensors on the output's rows from this
(storage.vocab_rows reads them).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from typing import Any

from mergepipe.config.vocabulary import BASE, UNION, TokenSource, VocabularySpec
from mergepipe.errors import BadInput


@dataclass(frozen=True)
class Default:
    """An output token's default row: `model` (the row `row` of model `model`), `average` (the
    mean of `models`' own rows, summed in their order in the tensors' dtype), or `zero`."""

    kind: str
    model: int | None = None
    row: int | None = None
    models: tuple[int, ...] = ()


@dataclass(frozen=True)
class Vocabulary:
    """tokens: the output's tokens by id; size: its rows (padded); rows[m][i]: model m's own row
    of output token i, or -1; defaults: the rows of tokens some model lacks (or that are
    forced), by output id; forced: the ids every model takes the default of."""

    tokens: tuple[str, ...]
    size: int
    rows: tuple[tuple[int, ...], ...]
    defaults: dict[int, Default]
    forced: frozenset[int] = frozenset()


def _transformers():
    try:
        import transformers
    except ImportError:
        raise BadInput(
            "merging vocabularies (tokenizer_source, tokenizer:) builds tokenizers with transformers: "
            "pip install 'mergepipe[tokenizers]'"
        ) from None
    return transformers


def load_tokenizer(folder: str):
    """A model's tokenizer from its local folder, as mergekit loads it (fast)."""
    return _transformers().AutoTokenizer.from_pretrained(folder, use_fast=True)


def config_vocab_size(config: dict[str, Any] | None) -> int | None:
    """The vocab_size a model's config.json states (its text model's, for a multimodal one)."""
    if not config:
        return None
    for holder in (config, config.get("text_config") or {}):
        size = holder.get("vocab_size")
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return None


def stripped(tokenizer, vocab_size: int | None, where: str):
    """The tokenizer without the tokens at or past vocab_size (mergekit's stripped base)."""
    vocab_size = vocab_size or len(tokenizer.get_vocab())
    unused = {t for t, i in tokenizer.get_vocab().items() if i >= vocab_size}
    if not unused:
        return tokenizer
    data = json.loads(tokenizer._tokenizer.to_str())
    if data["model"]["type"] != "BPE":
        raise BadInput(f"{where}: tokens past vocab_size in a {data['model']['type']} tokenizer (only BPE strips)")
    data["added_tokens"] = [e for e in data["added_tokens"] if e["id"] < vocab_size]
    for t in unused:
        data["model"]["vocab"].pop(t, None)

    def keep(m) -> bool:
        return not any(t in unused for t in (m.split(" ") if isinstance(m, str) else m))

    data["model"]["merges"] = [m for m in data["model"]["merges"] if keep(m)]
    from tokenizers import Tokenizer

    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(data))
    return tokenizer


def union(base, tokenizers: list[tuple[Any, int | None]]):
    """mergekit's union: the base's tokenizer, reloaded, with every model's tokens it lacks
    added in order (plain tokens, then added tokens with their first settings). Unlike
    mergekit, each model's plain tokens are taken in id order, so that the ids are the same in
    every run (mergekit takes them in the order of a hash map, another in each process)."""
    out_vocab: dict[str, int] = {}
    added: dict[str, Any] = {}
    for tokenizer, vocab_size in tokenizers:
        vocab_size = vocab_size or tokenizer.vocab_size
        decoder = tokenizer.added_tokens_decoder
        added_contents = {info.content for info in decoder.values()}
        # in id order: get_vocab's order is a hash map's, another in each process
        for token, i in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
            if i < vocab_size and token not in added_contents and token not in out_vocab:
                out_vocab[token] = len(out_vocab)
        for i, info in decoder.items():
            if i < vocab_size:
                added.setdefault(info.content, info)
    with tempfile.TemporaryDirectory() as folder:
        base.save_pretrained(folder)
        out = load_tokenizer(folder)
    have = base.get_vocab()
    for token in out_vocab:
        if token not in added and token not in have:
            out.add_tokens(token)
    for info in added.values():
        out.add_tokens(info)
    return out


def build_tokenizer(
    spec: VocabularySpec, names: list[str], base: int, tokenizers: list[Any], vocab_sizes: list[int | None]
) -> tuple[Any, list[Any]]:
    """The output tokenizer of a merge whose models (`names`, in config order, the base at
    `base`) have these tokenizers (None: none could be loaded, taken as the base's, as mergekit
    does) and config vocab sizes; and each model's tokenizer as the rows are mapped with it.
    Unlike mergekit, whose model order comes from a set (so a union of two models' new tokens
    numbers them differently from run to run), the order is the config's: base first."""
    source_raw = tokenizers[names.index(spec.source)] if spec.source in names else None
    if spec.source not in (UNION, BASE) and source_raw is None:
        raise BadInput(f"tokenizer source {spec.source!r} is not among the merge's models (or has no tokenizer)")
    base_tok = stripped(tokenizers[base], vocab_sizes[base], names[base])
    own = [base_tok if (m == base or t is None) else t for m, t in enumerate(tokenizers)]
    if spec.source == BASE:
        out = base_tok
    elif spec.source == UNION:
        order = [base] + [m for m, t in enumerate(tokenizers) if m != base and t is not None]
        out = union(base_tok, [(own[m], vocab_sizes[m]) for m in order])
    else:
        out = source_raw
    have = set(out.get_vocab())
    for token in spec.tokens:
        if token not in have:
            out.add_tokens(token)
            have.add(token)
    return out, own


def build_vocabulary(
    spec: VocabularySpec,
    names: list[str],
    base: int,
    tokenizers: list[Any],
    vocab_sizes: list[int | None],
    rows: list[int],
) -> tuple[Any, Vocabulary]:
    """The output tokenizer (build_tokenizer) and the Vocabulary of a merge whose models have
    these tokenizers, config vocab sizes and embedding rows. A source or a `tokens:` entry that
    names no model of the merge, or that mergekit could not follow, is bad input naming it."""
    out, own = build_tokenizer(spec, names, base, tokenizers, vocab_sizes)
    vocab = out.get_vocab()
    by_id = sorted(vocab, key=vocab.get)
    n = size = len(by_id)
    if spec.pad_to_multiple_of and n % spec.pad_to_multiple_of:
        size = (n // spec.pad_to_multiple_of + 1) * spec.pad_to_multiple_of
    table = []
    for m, tokenizer in enumerate(own):
        model_vocab = tokenizer.get_vocab()
        limit = min(vocab_sizes[m] or len(model_vocab), rows[m])
        table.append(tuple(r if (r := model_vocab.get(t, -1)) < limit else -1 for t in by_id))
    defaults: dict[int, Default] = {}
    forced = frozenset(vocab[t] for t, e in spec.tokens.items() if e.force)
    for i, token in enumerate(by_id):
        entry = spec.tokens.get(token)
        present = tuple(m for m in range(len(names)) if table[m][i] >= 0)
        if not (entry and entry.force) and len(present) == len(names):
            continue  # every model's own row
        if entry is not None:
            defaults[i] = _entry_default(entry, token, names, own, table, i)
        elif len(present) == 1:
            defaults[i] = Default("model", present[0], table[present[0]][i])
        elif not present:
            defaults[i] = Default("zero")
        elif base in present:
            defaults[i] = Default("model", base, table[base][i])
        else:
            defaults[i] = Default("average", models=present)
    return out, Vocabulary(tuple(by_id), size, tuple(table), defaults, forced)


def _entry_default(entry: TokenSource, token: str, names, own, table, i: int) -> Default:
    if entry.kind == "zero":
        return Default("zero")
    if entry.kind is None:  # mergekit stops here (it has no default to compute)
        raise BadInput(f"tokenizer.tokens.{token}: some model lacks {token!r} (or it is forced): give it a source")
    if entry.model not in names:
        raise BadInput(f"tokenizer.tokens.{token}: source model {entry.model!r} is not among the merge's models")
    m = names.index(entry.model)
    if entry.kind == "model":
        if table[m][i] < 0:
            raise BadInput(f"tokenizer.tokens.{token}: {entry.model} has no token {token!r}")
        return Default("model", m, table[m][i])
    row = entry.token_id
    if row is None:
        row = own[m].get_vocab().get(entry.token)
        if row is None:
            raise BadInput(f"tokenizer.tokens.{token}: {entry.model} has no token {entry.token!r}")
    return Default("model", m, row)


def is_identity(vocabulary: Vocabulary, rows: list[int]) -> bool:
    """Whether every model's rows are its own as they are (nothing to map)."""
    n = len(vocabulary.tokens)
    return (
        vocabulary.size == n
        and not vocabulary.forced
        and all(r == n and own == tuple(range(n)) for r, own in zip(rows, vocabulary.rows))
    )


def row_sources(vocabulary: Vocabulary, m: int) -> tuple[list[tuple[int, int, int, int]], list]:
    """Where model m's rows on the output come from, as permuted() takes them: runs copied,
    (output row, model, source row, rows), and averages, (output row, ((model, row), ...))."""
    copies: list[list[int]] = []
    averages = []
    for i in range(len(vocabulary.tokens)):
        own = vocabulary.rows[m][i]
        if own >= 0 and i not in vocabulary.forced:
            source = (m, own)
        else:
            d = vocabulary.defaults.get(i)
            if d is None or d.kind == "zero":
                continue
            if d.kind == "average":
                averages.append((i, tuple((k, vocabulary.rows[k][i]) for k in d.models)))
                continue
            source = (d.model, d.row)
        last = copies[-1] if copies else None
        if last and last[0] + last[3] == i and last[1] == source[0] and last[2] + last[3] == source[1]:
            last[3] += 1
        else:
            copies.append([i, source[0], source[1], 1])
    return [tuple(c) for c in copies], averages


def permuted(vocabulary: Vocabulary, tensors: list, m: int):
    """Model m's vocabulary-indexed tensor (rows first) on the output's rows, from every model's
    (the defaults read other models' rows), in the dtype they all promote to, as mergekit's
    PermutedVocabulary makes it: the definition that reading the output's rows follows."""
    from mergepipe import torch

    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    shape = tuple(tensors[0].shape[1:])
    out = torch.zeros((vocabulary.size, *shape), dtype=dtype)
    for i in range(len(vocabulary.tokens)):
        own = vocabulary.rows[m][i]
        if own >= 0 and i not in vocabulary.forced:
            out[i] = tensors[m][own]
            continue
        d = vocabulary.defaults.get(i)
        if d is None or d.kind == "zero":
            continue
        if d.kind == "model":
            out[i] = tensors[d.model][d.row]
        else:
            acc = torch.zeros(shape, dtype=dtype)
            for k in d.models:
                acc = acc + tensors[k][vocabulary.rows[k][i]]
            out[i] = acc / len(d.models)
    n = len(vocabulary.tokens)
    if vocabulary.size > n:
        out[n:] = torch.mean(out[:n], dim=0)
    return out
