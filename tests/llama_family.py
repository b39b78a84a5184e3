"""A tiny Llama family that really learned something: a base trained on two synthetic text
domains and two experts trained further on one domain each, with a word-level tokenizer and
held-out texts of each domain (for the built-in evaluator and the search); and a tiny BERT."""

from __future__ import annotations

import json
import random
from pathlib import Path

NUMBERS = (
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
).split()
COLOURS = "red blue green yellow black white brown grey pink orange".split()
ANIMALS = "cat dog bird fish horse cow sheep goat mouse fox".split()
VERBS = "sees likes chases follows meets finds hears feeds".split()
SPECIAL = ("<unk>", "<s>", "</s>", "<pad>")
WORDS = (
    *NUMBERS,
    "count",
    "plus",
    "minus",
    "is",
    "comes",
    "after",
    "before",
    *COLOURS,
    *ANIMALS,
    *VERBS,
    "the",
    "a",
    "and",
)


def numbers_sentence(rng: random.Random) -> str:
    """Domain A: counting and small sums, in words."""
    kind = rng.randrange(4)
    if kind == 0:
        start = rng.randrange(len(NUMBERS) - 6)
        return "count " + " ".join(NUMBERS[start : start + rng.randint(3, 6)])
    if kind == 1:
        a, b = rng.randint(1, 10), rng.randint(1, 10)
        return f"{NUMBERS[a - 1]} plus {NUMBERS[b - 1]} is {NUMBERS[a + b - 1]}"
    if kind == 2:
        a = rng.randint(3, 20)
        b = rng.randint(1, a - 1)
        return f"{NUMBERS[a - 1]} minus {NUMBERS[b - 1]} is {NUMBERS[a - b - 1]}"
    n = rng.randint(2, 19)
    if rng.random() < 0.5:
        return f"{NUMBERS[n - 1]} comes after {NUMBERS[n - 2]}"
    return f"{NUMBERS[n - 1]} comes before {NUMBERS[n]}"


def animals_sentence(rng: random.Random) -> str:
    """Domain B: coloured animals doing things to each other."""

    def thing() -> str:
        return f"{rng.choice(('the', 'a'))} {rng.choice(COLOURS)} {rng.choice(ANIMALS)}"

    sentence = f"{thing()} {rng.choice(VERBS)} {thing()}"
    if rng.random() < 0.3:
        sentence += f" and {thing()}"
    return sentence


DOMAINS = {"a": numbers_sentence, "b": animals_sentence}


def sentences(domain: str, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [DOMAINS[domain](rng) for _ in range(n)]


def mixed(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [DOMAINS[rng.choice("ab")](rng) for _ in range(n)]


def make_tokenizer():
    """A word-level tokenizer over the two domains' words: <s> before each text, </s> after."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate((*SPECIAL, *dict.fromkeys(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def llama_config(tokenizer, **changes):
    """The tiny Llama's config (hidden 32, 2 layers, untied) for this tokenizer; `changes` override it."""
    from transformers import LlamaConfig

    values = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaConfig(**{**values, **changes})


def _train(model, tokenizer, texts_for_step, steps: int) -> None:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for step in range(steps):
        batch = tokenizer(texts_for_step(step), padding=True, return_tensors="pt")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def make_llama_family(root: Path, *, steps: int = 30, seed: int = 0, batch: int = 16) -> dict:
    """Build the family under `root`: base/ (trained `steps` steps on both domains), expert_a/
    and expert_b/ (the base trained `steps` more on one domain), each a float32 model.safetensors
    with config.json and the tokenizer's files; and held-out texts (unseen seeds), 20 each:
    heldout_a.jsonl, heldout_b.jsonl, heldout_mixed.jsonl (field "text") and heldout_mixed.txt
    (the same mixed texts, one per line). Returns their paths as strings."""
    import torch
    from transformers import LlamaForCausalLM

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    config = llama_config(tokenizer)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    rng = random.Random(seed)

    def batches(domains: str):
        return lambda _step: [DOMAINS[rng.choice(domains)](rng) for _ in range(batch)]

    def save(name: str) -> str:
        folder = root / name
        # transformers 5 always saves safetensors; float32 as trained
        model.save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))
        return str(folder)

    _train(model, tokenizer, batches("ab"), steps)
    base = save("base")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    experts = []
    for domain in "ab":
        model.load_state_dict(state)
        _train(model, tokenizer, batches(domain), steps)
        experts.append(save(f"expert_{domain}"))

    paths = {"root": str(root), "base": base, "experts": experts}
    for domain, offset in (("a", 1), ("b", 2)):
        path = root / f"heldout_{domain}.jsonl"
        _write_jsonl(path, sentences(domain, 20, seed + 1000 * offset))
        paths[f"heldout_{domain}"] = str(path)
    held = mixed(20, seed + 3000)
    _write_jsonl(root / "heldout_mixed.jsonl", held)
    (root / "heldout_mixed.txt").write_text("\n".join(held) + "\n")
    paths["heldout_mixed"] = str(root / "heldout_mixed.jsonl")
    paths["heldout_mixed_txt"] = str(root / "heldout_mixed.txt")
    return paths


def make_bert(folder: Path, masked_lm: bool = False):
    """A tiny BERT (hidden 16, one layer; BertModel, or BertForMaskedLM with `masked_lm`) over a
    word-level vocabulary of a few words, saved with its tokenizer in `folder`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertForMaskedLM, BertModel, PreTrainedTokenizerFast

    words = "the red cat sees a blue dog and one two three four five".split()
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],  # as BERT's own
    )
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = (BertForMaskedLM if masked_lm else BertModel)(config).eval()
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return model, tokenizer
