"""The built-in evaluator: a candidate's mean token loss on a set of texts, loaded with
transformers (a causal LM's next-token loss, a masked LM's loss on fixed masked positions)."""

from __future__ import annotations

import json
import math
import time

from mergepipe import torch
from mergepipe.config.search import PerplexityEvaluation
from mergepipe.errors import BadInput
from mergepipe.evaluate.score import Score, failed
from mergepipe.storage.reader import read_small_file, stat

KEY = "search.evaluate.perplexity"
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
# A masked LM's masked positions: every MASK_EVERY-th token from MASK_AT (about 14%, near BERT's
# 15%), special tokens excepted. Fixed, so every candidate is scored on the same positions.
MASK_EVERY = 7
MASK_AT = 3
CAUSAL, MASKED = "causal", "masked"


def mean_loss(setting: PerplexityEvaluation, model_dir: str) -> Score:
    """The token-weighted mean loss over the texts (score), with perplexity = exp(loss) and the
    number of tokens scored. Texts are run one at a time, so no padding enters the loss.
    Missing transformers or unusable data raise BadInput; a model that cannot be loaded or
    scored is a failed Score."""
    transformers = _transformers()
    texts = read_texts(setting)
    start = time.monotonic()
    try:
        model, tokenizer, kind, limit = _load(transformers, model_dir)
    except Exception as err:  # a broken candidate is a failed trial, not a failed search
        return failed(f"{model_dir}: cannot load the model: {type(err).__name__}: {err}", time.monotonic() - start)
    try:
        if kind == MASKED and tokenizer.mask_token_id is None:
            return failed(f"{model_dir}: a masked LM whose tokenizer has no mask token", time.monotonic() - start)
        total, tokens = 0.0, 0
        with torch.no_grad():
            for text in texts:
                loss, n = _text_loss(model, tokenizer, kind, text, min(setting.max_length, limit))
                total += loss
                tokens += n
    except Exception as err:
        return failed(f"{model_dir}: scoring failed: {type(err).__name__}: {err}", time.monotonic() - start)
    finally:
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next trial loads another model
    seconds = time.monotonic() - start
    if tokens == 0:
        return failed(f"{setting.data}: no token to score (every text is too short after tokenizing)", seconds)
    mean = total / tokens
    if not math.isfinite(mean):
        return failed(f"{model_dir}: the mean loss is not finite ({mean})", seconds)
    perplexity = math.exp(mean) if mean < 700 else math.inf
    return Score(mean, {"perplexity": perplexity, "tokens": float(tokens)}, None, seconds)


def read_texts(setting: PerplexityEvaluation, keys: tuple[str, str] = (f"{KEY}.data", f"{KEY}.field")) -> list[str]:
    """The first `samples` texts of the data file (all when None): JSON Lines (the text under
    `field`), a JSON array, or plain text with one text per non-empty line; JSON when its name
    ends in .jsonl, .ndjson or .json, or its first line is a JSON object. `keys`: how errors name
    the data and field settings (a search config's keys, or a command's options)."""
    uri = setting.data
    if stat(uri) is None:
        raise BadInput(f"{uri}: text data not found ({keys[0]})")
    try:
        content = read_small_file(uri).decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"{uri}: text data is not UTF-8 text ({keys[0]})") from None
    lines = [(n, line) for n, line in enumerate(content.splitlines(), 1) if line.strip()]
    if uri.lower().endswith(JSON_SUFFIXES) or (lines and _json_object(lines[0][1])):
        texts = _json_texts(uri, content, lines, setting.field, keys[1])
    else:
        texts = [line for _, line in lines]
    texts = [t for t in texts if t.strip()]
    if setting.samples is not None:
        texts = texts[: setting.samples]
    if not texts:
        raise BadInput(f"{uri}: no texts in the data ({keys[0]})")
    return texts


