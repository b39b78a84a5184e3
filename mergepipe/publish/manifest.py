"""Manifests: the record that identifies a merge (content, hashed into its digest) and how it
ran (run section, outside the digest), plus `verify`."""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mergepipe import __version__
from mergepipe.config.templates import AUTO, chosen_template, template_of
from mergepipe.errors import BadInput, DeterminedError
from mergepipe.index.blocks import layer_count
from mergepipe.plan.output import OutputLayout
from mergepipe.plan.record import Plan, access_set_sha256
from mergepipe.publish.card import CARD_FILE, model_card
from mergepipe.publish.tokenizer import vocabulary_rows, with_vocab_size, write_tokenizer
from mergepipe.storage.canonical import digest_of
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.location import is_remote, join, normalize, split
from mergepipe.storage.model_files import ACCESS_FILE, CONFIG_FILE, INDEX_FILE, MANIFEST_FILE, TOKENIZER_FILES
from mergepipe.storage.reader import read_small_file, stat
from mergepipe.storage.staging import Staging
from mergepipe.storage.writer import sha256_uri

FORMAT = "mergepipe-manifest/1"


def index_json(layout: OutputLayout) -> bytes:
    body = {"metadata": {"total_size": layout.total_size(), "format": "pt"}, "weight_map": layout.weight_map()}
    return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()


def versions() -> dict:
    """What produced the output (outside the digest). Read from the installed distributions, so
    publishing imports no orchestration code."""
    from importlib.metadata import PackageNotFoundError, version

    found = {
        "mergepipe": __version__,
        "python": platform.python_version(),
        "torch": version("torch"),
        "duckdb": version("duckdb"),
        "prefect": version("prefect"),
    }
    try:  # what saves a built tokenizer (an extra)
        found["transformers"] = version("transformers")
    except PackageNotFoundError:
        pass
    return found


# Where a model's config.json says how many layers it has (mergekit's architectures name these).
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def with_layer_count(config: bytes, n_layers: int) -> bytes:
    """A config.json that says the output's layer count (a `slices:` merge may have more or
    fewer layers than its base): the base's, with its layer count key set; as it is when it
    already says so, or is not a JSON object with such a key."""
    try:
        data = json.loads(config)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return config
    key = next((k for k in LAYER_COUNT_KEYS if isinstance(data, dict) and isinstance(data.get(k), int)), None)
    if key is None or data[key] == n_layers:
        return config
    data[key] = n_layers
    return (json.dumps(data, indent=2) + "\n").encode()


def write_output_files(plan: Plan, layout: OutputLayout, staging: Staging, ledger: ByteLedger) -> tuple[dict, dict]:
    """Index, sidecars, access set, model card and a built tokenizer into staging; then hash
    everything. Returns the manifest's `output` section, and what the manifest keeps in `run`,
    outside the digest: the card's entry (None without one: the config's `write_model_card:
    false`), as the card names where the inputs were read, and a built tokenizer's files
    (`tokenizer_files`), as their bytes depend on the transformers version that saved them."""
    staging.put(INDEX_FILE, index_json(layout))
    base = plan.inputs[0]
    n_layers = layer_count(base.tensors)
    rows = vocabulary_rows(plan)
    # a built tokenizer replaces the base's files (config.json stays, with its vocab_size set)
    kept = [n for n in base.sidecars if rows is None or n not in TOKENIZER_FILES]
    for name in kept:
        if name == CONFIG_FILE and (plan.spec.get("slices") or rows is not None):
            config = with_layer_count(_read_sidecar(base, name, ledger), n_layers)
            staging.put(name, config if rows is None else with_vocab_size(config, rows))
        else:
            staging.copy_in(join(base.root, name), name, ledger)
    outside: dict = {}
    if rows is None:
        template = _write_chat_template(plan, staging, ledger)
    else:
        chosen, _ = _chat_template(plan, ledger)
        outside["tokenizer_files"] = write_tokenizer(plan, staging, chosen)
        template = None
    sink = pa.BufferOutputStream()
    pq.write_table(plan.access, sink)
    staging.put(ACCESS_FILE, sink.getvalue().to_pybytes())
    shards = []
    for shard in layout.shards:
        digest, size = staging.sha256(shard.name, ledger)
        if size != shard.size:
            raise DeterminedError(f"{staging.location}: staged {shard.name} has {size} bytes, the layout {shard.size}")
        shards.append({"file": shard.name, "size": size, "sha256": digest})
    files = []
    for name in [INDEX_FILE, *kept, *([template] if template and template not in kept else [])]:
        digest, size = staging.sha256(name)
        files.append({"file": name, "size": size, "sha256": digest})
    card = None
    if plan.spec.get("write_model_card", True):
        staging.put(CARD_FILE, model_card(plan))
        digest, size = staging.sha256(CARD_FILE)
        card = {"file": CARD_FILE, "size": size, "sha256": digest}
    return {"shards": shards, "files": files, "access_set_file": ACCESS_FILE}, {"model_card": card, **outside}


TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _read_sidecar(inp, name: str, ledger: ByteLedger) -> bytes | None:
    if name not in inp.sidecars:
        return None
    data = read_small_file(join(inp.root, name))
    ledger.add("sidecar", inp.role, name, len(data))
    return data


def _json_object(data: bytes | None, where: str) -> dict | None:
    if data is None:
        return None
    try:
        found = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadInput(f"{where}: not valid JSON ({err})") from None
    return found if isinstance(found, dict) else None


