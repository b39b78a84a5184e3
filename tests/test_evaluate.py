"""The evaluate stage: the command evaluator's contract (score line, failures recorded, timeouts,
{model} quoting) and the built-in loss evaluator on a tiny trained Llama family."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest

from mergepipe.config.search import CommandEvaluation, PerplexityEvaluation
from mergepipe.errors import BadInput
from mergepipe.evaluate import Score, evaluate, mean_loss, run_command
from mergepipe.evaluate.perplexity import MASK_AT, MASK_EVERY, read_texts

from .llama_family import make_bert, make_llama_family


def command(cmd: str, timeout: float | None = None) -> CommandEvaluation:
    return CommandEvaluation(cmd, timeout)


# --- the command evaluator


def test_json_line_gives_score_and_numeric_metrics(tmp_path):
    s = run_command(
        command("""echo warming up; echo '{"score": 0.25, "acc": 0.75, "n": 3, "flag": true, "name": "x"}'"""),
        str(tmp_path),
    )
    assert s.ok and s.score == 0.25 and s.error is None
    assert s.metrics == {"acc": 0.75, "n": 3.0}
    assert s.seconds >= 0
    assert json.loads(json.dumps(s.as_json())) == {
        "score": 0.25,
        "metrics": {"acc": 0.75, "n": 3.0},
        "error": None,
        "seconds": s.seconds,
    }


@pytest.mark.parametrize("line, value", [("1.5", 1.5), ("-2", -2.0), ("  3e-2  ", 0.03), ("+4.5", 4.5)])
def test_bare_number(tmp_path, line, value):
    s = run_command(command(f"echo other output; echo '{line}'; echo"), str(tmp_path))
    assert s.ok and s.score == value and s.metrics == {}


def test_nonzero_exit_is_recorded_with_stderr_tail(tmp_path):
    script = "for i in $(seq 1 50); do echo line$i >&2; done; echo 0.5; exit 3"
    s = run_command(command(script), str(tmp_path))
    assert not s.ok and s.score is None
    assert "exited with status 3" in s.error
    assert "line50" in s.error and "line31" in s.error and "line30\n" not in s.error  # the last 20 lines


def test_timeout_kills_the_command_and_what_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    s = run_command(command(f"sleep 60 & echo $! > {pid_file}; wait", timeout=2), str(tmp_path))
    assert time.monotonic() - started < 30
    assert not s.ok and s.score is None and "timed out after 2 s" in s.error
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status  # a zombie has ended


@pytest.mark.parametrize(
    "cmd, says",
    [
        ("true", "printed nothing"),
        ("echo 0.5; echo all done", "'all done': not a score"),
        ("""echo '{"score": "high"}'""", "no numeric `score`"),
        ("""echo '{"accuracy": 0.5}'""", "no numeric `score`"),
        ("""echo '{"score": true}'""", "no numeric `score`"),
        ("echo '[1, 2]'", "not a score"),
        ("echo nan", "not finite"),
        ("""echo '{"score": Infinity}'""", "not finite"),
    ],
)
def test_output_without_a_score_is_a_failed_score(tmp_path, cmd, says):
    s = run_command(command(cmd + "; echo some warning >&2"), str(tmp_path))
    assert not s.ok and s.score is None
    assert says in s.error and "some warning" in s.error


def test_model_folder_with_a_space_is_one_argument(tmp_path):
    folder = tmp_path / "my model's folder"
    folder.mkdir()
    (folder / "marker").write_text("")
    s = evaluate(command('set -- {model}; test -f "$1/marker" && echo $#'), str(folder))
    assert s.ok and s.score == 1.0, s.error


def test_score_ok_and_json():
    assert not Score(float("nan"), {}, None, 0.0).ok
    assert not Score(1.0, {}, "boom", 0.0).ok
    assert Score(float("inf"), {"p": float("inf")}, None, 1.0).as_json() == {
        "score": None,
        "metrics": {"p": None},
        "error": None,
        "seconds": 1.0,
    }


# --- the built-in loss evaluator


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    pytest.importorskip("transformers")
    return make_llama_family(tmp_path_factory.mktemp("llama-family"))


def loss(family_model: str, data: str, **kw) -> Score:
    s = evaluate(PerplexityEvaluation(data, **kw), family_model)
    assert s.ok, s.error
    return s


@pytest.mark.slow  # loads transformers and trains the tiny family (seconds each, minutes loaded)
def test_experts_are_better_on_their_own_domain(family):
    expert_a, expert_b = family["experts"]
    base = {d: loss(family["base"], family[f"heldout_{d}"]).score for d in "ab"}
    a = {d: loss(expert_a, family[f"heldout_{d}"]).score for d in "ab"}
    b = {d: loss(expert_b, family[f"heldout_{d}"]).score for d in "ab"}
    assert a["a"] < a["b"] and b["b"] < b["a"]
    assert a["a"] < base["a"] and b["b"] < base["b"]


@pytest.mark.slow  # loads transformers and trains the tiny family (seconds each, minutes loaded)
def test_score_is_the_mean_token_loss(family):
    s = loss(family["base"], family["heldout_mixed"])
    assert s.metrics["perplexity"] == pytest.approx(math.exp(s.score))
    # every token after <s> is predicted, </s> included
    words = sum(len(t.split()) + 1 for t in read_texts(PerplexityEvaluation(family["heldout_mixed"])))
    assert s.metrics["tokens"] == words
    again = loss(family["base"], family["heldout_mixed"])
    assert again.score == s.score  # deterministic


@pytest.mark.slow  # loads transformers and trains the tiny family (seconds each, minutes loaded)
def test_samples_limits_the_texts(family):
    full = loss(family["base"], family["heldout_mixed"])
    few = loss(family["base"], family["heldout_mixed"], samples=5)
    assert len(read_texts(PerplexityEvaluation(family["heldout_mixed"], samples=5))) == 5
    assert few.metrics["tokens"] < full.metrics["tokens"]


@pytest.mark.slow  # loads transformers and trains the tiny family (seconds each, minutes loaded)
def test_max_length_truncates(family):
    full = loss(family["base"], family["heldout_mixed"])
    short = loss(family["base"], family["heldout_mixed"], max_length=3)
    assert short.metrics["tokens"] == 2 * 20  # three tokens each, two of them predicted
    assert short.score != full.score


@pytest.mark.slow  # loads transformers and trains the tiny family (seconds each, minutes loaded)
def test_plain_text_and_json_lines_give_the_same_loss(family):
    jsonl = loss(family["base"], family["heldout_mixed"])
    text = loss(family["base"], family["heldout_mixed_txt"])
    assert text.score == jsonl.score and text.metrics == jsonl.metrics


@pytest.mark.slow  # loads transformers and trains the tiny family (seconds each, minutes loaded)
def test_json_array_and_other_field(family, tmp_path):
    texts = read_texts(PerplexityEvaluation(family["heldout_mixed"]))
    array = tmp_path / "texts.json"
    array.write_text(json.dumps([{"body": t} for t in texts]))
    assert read_texts(PerplexityEvaluation(str(array), field="body")) == texts
    # a JSON Lines file whatever its name, by its first line
    lines = tmp_path / "texts.data"
    lines.write_text("\n".join(json.dumps({"body": t}) for t in texts))
    assert read_texts(PerplexityEvaluation(str(lines), field="body")) == texts


@pytest.mark.slow  # loads transformers and trains the tiny family (seconds each, minutes loaded)
def test_missing_or_empty_data_is_bad_input(family, tmp_path):
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(BadInput, match=r"nowhere.jsonl: text data not found \(search.evaluate.perplexity.data\)"):
        mean_loss(PerplexityEvaluation(str(missing)), family["base"])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(BadInput, match="empty.txt: no texts"):
        mean_loss(PerplexityEvaluation(str(empty)), family["base"])
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"text": "one two"}\n{"content": "three"}\n')
    with pytest.raises(BadInput, match=r"wrong.jsonl: line 2: no 'text' key"):
        mean_loss(PerplexityEvaluation(str(wrong)), family["base"])
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "one two"}\n{"text": \n')
    with pytest.raises(BadInput, match=r"broken.jsonl: line 2: not JSON"):
        mean_loss(PerplexityEvaluation(str(broken)), family["base"])


@pytest.mark.slow  # loads transformers and trains the tiny family (seconds each, minutes loaded)
def test_without_transformers_is_bad_input(family, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(BadInput, match=r"pip install 'mergepipe\[eval\]'"):
        mean_loss(PerplexityEvaluation(family["heldout_mixed"]), family["base"])


@pytest.mark.slow  # loads transformers and trains the tiny family (seconds each, minutes loaded)
def test_a_model_that_does_not_load_is_a_failed_score(family, tmp_path):
    s = mean_loss(PerplexityEvaluation(family["heldout_mixed"]), str(tmp_path))
    assert not s.ok and s.score is None and "cannot load the model" in s.error


@pytest.mark.slow  # loads transformers and trains the tiny family (seconds each, minutes loaded)
def test_nonfinite_weights_are_a_failed_score(family, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan-model"
    shutil.copytree(family["base"], broken)
    weights = load_file(str(broken / "model.safetensors"))
    name = next(n for n in weights if n.endswith("norm.weight"))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    s = mean_loss(PerplexityEvaluation(family["heldout_mixed"]), str(broken))
    assert not s.ok and s.score is None and "not finite" in s.error


@pytest.mark.slow  # loads transformers and trains the tiny family (seconds each, minutes loaded)
def test_masked_lm_scores_fixed_positions(tmp_path):
    pytest.importorskip("transformers")
    folder = tmp_path / "bert"
    _, tokenizer = make_bert(folder, masked_lm=True)
    texts = ["the red cat sees a blue dog", "one two three four five one two three four five", "one"]
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts))
    s = mean_loss(PerplexityEvaluation(str(data)), str(folder))
    assert s.ok, s.error
    # [CLS] w1 … wn [SEP]: positions p with p % 7 == 3 among 1..n
    expected = sum(1 for t in texts for p in range(1, len(t.split()) + 1) if p % MASK_EVERY == MASK_AT)
    assert s.metrics["tokens"] == expected == 3
    assert s.score == pytest.approx(math.log(len(tokenizer)), rel=0.5)  # untrained: near uniform


@pytest.mark.slow  # loads transformers and trains the tiny family (seconds each, minutes loaded)
def test_unsupported_architecture_is_a_failed_score(family, tmp_path):
    import shutil

    other = tmp_path / "encoder"
    shutil.copytree(family["base"], other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["LlamaModel"]
    (other / "config.json").write_text(json.dumps(config))
    s = mean_loss(PerplexityEvaluation(family["heldout_mixed"]), str(other))
    assert not s.ok and "ForCausalLM" in s.error


@pytest.mark.slow  # loads transformers and trains the tiny family (seconds each, minutes loaded)
def test_family_files(family):
    for folder in (family["base"], *family["experts"]):
        names = set(os.listdir(folder))
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
        config = json.loads(Path(folder, "config.json").read_text())
        assert config["tie_word_embeddings"] is False and config["architectures"] == ["LlamaForCausalLM"]
