"""`chat_template` as mergekit resolves it: `auto` (the inputs' most common template), a built-in
template's name, or a Jinja template; saved as chat_template.jinja, where transformers looks first,
so that the output's tokenizer loads with it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mergepipe.cli import app
from mergepipe.devtools.synthetic import make_family
from mergepipe.flows.merge import merge
from mergepipe.publish.manifest import verify_output
from mergepipe.storage.model_files import MANIFEST_FILE

from .helpers import config_for

transformers = pytest.importorskip("transformers")

BASE_TEMPLATE = "{% for m in messages %}[base] {{ m['content'] }}\n{% endfor %}"
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}</s>\n{% endfor %}\n"
VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}


def _tokenizer(folder: Path, template: str | None, as_file: bool = False) -> None:
    """A real tokenizer (a word-level one), its chat template in tokenizer_config.json or, as
    transformers saves it now, in chat_template.jinja."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    if template and as_file:
        (folder / "chat_template.jinja").write_text(template)
    elif template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """The base has a template of its own; two of the three experts share another (one in
    tokenizer_config.json, one in chat_template.jinja); the third has none."""
    fam = make_family(
        tmp_path_factory.mktemp("chatfam"),
        experts=("dense", "dense", "dense"),
        n_layers=1,
        hidden=32,
        intermediate=64,
        vocab=64,
        dtype="float32",
        seed=3,
    )
    _tokenizer(fam.base, BASE_TEMPLATE)
    _tokenizer(fam.experts[0], CHAT_TEMPLATE)
    _tokenizer(fam.experts[1], CHAT_TEMPLATE, as_file=True)
    _tokenizer(fam.experts[2], None)
    return fam


def _loaded(out: Path):
    return transformers.AutoTokenizer.from_pretrained(str(out))


def test_auto_takes_the_inputs_most_common_template(family, tmp_path):
    cfg = config_for(tmp_path, family, "linear", chat_template="auto")
    r = merge(config=str(cfg), out=str(tmp_path / "out"), catalog=str(tmp_path / "c.duckdb"))
    out = tmp_path / "out"
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE.strip()  # compared stripped, as mergekit does
    tok = _loaded(out)
    assert tok.chat_template == CHAT_TEMPLATE.strip()
    assert tok.get_vocab() == VOCAB and tok.eos_token == "</s>"
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert "chat_template" not in config and config["eos_token"] == "</s>"
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert "chat_template.jinja" in {f["file"] for f in manifest["content"]["output"]["files"]}
    assert verify_output(out).ok
    assert r["bytes"]["sidecar"] > 0
    # Without chat_template the base's files are copied as they are.
    plain = config_for(tmp_path, family, "linear", name="plain.yaml")
    p = merge(config=str(plain), out=str(tmp_path / "plain"), catalog=str(tmp_path / "c.duckdb"))
    assert (tmp_path / "plain" / "tokenizer_config.json").read_bytes() == (
        family.base / "tokenizer_config.json"
    ).read_bytes()
    assert not (tmp_path / "plain" / "chat_template.jinja").exists()
    assert _loaded(tmp_path / "plain").chat_template == BASE_TEMPLATE
    assert p["digest"] != r["digest"]


def test_a_template_given_as_is(family, tmp_path):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    cfg = config_for(tmp_path, family, "linear", chat_template=template)
    merge(config=str(cfg), out=str(tmp_path / "out"), catalog=str(tmp_path / "c.duckdb"))
    tok = _loaded(tmp_path / "out")
    assert tok.chat_template == template
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert rendered == "user: hello\n"


@pytest.mark.parametrize(
    "value,match",
    [
        ("no-such-template", "chat_template"),
        ("{{ short }}", "not a chat template"),
    ],
)
def test_a_template_that_is_none_is_refused_by_name(family, tmp_path, value, match):
    cfg = config_for(tmp_path, family, "linear", chat_template=value)
    r = CliRunner().invoke(app, ["merge", str(cfg), "--out", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert match in r.output and not (tmp_path / "out").exists()


def test_a_built_in_name_needs_mergekit_or_gives_its_template(family, tmp_path):
    cfg = config_for(tmp_path, family, "linear", chat_template="chatml")
    if importlib.util.find_spec("mergekit") is None:
        r = CliRunner().invoke(app, ["merge", str(cfg), "--out", str(tmp_path / "out")])
        assert r.exit_code == 2 and "chat_template" in r.output and "pip install mergekit" in r.output, r.output
        return
    from importlib.resources import files

    merge(config=str(cfg), out=str(tmp_path / "out"), catalog=str(tmp_path / "c.duckdb"))
    expected = files("mergekit._data.chat_templates").joinpath("chatml.jinja").read_text()
    assert _loaded(tmp_path / "out").chat_template == expected
