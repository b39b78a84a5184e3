"""A checkpoint family: a base and K experts sharing one coordinate system."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path

from mergepipe import torch
from mergepipe.config.spec import MODEL_LOCATION, expert_label
from mergepipe.config.views import InputViews, ModelView
from mergepipe.config.vocabulary import BASE
from mergepipe.errors import BadInput
from mergepipe.index.blocks import before_layers, layer_count, layer_index, with_layer
from mergepipe.index.vocabulary import build_vocabulary, config_vocab_size, is_identity, load_tokenizer, row_sources
from mergepipe.storage import virtual
from mergepipe.storage.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraTensor, adapter_targets
from mergepipe.storage.canonical import digest_of
from mergepipe.storage.model_files import (
    CONFIG_FILE,
    TOKENIZER_FILES,
    Layout,
    Layouts,
    ModelFiles,
    adapter_config,
    copy_sidecars,
    is_adapter,
    read_models,
)
from mergepipe.storage.reader import RangeReader, fingerprint
from mergepipe.storage.safetensors_format import DTYPES, TensorPlace, tensor_nbytes
from mergepipe.storage.vocab_rows import VocabTensor


def model_fingerprint(model: ModelFiles) -> str:
    """Cheap identity of a model's files as they are now (location, and each file's fingerprint).

    It keys cached statistics; content digests (SHA-256 of the tensor bytes) identify inputs
    in plans and manifests."""
    return digest_of({"uri": model.uri, "files": {s: fp.as_json() for s, fp in sorted(model.fingerprints.items())}})


@dataclass
class Family:
    base: ModelFiles
    experts: list[ModelFiles]

    @property
    def base_fp(self) -> str:
        return model_fingerprint(self.base)

    def expert_fps(self) -> list[str]:
        return [model_fingerprint(e) for e in self.experts]

    def tensor_names(self) -> list[str]:
        return list(self.base.tensors)  # a Layout's names are sorted


def _shapes_and_dtypes(model: ModelFiles) -> tuple[list, list]:
    places = list(model.tensors.values())  # by name, sorted
    return list(map(itemgetter(2), places)), list(map(itemgetter(1), places))


def _dtypes_agree(base: str, expert: str) -> bool:
    """Floating dtypes may differ across a family; any other must be the base's."""
    return base == expert or (DTYPES[base].is_float and DTYPES[expert].is_float)


def validate_family(base: ModelFiles, experts: list[ModelFiles]) -> None:
    """Same tensor names and shapes everywhere; floating dtypes may differ, others may not."""
    names = set(base.tensors)
    base_shapes, base_dtypes = _shapes_and_dtypes(base)
    for i, e in enumerate(experts):
        who = f"expert {i} ({e.uri})"
        # A single file that holds part of a model looks like a family mismatch: say what is wanted.
        hint = f" ({MODEL_LOCATION})" if base.uri.endswith(".safetensors") or e.uri.endswith(".safetensors") else ""
        extra = sorted(set(e.tensors) - names)
        if extra:
            raise BadInput(f"{who}: tensor {extra[0]!r} is not in the base model {base.uri}{hint}")
        missing = sorted(names - set(e.tensors))
        if missing:
            raise BadInput(f"{who}: tensor {missing[0]!r} of the base model is missing{hint}")
        if e.layout is base.layout:  # one library saved them all
            continue
        shapes, dtypes = _shapes_and_dtypes(e)
        if shapes == base_shapes and all(_dtypes_agree(*pair) for pair in set(zip(base_dtypes, dtypes))):
            continue  # else find the first tensor that disagrees, and name it
        for name in base.tensors:
            b, x = base.tensors[name], e.tensors[name]
            if b.shape != x.shape:
                raise BadInput(f"{who}: tensor {name!r} has shape {list(x.shape)}, the base has {list(b.shape)}")
            if not _dtypes_agree(b.dtype, x.dtype):
                raise BadInput(f"{who}: tensor {name!r} has dtype {x.dtype}, the base has {b.dtype}")


def load_family(base_uri: str, expert_uris: list[str], reader: RangeReader) -> Family:
    """Read every header (never tensor data) and check the family before anything else runs."""
    return load_views(InputViews(ModelView(base_uri), tuple(map(ModelView, expert_uris))), reader)


def load_views(views: InputViews, reader: RangeReader) -> Family:
    """The family of a merge's inputs: each model's headers read once (never tensor data), each
    view built from them, and the whole checked before anything else runs."""
    layouts: Layouts = {}  # headers the family's models share are parsed once, into one Layout
    labels = ["base"] + [expert_label(i) for i in range(len(views.experts))]
    wanted: dict[str, str] = {}  # each model once, labelled by the first view that reads it
    for view, label in zip(views.all, labels):
        for uri in view.models:
            wanted.setdefault(uri, label)
    models = dict(zip(wanted, read_models(list(wanted.items()), reader, layouts)))
    built: dict[tuple, Layout] = {}
    base, *experts = (view_of(v, models, built) for v in views.all)
    if views.vocabulary is not None:
        base, *experts = vocabulary_views(views, [base, *experts], models)
    validate_family(base, experts)
    return Family(base, experts)


