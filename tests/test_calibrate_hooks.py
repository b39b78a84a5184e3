"""Calibration hooks: the input moments and embedding frequencies calibrate_model stores equal a
direct computation on the same tokens, keyed by the checkpoint's names (tied, untied, a bare
encoder), and the inputs it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mergepipe.errors import BadInput

from .llama_family import llama_config, make_bert, make_tokenizer, sentences

pytest.importorskip("transformers")

BIG = [1, 5, 9]  # embedding columns scaled far above the rest, so the moments are uneven


def checkpoint_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names.update(f.keys())
    return names


def make_llama(folder: Path, tied: bool):
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = make_tokenizer()
    config = llama_config(
        tokenizer,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        tie_word_embeddings=tied,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, BIG] *= 30
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return model, tokenizer


def texts() -> list[str]:
    return sentences("a", 6, seed=1) + sentences("b", 6, seed=2)


def second_moment(rows: list) -> np.ndarray:
    x = np.concatenate([r.detach().double().reshape(-1, r.shape[-1]).numpy() for r in rows])
    return (x * x).mean(axis=0)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_moments_and_frequencies_match_a_direct_computation(tmp_path, tied):
    import torch

    from mergepipe.evaluate.calibrate import calibrate_model

    folder = tmp_path / "llama"
    model, tokenizer = make_llama(folder, tied)
    names = checkpoint_names(folder)
    assert ("lm_head.weight" in names) is not tied
    cal = calibrate_model(str(folder), texts(), 512, names)

    ids = [tokenizer(t, return_tensors="pt")["input_ids"] for t in texts()]
    total = sum(int(i.numel()) for i in ids)
    assert cal.tokens == total and cal.texts == len(texts()) and cal.device == "cpu" and cal.seconds > 0

    # keys are the checkpoint's names; every Linear is there with length in_features
    assert set(cal.moments) <= names and set(cal.frequencies) <= names
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            key = "model.embed_tokens.weight" if tied and module_name == "lm_head" else f"{module_name}.weight"
            assert cal.moments[key].shape == (module.in_features,)
            assert cal.moments[key].dtype == np.float64

    with torch.no_grad():
        layer0 = [model.model.layers[0].input_layernorm(model.model.embed_tokens(i)) for i in ids]
        final = [model.model(input_ids=i).last_hidden_state for i in ids]
    expected = second_moment(layer0)
    for proj in ("q_proj", "k_proj", "v_proj"):
        np.testing.assert_allclose(cal.moments[f"model.layers.0.self_attn.{proj}.weight"], expected, rtol=1e-6)
    big = expected[BIG].min()
    assert big > 50 * np.delete(expected, BIG).max()  # the scaled channels stand out

    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    np.testing.assert_allclose(cal.moments[head], second_moment(final), rtol=1e-6)

    counts = np.bincount(torch.cat([i.reshape(-1) for i in ids]).numpy(), minlength=len(tokenizer))
    freq = cal.frequencies["model.embed_tokens.weight"]
    assert freq.shape == (model.config.vocab_size,) and freq.dtype == np.float64
    np.testing.assert_allclose(freq, counts / total, rtol=1e-12)
    assert freq.sum() == pytest.approx(1.0)
    if tied:  # one tensor, both uses: a frequency per row and a moment per input channel
        assert set(cal.frequencies) == {"model.embed_tokens.weight"}
        assert cal.moments["model.embed_tokens.weight"].shape == (16,)
    else:
        assert "lm_head.weight" not in cal.frequencies
        assert "model.embed_tokens.weight" not in cal.moments


def test_truncation_and_bare_class_with_prefixed_checkpoint(tmp_path):
    """A config naming the bare LlamaModel loads as AutoModel, whose module names lack the
    checkpoint's "model." prefix; max_length truncates every text."""
    from mergepipe.evaluate.calibrate import calibrate_model

    folder = tmp_path / "llama"
    make_llama(folder, tied=False)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["LlamaModel"]
    (folder / "config.json").write_text(json.dumps(config))
    names = checkpoint_names(folder)
    full = calibrate_model(str(folder), texts(), 512, names)
    cut = calibrate_model(str(folder), texts(), 3, names)
    assert cut.tokens == 3 * len(texts()) < full.tokens
    assert "lm_head.weight" not in full.moments  # the bare model has no head to run
    expected = {n for n in names if n.endswith("_proj.weight")} | {"model.embed_tokens.weight"}
    assert set(full.moments) | set(full.frequencies) == expected
    np.testing.assert_allclose(full.frequencies["model.embed_tokens.weight"].sum(), 1.0)


