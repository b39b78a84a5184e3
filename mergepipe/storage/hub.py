"""Models on the Hugging Face Hub (`hf://ORG/NAME[@REVISION]`) and in https:// folders.

A Hub location is pinned when its model is read: huggingface_hub resolves the revision (a
branch, tag or commit; `main` by default) to the commit it names now and lists that commit's
files with their sizes and hashes, and every byte is then read from the commit's own URLs
(`{endpoint}/ORG/NAME/resolve/COMMIT/FILE`), so a branch that moves during or after a merge
changes nothing it reads. Reads are exact ranged GETs through fsspec's HTTP filesystem
(storage.remote); a file's fingerprint is its size and the Hub's hash (the ETag it serves).

An https:// folder has no listing: the files a model folder may hold are asked for by name.
The token (HF_TOKEN, a saved `hf auth login`, or storage_options' `hf_token`) goes to the Hub's
endpoint only, in a header: it is never part of a location, a record or a message.
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mergepipe.errors import BadInput
from mergepipe.storage.fingerprints import FileFingerprint

HUB = "hf://"
DEFAULT_ENDPOINT = "https://huggingface.co"
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# A location inside a pinned commit: ENDPOINT/ORG/NAME/resolve/COMMIT[/FILE]
_COMMIT_URL = re.compile(r"^(?P<root>.+/(?P<repo>[^/]+/[^/]+)/resolve/(?P<commit>[0-9a-f]{40}))(?:/|$)")

_lock = threading.Lock()
# What a commit holds never changes: its files, by commit root URL, once listed.
_commits: dict[str, dict[str, FileFingerprint]] = {}


@dataclass(frozen=True)
class HubLocation:
    repo: str
    revision: str


def is_hub(uri: str) -> bool:
    return uri.startswith(HUB)


def parse(uri: str) -> HubLocation:
    """hf://ORG/NAME[@REVISION] (a revision may hold slashes after the @: refs/pr/1)."""
    rest = uri[len(HUB) :].strip("/")
    repo, _, revision = rest.partition("@")
    if not _REPO.match(repo):
        raise BadInput(f"{uri}: not a Hub model location (hf://ORG/NAME or hf://ORG/NAME@REVISION)")
    return HubLocation(repo, revision or "main")


def endpoint() -> str:
    """The Hub's address: HF_ENDPOINT (a mirror, or a test server), else huggingface.co."""
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def token(given: str | None) -> str | None:
    """`given` (the config's storage_options `hf_token`), else huggingface_hub's own lookup
    (HF_TOKEN, then the saved login)."""
    if given:
        return given
    try:
        from huggingface_hub import get_token
    except ImportError:  # no Hub support installed: no saved login either
        return os.environ.get("HF_TOKEN") or None
    return get_token()


def headers_for(uri: str, given: str | None = None) -> dict[str, str]:
    """The Authorization header for a URL on the Hub's endpoint, where there is a token."""
    tok = token(given) if uri.startswith(endpoint() + "/") else None
    return {"Authorization": f"Bearer {tok}"} if tok else {}


def lookup(uri: str, given: str | None) -> str:
    """The root URL of the commit a Hub location's revision names now (one API call, no retry:
    storage.remote.pin retries it); the commit's files are kept for stat and list_folder."""
    loc = parse(uri)
    try:
        from huggingface_hub import HfApi, hf_hub_url
        from huggingface_hub import errors as hf_errors
    except ImportError:
        raise BadInput(f"{uri}: Hub models need huggingface_hub: install mergepipe[hub]") from None

    tok = token(given)
    try:
        info = HfApi(endpoint=endpoint()).model_info(
            loc.repo, revision=loc.revision, files_metadata=True, token=tok or False
        )
    except hf_errors.RevisionNotFoundError:
        raise BadInput(f"{uri}: revision {loc.revision!r} not found in {loc.repo}") from None
    except hf_errors.GatedRepoError:
        raise BadInput(f"{uri}: a gated model: accept its conditions on the Hub, and give a token") from None
    except hf_errors.RepositoryNotFoundError:
        if tok:
            raise BadInput(f"{uri}: model not found, or the token has no access to it") from None
        raise BadInput(
            f"{uri}: model not found, or private or gated: a token is needed (HF_TOKEN, `hf auth login`, "
            "or the config's storage_options hf_token)"
        ) from None
    except hf_errors.HfHubHTTPError as err:
        status = getattr(err.response, "status_code", None)
        if status in (401, 403):
            raise BadInput(f"{uri}: access denied ({status}); a token with access to it is needed") from None
        raise
    root = hf_hub_url(loc.repo, "FILE", revision=info.sha, endpoint=endpoint()).removesuffix("/FILE")
    files = {}
    for s in info.siblings or ():
        digest = s.lfs.sha256 if s.lfs is not None else s.blob_id
        files[s.rfilename] = FileFingerprint(size=int(s.lfs.size if s.lfs is not None else s.size or 0), etag=digest)
    with _lock:
        _commits[root] = files
    return root


def commit_of(location: str) -> str | None:
    """The commit a location inside a pinned commit names (None for any other location)."""
    m = _COMMIT_URL.match(location)
    return m.group("commit") if m else None


def commit_roots(locations) -> list[str]:
    """The pinned commits (their root URLs) that these locations lie in, each once, sorted."""
    return sorted({m.group("root") for loc in locations if (m := _COMMIT_URL.match(loc))})


def repo_of(location: str) -> str | None:
    m = _COMMIT_URL.match(location)
    return m.group("repo") if m else None


def _known(uri: str) -> tuple[dict[str, FileFingerprint], str] | None:
    """The listed commit a URL lies in, and its name there."""
    m = _COMMIT_URL.match(uri)
    with _lock:
        files = _commits.get(m.group("root")) if m else None
    return None if files is None else (files, uri[len(m.group("root")) + 1 :])


def stat(uri: str) -> FileFingerprint | None | bool:
    """A file of a listed commit: its fingerprint (None when the commit has no such file);
    False for any other URL (ask the server)."""
    known = _known(uri)
    if known is None:
        return False
    files, name = known
    return files.get(name)


def list_folder(uri: str, names: tuple[str, ...], exists) -> list[str] | None:
    """The files directly in a listed commit; in an https:// folder, those of `names` that
    `exists` (name -> bool) finds there, asked for in parallel."""
    known = _known(uri)
    if known is not None:
        files, prefix = known
        prefix = prefix + "/" if prefix else ""
        names = [n[len(prefix) :] for n in files if n.startswith(prefix) and "/" not in n[len(prefix) :]]
        return sorted(names) or None
    with ThreadPoolExecutor(8) as pool:
        found = [n for n, there in zip(names, pool.map(exists, names)) if there]
    return sorted(found) or None