def _json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _json_texts(uri: str, content: str, lines: list[tuple[int, str]], field: str, field_key: str) -> list[str]:
    try:
        whole = json.loads(content)
    except ValueError:
        whole = None
    if isinstance(whole, list):  # one JSON array of records (or of strings)
        records = [(f"item {i}", r) for i, r in enumerate(whole)]
    else:
        records = []
        for n, line in lines:
            try:
                records.append((f"line {n}", json.loads(line)))
            except ValueError as err:
                raise BadInput(f"{uri}: line {n}: not JSON ({err})") from None
    texts = []
    for where, record in records:
        if isinstance(record, str):
            texts.append(record)
            continue
        if not isinstance(record, dict):
            raise BadInput(f"{uri}: {where}: not a JSON object")
        if field not in record:
            raise BadInput(f"{uri}: {where}: no {field!r} key ({field_key})")
        if not isinstance(record[field], str):
            raise BadInput(f"{uri}: {where}: {field!r} is not a string")
        texts.append(record[field])
    return texts


def _transformers():
    try:
        import transformers
    except ImportError:
        raise BadInput(
            f"{KEY}: the built-in evaluator loads models with transformers: pip install 'mergepipe[eval]'"
        ) from None
    return transformers


def _kind(config) -> str:
    """Causal or masked, by the architecture config.json names; a decoder, or a config that
    names none, is taken for a causal LM."""
    names = list(getattr(config, "architectures", None) or [])
    if any(n.endswith("ForCausalLM") for n in names):
        return CAUSAL
    if any(n.endswith("ForMaskedLM") for n in names):
        return MASKED
    if names and not getattr(config, "is_decoder", False):
        raise ValueError(
            f"config.json names {names}: the built-in evaluator scores causal LMs (…ForCausalLM) "
            "and masked LMs (…ForMaskedLM)"
        )
    return CAUSAL


def _load(transformers, model_dir: str):
    """The model in eval mode on the GPU when there is one, its tokenizer, its kind, and the
    longest input its positions allow."""
    transformers.utils.logging.disable_progress_bar()  # a bar per trial would drown the search's progress
    config = transformers.AutoConfig.from_pretrained(model_dir)
    kind = _kind(config)
    auto = transformers.AutoModelForCausalLM if kind == CAUSAL else transformers.AutoModelForMaskedLM
    cuda = torch.cuda.is_available()
    # As stored on a GPU; float32 on a CPU, where half-precision kernels are slow or missing.
    model = auto.from_pretrained(model_dir, config=config, dtype="auto" if cuda else torch.float32)
    model.to("cuda" if cuda else "cpu").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    limit = getattr(config, "max_position_embeddings", None) or math.inf
    return model, tokenizer, kind, limit


def _text_loss(model, tokenizer, kind: str, text: str, max_length: int) -> tuple[float, int]:
    """The summed loss of one text's scored tokens, and how many there are."""
    enc = tokenizer(
        text, truncation=True, max_length=int(max_length), return_tensors="pt", return_special_tokens_mask=True
    )
    ids = enc["input_ids"].to(model.device)
    if kind == CAUSAL:
        if ids.shape[1] < 2:
            return 0.0, 0
        logits = model(input_ids=ids).logits[0, :-1].float()
        targets = ids[0, 1:]
    else:
        special = enc["special_tokens_mask"][0].bool().to(ids.device)
        positions = torch.arange(ids.shape[1], device=ids.device)
        masked = (positions % MASK_EVERY == MASK_AT) & ~special
        if not bool(masked.any()):
            return 0.0, 0
        inputs = ids.clone()
        inputs[0, masked] = tokenizer.mask_token_id
        kwargs = {"attention_mask": enc["attention_mask"].to(ids.device)}
        if "token_type_ids" in enc:
            kwargs["token_type_ids"] = enc["token_type_ids"].to(ids.device)
        logits = model(input_ids=inputs, **kwargs).logits[0, masked].float()
        targets = ids[0, masked]
    loss = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    return float(loss), int(targets.numel())