BERT_TEXTS = ["the red cat sees a blue dog", "one two three four five one two", "five"]


def test_bare_encoder_checkpoint_loads_as_auto_model(tmp_path):
    import torch
    import transformers

    from mergepipe.evaluate.calibrate import _auto_class, calibrate_model

    folder = tmp_path / "bert"
    model, tokenizer = make_bert(folder)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["BertModel"]
    names = checkpoint_names(folder)
    assert not any(n.startswith(("bert.", "cls.")) for n in names)
    cal = calibrate_model(str(folder), BERT_TEXTS, 512, names)
    assert set(cal.moments) | set(cal.frequencies) <= names
    assert {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)} == {
        n.removesuffix(".weight") for n in cal.moments
    }

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))  # as calibrate_model loads it
    encs = [tokenizer(t, return_tensors="pt") for t in BERT_TEXTS]
    assert all("token_type_ids" in e for e in encs)
    assert cal.tokens == sum(int(e["input_ids"].numel()) for e in encs)
    with torch.no_grad():
        rows = [model.embeddings(input_ids=e["input_ids"], token_type_ids=e["token_type_ids"]) for e in encs]
    np.testing.assert_allclose(
        cal.moments["encoder.layer.0.attention.self.query.weight"], second_moment(rows), rtol=1e-6
    )
    ids = torch.cat([e["input_ids"].reshape(-1) for e in encs]).numpy()
    np.testing.assert_allclose(
        cal.frequencies["embeddings.word_embeddings.weight"],
        np.bincount(ids, minlength=model.config.vocab_size) / ids.size,
        rtol=1e-12,
    )
    # token type 0 everywhere; positions 0..n-1 of each text
    np.testing.assert_array_equal(cal.frequencies["embeddings.token_type_embeddings.weight"], [1.0, 0.0])

    # A config naming the masked-LM head while the checkpoint has none: the bare model, not a
    # random head; a causal LM whose head is tied to its embedding keeps its head class.
    config = transformers.AutoConfig.from_pretrained(str(folder))
    config.architectures = ["BertForMaskedLM"]
    assert _auto_class(transformers, config, names) is transformers.AutoModel
    assert _auto_class(transformers, config, names | {"cls.predictions.transform.dense.weight"}) is (
        transformers.AutoModel
    )
    llama = tmp_path / "llama"
    make_llama(llama, tied=True)
    config = transformers.AutoConfig.from_pretrained(str(llama))
    assert _auto_class(transformers, config, checkpoint_names(llama)) is transformers.AutoModelForCausalLM