def _write_chat_template(plan: Plan, staging: Staging, ledger: ByteLedger) -> str | None:
    """The config's chat_template into staging as chat_template.jinja, where transformers saves
    a tokenizer's template and looks for it first; the base's tokenizer_config.json loses its
    own `chat_template` entry, as a tokenizer re-saved with the new template has none. Returns
    the file's name, or None where nothing is set (no chat_template; `auto` and no input has one)."""
    template, config = _chat_template(plan, ledger)
    if template is None:
        return None
    staging.put(CHAT_TEMPLATE_FILE, template.encode())
    if config is not None and "chat_template" in config:
        del config["chat_template"]
        staging.put(TOKENIZER_CONFIG, (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode())
    return CHAT_TEMPLATE_FILE


def _chat_template(plan: Plan, ledger: ByteLedger) -> tuple[str | None, dict | None]:
    """The chat template the config chooses (None: none), and the base's tokenizer_config.json."""
    value = plan.spec.get("chat_template")
    if not value:
        return None, None
    base = plan.inputs[0]
    configs = {base.uri: _json_object(_read_sidecar(base, TOKENIZER_CONFIG, ledger), join(base.root, TOKENIZER_CONFIG))}
    found = []
    if value == AUTO:  # each model once, the base first
        for inp in {i.uri: i for i in plan.inputs}.values():
            if inp.uri not in configs:
                where = join(inp.root, TOKENIZER_CONFIG)
                configs[inp.uri] = _json_object(_read_sidecar(inp, TOKENIZER_CONFIG, ledger), where)
            jinja = _read_sidecar(inp, CHAT_TEMPLATE_FILE, ledger)
            found.append(template_of(configs[inp.uri], None if jinja is None else jinja.decode()))
    return chosen_template(value, found), configs[base.uri]


def build_manifest(plan: Plan, output: dict, run: dict) -> dict:
    content = {"format": FORMAT, "plan": plan.content(), "output": output}
    return {"digest": digest_of(content), "content": content, "run": run}


def write_manifest(staging: Staging, manifest: dict) -> None:
    staging.put(MANIFEST_FILE, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())


def manifest_uri(location: str | Path) -> str:
    """The manifest of an output folder (or the manifest file itself)."""
    location = str(location)
    if location.endswith(".json") or (not is_remote(location) and Path(location).is_file()):
        return location
    return join(normalize(location), MANIFEST_FILE)


def load_manifest(location: str | Path) -> dict:
    """A manifest whose digest matches its content; a hand-edited one is refused."""
    path = manifest_uri(location)
    if stat(path) is None:
        raise BadInput(
            f"{path}: no manifest: not a published output (never published, unfinished, or not a mergepipe output)"
        )
    try:
        manifest = json.loads(read_small_file(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadInput(f"{path}: manifest is not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or not {"digest", "content", "run"} <= set(manifest):
        raise BadInput(f"{path}: not a mergepipe manifest (needs digest, content and run)")
    if manifest["content"].get("format") != FORMAT:
        raise BadInput(f"{path}: unknown manifest format {manifest['content'].get('format')!r}")
    actual = digest_of(manifest["content"])
    if actual != manifest["digest"]:
        raise BadInput(
            f"{path}: manifest content does not match its digest (edited by hand?): {actual} != {manifest['digest']}"
        )
    return manifest


def load_access_set(location: str | Path, manifest: dict) -> pa.Table:
    """The access set saved beside a manifest."""
    folder = split(manifest_uri(location))[0]
    path = join(folder, manifest["content"]["output"]["access_set_file"])
    if stat(path) is None:
        raise BadInput(f"{path}: the manifest's access set is missing")
    return pq.read_table(pa.BufferReader(read_small_file(path)))


@dataclass
class Verification:
    out: str
    digest: str
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    checked_bytes: int = 0

    def fail(self, msg: str) -> None:
        self.ok = False
        self.problems.append(msg)


def verified_digest(out: str | Path) -> str | None:
    """The digest of a published output whose files all match its manifest, else None (no
    manifest there, or a file that differs)."""
    try:
        check = verify_output(out)
    except BadInput:
        return None
    return check.digest if check.ok else None


def verify_output(out: str | Path) -> Verification:
    """Re-hash every file the manifest names (the model card too); report each that differs."""
    manifest = load_manifest(out)
    folder = split(manifest_uri(out))[0]
    result = Verification(str(out), manifest["digest"])
    output = manifest["content"]["output"]
    card = manifest["run"].get("model_card")
    tokenizer = manifest["run"].get("tokenizer_files") or []
    for entry in output["shards"] + output["files"] + ([card] if card else []) + tokenizer:
        path = join(folder, entry["file"])
        found = sha256_uri(path)
        if found is None:
            result.fail(f"{path}: missing")
            continue
        digest, size = found
        result.checked_bytes += size
        if size != entry["size"] or digest != entry["sha256"]:
            result.fail(
                f"{path}: sha256 {digest} ({size} bytes) differs from the manifest's {entry['sha256']} ({entry['size']} bytes)"
            )
    try:
        access = load_access_set(out, manifest)
    except BadInput as err:
        result.fail(str(err))
    else:
        if access_set_sha256(access) != manifest["content"]["plan"]["access_set"]["sha256"]:
            result.fail(f"{join(folder, output['access_set_file'])}: access set differs from the manifest's")
    return result
