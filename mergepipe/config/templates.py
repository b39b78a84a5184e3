"""Chat templates as a config names them (mergekit's `chat_template`): `auto`, the name of one of
mergekit's built-in templates, or a Jinja template itself; and the choice `auto` makes."""

from __future__ import annotations

from collections import Counter

AUTO = "auto"


def _looks_like_a_name(value: str) -> bool:
    return len(value) < 256 and "\n" not in value and "{" not in value


def named_template(name: str) -> str:
    """The text of mergekit's built-in template `name` (chatml, llama3, alpaca, …). They are
    mergekit's data, so they come with an installed mergekit."""
    from importlib.resources import files

    try:
        found = files("mergekit._data.chat_templates").joinpath(f"{name}.jinja")
    except ModuleNotFoundError:
        raise ValueError(
            f"{name!r} names one of mergekit's built-in templates, which come with mergekit "
            "(pip install mergekit); or give the Jinja template itself"
        ) from None
    if not found.is_file():
        known = sorted(p.name.removesuffix(".jinja") for p in files("mergekit._data.chat_templates").iterdir())
        raise ValueError(f"no built-in template named {name!r} (mergekit has: {', '.join(known)})")
    return found.read_text()


def check_chat_template(value: str) -> str:
    """`value` checked as mergekit checks it: `auto`; a name (short, on one line, without a
    brace) of a built-in template; else a template, of at least 20 characters with a `{`."""
    if value == AUTO:
        return value
    if _looks_like_a_name(value):
        named_template(value)
        return value
    if len(value) < 20:
        raise ValueError("not a chat template: `auto`, a built-in template's name, or a Jinja template")
    return value


def chosen_template(value: str, inputs: list[str | None]) -> str | None:
    """The template the output's tokenizer gets: for `auto`, the most common of the inputs'
    templates (stripped, as mergekit compares them; on a tie the first in input order, the
    base first), None when no input has one; a name, its text; else the value as given."""
    if value == AUTO:
        found = [t.strip() for t in inputs if t and t.strip()]
        if not found:
            return None
        counts = Counter(found)
        return max(counts, key=lambda t: (counts[t], -found.index(t)))
    if _looks_like_a_name(value):
        return named_template(value)
    return value


def template_of(tokenizer_config: dict | None, jinja: str | None) -> str | None:
    """A model's chat template as transformers loads it: its chat_template.jinja, else its
    tokenizer_config.json's `chat_template` (a string, or the one named `default`)."""
    if jinja is not None:
        return jinja
    template = (tokenizer_config or {}).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    elif isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None