def test_refusals(tmp_path):
    from mergepipe.evaluate.calibrate import calibrate_model

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BadInput, match=f"{empty}: cannot load the model"):
        calibrate_model(str(empty), ["the cat"], 32, set())

    folder = tmp_path / "llama"
    make_llama(folder, tied=False)
    names = checkpoint_names(folder)
    with pytest.raises(BadInput, match="no token"):
        calibrate_model(str(folder), [], 32, names)
    with pytest.raises(BadInput, match="no nn.Linear or nn.Embedding"):
        calibrate_model(str(folder), texts(), 32, {"not.a.tensor"})


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_gradient_moments_match_a_direct_computation(tmp_path, tied):
    """--gradients on a causal LM: the summed next-token loss back-propagated; the gradient's
    second moment at each Linear's output channels and at each token's uses equal autograd's
    on the same texts, and the forward moments are those of a run without gradients."""
    import torch

    from mergepipe.evaluate.calibrate import calibrate_model

    folder = tmp_path / "llama"
    model, tokenizer = make_llama(folder, tied)
    names = checkpoint_names(folder)
    plain = calibrate_model(str(folder), texts(), 512, names)
    cal = calibrate_model(str(folder), texts(), 512, names, gradients=True)
    assert cal.objective == "loss" and plain.objective == "" and not plain.output_moments
    assert set(cal.moments) == set(cal.output_moments) == set(plain.moments)
    for k, m in plain.moments.items():
        np.testing.assert_allclose(cal.moments[k], m, rtol=1e-9)

    captured = []

    def keep(_module, _args, out):
        out.retain_grad()
        captured.append(out)

    handle = model.model.layers[0].self_attn.v_proj.register_forward_hook(keep)
    heads, v_grads, token, n = [], [], np.zeros(model.config.vocab_size), 0
    try:
        for text in texts():
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            embeds = model.model.embed_tokens(ids).detach().requires_grad_()
            logits = model(inputs_embeds=embeds).logits[0]
            torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum").backward()
            # d loss / d logits: softmax minus the one-hot next token; nothing at the last position
            g = torch.softmax(logits.detach().double(), -1)
            g[torch.arange(ids.shape[1] - 1), ids[0, 1:]] -= 1
            g[-1] = 0
            heads.append(g.numpy())
            v_grads.append(captured.pop().grad[0].double().numpy())
            np.add.at(token, ids[0].numpy(), (embeds.grad[0].double() ** 2).mean(dim=1).numpy())
            n += ids.shape[1]
    finally:
        handle.remove()
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    np.testing.assert_allclose(cal.output_moments[head], (np.concatenate(heads) ** 2).mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(
        cal.output_moments["model.layers.0.self_attn.v_proj.weight"],
        (np.concatenate(v_grads) ** 2).mean(axis=0),
        rtol=1e-5,
    )
    assert cal.output_moments[head].shape == (model.config.vocab_size,)
    np.testing.assert_allclose(cal.token_gradients["model.embed_tokens.weight"], token / n, rtol=1e-5, atol=1e-300)
    everything = np.concatenate(list(cal.output_moments.values()))
    assert cal.gradient_scale() == pytest.approx(everything.mean(), rel=1e-12) and cal.gradient_scale() > 0


def test_bare_encoder_gradients_project_every_output(tmp_path):
    """--gradients on a bare encoder: no loss, so its outputs (hidden states and pooled output)
    are projected on draws from a generator seeded 0; the word embedding's token moments equal
    autograd's with the same draws, and the pooler, which only the pooled output uses, is
    reached."""
    import torch
    import transformers

    from mergepipe.evaluate.calibrate import calibrate_model

    folder = tmp_path / "bert"
    model, _ = make_bert(folder)
    cal = calibrate_model(str(folder), BERT_TEXTS, 512, checkpoint_names(folder), gradients=True)
    assert cal.objective == "projection"
    assert set(cal.output_moments) == set(cal.moments)
    assert cal.output_moments["pooler.dense.weight"].min() > 0

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    generator = torch.Generator().manual_seed(0)
    token, n = np.zeros(model.config.vocab_size), 0
    for text in BERT_TEXTS:
        enc = tokenizer(text, return_tensors="pt")
        embeds = model.embeddings.word_embeddings(enc["input_ids"]).detach().requires_grad_()
        out = model(inputs_embeds=embeds, attention_mask=enc["attention_mask"], token_type_ids=enc["token_type_ids"])
        total = 0
        for value in (out.last_hidden_state, out.pooler_output):
            total = total + (value * torch.randn(value.shape, generator=generator)).sum()
        total.backward()
        np.add.at(token, enc["input_ids"][0].numpy(), (embeds.grad[0].double() ** 2).mean(dim=1).numpy())
        n += enc["input_ids"].shape[1]
    np.testing.assert_allclose(cal.token_gradients["embeddings.word_embeddings.weight"], token / n, rtol=1e-5)