def model_tokenizers(homes: list[ModelFiles]) -> tuple[list, list[int | None]]:
    """Each model's tokenizer (None where it has no tokenizer files) and its config's vocab_size,
    its files copied from wherever the model lies; each model once."""
    tokenizers: dict[str, tuple] = {}
    with tempfile.TemporaryDirectory(prefix="mergepipe-tokenizer-") as tmp:
        for model in homes:
            if model.uri in tokenizers:
                continue
            folder = os.path.join(tmp, str(len(tokenizers)))
            # transformers reads config.json to choose a class where tokenizer_config.json names none
            copied = copy_sidecars(model, (*TOKENIZER_FILES, CONFIG_FILE), folder)
            config = None
            if CONFIG_FILE in copied:
                try:
                    config = json.loads(Path(folder, CONFIG_FILE).read_text())
                except (UnicodeDecodeError, json.JSONDecodeError) as err:
                    raise BadInput(f"{model.path(CONFIG_FILE)}: not valid JSON ({err})") from None
            has = set(copied) - {CONFIG_FILE, "chat_template.jinja", "chat_template.json"}
            tokenizer = load_tokenizer(folder) if has else None
            tokenizers[model.uri] = (tokenizer, config_vocab_size(config if isinstance(config, dict) else None))
    got = [tokenizers[m.uri] for m in homes]
    return [t for t, _ in got], [v for _, v in got]


def _vocab_tensors(model: ModelFiles, vocab_size: int | None) -> list[str]:
    """The tensors indexed by token: outside the layers, 2-D, vocab_size rows."""
    if vocab_size is None:
        raise BadInput(
            f"{model.uri}: its config.json states no vocab_size, so which tensors are indexed by token cannot be told"
        )
    found = [
        n for n, t in model.tensors.items() if layer_index(n) is None and len(t.shape) == 2 and t.shape[0] == vocab_size
    ]
    if not found:
        raise BadInput(f"{model.uri}: no tensor outside the layers has vocab_size ({vocab_size}) rows")
    return found


def vocabulary_views(views: InputViews, inputs: list[ModelFiles], models: dict[str, ModelFiles]) -> list[ModelFiles]:
    """The inputs with their vocabulary-indexed tensors (embedding, head) on the output
    vocabulary's rows (index/vocabulary), each made when read from the rows it needs of every
    input's tensor (storage.vocab_rows); the inputs as they are where nothing moves."""
    spec = views.vocabulary
    homes = [models[v.home] for v in views.all]
    tokenizers, sizes = model_tokenizers(homes)
    if tokenizers[0] is None:
        if spec.source == BASE and not spec.tokens and not spec.pad_to_multiple_of:
            return inputs  # the base's files, as they are
        raise BadInput(
            f"{homes[0].uri}: the base has no tokenizer files, and the output's vocabulary is built from them"
        )
    names = [v.home for v in views.all]
    vocab_names = _vocab_tensors(inputs[0], sizes[0])
    for model, size, tokenizer in zip(inputs[1:], sizes[1:], tokenizers[1:]):
        # a model with neither tokenizer nor vocab_size is taken as the base's (as mergekit does)
        theirs = _vocab_tensors(model, sizes[0] if size is None and tokenizer is None else size)
        if theirs != vocab_names:
            odd = sorted(set(theirs) ^ set(vocab_names))[0]
            raise BadInput(f"{model.uri}: tensor {odd!r} is indexed by token in one model and not in another")
    rows = [m.tensors[vocab_names[0]].shape[0] for m in inputs]
    _, vocabulary = build_vocabulary(spec, names, 0, tokenizers, sizes, rows)
    if is_identity(vocabulary, rows):
        return inputs
    out = []
    for m, model in enumerate(inputs):
        copies, averages = row_sources(vocabulary, m)
        tensors = dict(model.tensors)
        files = dict(model.fingerprints)
        made = dict(model.virtual)
        for name in vocab_names:
            sources = []
            for other in inputs:
                t = other.tensors[name]
                if virtual.is_virtual(t.file):
                    raise BadInput(
                        f"{other.uri}: {name!r} is changed by a LoRA adapter and its rows are remapped to the output's vocabulary: not supported"
                    )
                where = other.path(t.file)
                files.setdefault(t.file if other.root == model.root else where, other.fingerprints[t.file])
                sources.append((where, t))
            dtype = _promoted([t.dtype for _, t in sources])
            shape = (vocabulary.size, *model.tensors[name].shape[1:])
            place = TensorPlace("", dtype, shape, 0, tensor_nbytes(dtype, shape))
            recipe = VocabTensor(place, tuple(sources), tuple(copies), tuple(averages), len(vocabulary.tokens))
            file = virtual.register(recipe)
            made[file] = recipe
            tensors[name] = place._replace(file=file)
        key = digest_of(sorted(made))[:16]
        out.append(
            ModelFiles(
                uri=f"{model.uri}#vocabulary={key}",
                root=model.root,
                shards=list(model.shards),
                sidecars=list(model.sidecars),
                fingerprints=files,
                layout=Layout.of(tensors),
                header_bytes=dict(model.header_bytes),
                virtual=made,
            )
        )
    return out


def _promoted(dtypes: list[str]) -> str:
    """The safetensors dtype that these promote to (as torch promotes them)."""
    got = DTYPES[dtypes[0]].torch
    for d in dtypes[1:]:
        got = torch.promote_types(got, DTYPES[d].torch)
    return next(name for name, d in DTYPES.items() if d.torch == got)


def view_of(view: ModelView, models: dict[str, ModelFiles], built: dict[tuple, Layout]) -> ModelFiles:
    """A view's ModelFiles: the output's tensor names, each at its source tensor's place. A
    place in a model other than the home is named by its file's full location. Views that name
    the same places share one Layout (`built`, kept by the caller); a view that renames nothing
    is its home model itself, with the same fingerprint and statistics."""
    home = models[view.home]
    if is_adapter(home):
        raise BadInput(f"{home.uri}: is a LoRA adapter, not a model; name it with its model, as MODEL+ADAPTER")
    if view.adapter is not None:
        return lora_view(view, home, models[view.adapter], built)
    if view.pieces is None:
        return home
    tensors, files, headers = {}, {}, {}

    def take(model: ModelFiles, name: str, as_name: str) -> None:
        t = model.tensors[name]
        file = t.file if model is home else model.path(t.file)
        files[file], headers[file] = model.fingerprints[t.file], model.header_bytes[t.file]
        tensors[as_name] = t if file == t.file else t._replace(file=file)

    pre, post = models[view.pre], models[view.post]
    for name in pre.tensors:
        if layer_index(name) is None and before_layers(name):
            take(pre, name, name)
    out = 0
    for piece in view.pieces:
        model = models[piece.model]
        by_layer: dict[int, list[str]] = {}
        for name in model.tensors:
            by_layer.setdefault(layer_index(name), []).append(name)
        have = layer_count(model.tensors)
        if piece.end > have:
            raise BadInput(f"{model.uri}: layer_range [{piece.start}, {piece.end}) but the model has {have} layers")
        for j in range(piece.start, piece.end):
            for name in by_layer.get(j, ()):
                take(model, name, with_layer(name, out))
            out += 1
    for name in post.tensors:
        if layer_index(name) is None and not before_layers(name):
            take(post, name, name)
    key = tuple(sorted((n, tuple(t)) for n, t in tensors.items()))
    layout = built.setdefault(key, Layout.of(tensors))
    if layout.tensors == home.tensors:
        return home
    return ModelFiles(
        uri=view.describe(),
        root=home.root,
        shards=sorted(files),
        sidecars=list(home.sidecars),
        fingerprints=files,
        layout=layout,
        header_bytes=headers,
    )


def lora_view(view: ModelView, home: ModelFiles, adapter: ModelFiles, built: dict[tuple, Layout]) -> ModelFiles:
    """A model with a LoRA adapter applied, as a merge's input: the weights the adapter changes
    at places of their own (read through their recipes, storage.adapters), the rest the model's."""
    if not is_adapter(adapter):
        raise BadInput(f"{adapter.uri}: not a LoRA adapter folder (no {ADAPTER_WEIGHTS} with its {ADAPTER_CONFIG})")
    weights = adapter.path(ADAPTER_WEIGHTS)
    targets = adapter_targets(adapter.uri, adapter_config(adapter), adapter.tensors, home.tensors)
    tensors: dict[str, TensorPlace] = dict(home.tensors)
    lora: dict[str, LoraTensor] = {}
    for name, (a, b, scale, transposed) in targets.items():
        place = home.tensors[name]
        recipe = LoraTensor(home.path(place.file), place, weights, a, b, scale, transposed)
        file = virtual.register(recipe)
        lora[file] = recipe
        tensors[name] = TensorPlace(file, place.dtype, place.shape, 0, place.nbytes)
    # The adapter's files identify the view with the model's: its config holds the scales.
    config = adapter.path(ADAPTER_CONFIG)
    files = {**home.fingerprints, weights: adapter.fingerprints[ADAPTER_WEIGHTS], config: fingerprint(config)}
    key = tuple(sorted((n, tuple(t)) for n, t in tensors.items()))
    return ModelFiles(
        uri=view.describe(),
        root=home.root,
        shards=[*home.shards, weights],
        sidecars=list(home.sidecars),
        fingerprints=files,
        layout=built.setdefault(key, Layout.of(tensors)),
        header_bytes={**home.header_bytes, weights: adapter.header_bytes[ADAPTER_WEIGHTS]},
        virtual=lora,
    )
