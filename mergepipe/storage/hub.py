"""Models on the Hugging Face Hub (`hf://ORG/NAME[@REVISION]`) and in https:// folders.

A Hub location is pinned when its model is read: huggingface_hub resolves the revision (a
branch, tag or commit; `main` by default) to the commit it names now and lists that commit's
files with their sizes and hashes, and every byte is then read from the commit's own URLs
(`{endpoint}/ORG/NAME/resolve/COMMIT/FILE`), so a branch that moves during or after a merge
changes nothing it reads. Reads are exact ranged GETs through fsspec's HTTP filesystem
(storage.remote); a file's fingerprint is its size and the Hub's hash (the ETag it serves).

A large file's URL answers with a redirect to a signed URL on a storage host: each file is
resolved once (a HEAD, huggingface_hub's get_hf_file_metadata, which never follows a redirect
off the Hub), and its ranged reads go to the signed URL, which expires (storage.remote keeps
it, and resolves again when it has expired or the storage host refuses it). The resolver is
rate-limited per window: a 429 is waited out as its headers say (rate_limit_wait).

An https:// folder has no listing: the files a model folder may hold are asked for by name.
The token (HF_TOKEN, a saved `hf auth login`, or storage_options' `hf_token`) goes to the Hub's
endpoint only, in a header: it is never part of a location, a record or a message.
"""

from __future__ import annotations

import calendar
import contextvars
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

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
# The commits a run that merges several times has pinned its Hub locations to (one_commit_per_run).
_run_pins: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("mergepipe_hub_pins", default=None)


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
    """The Authorization header for a URL on the Hub's endpoint, where there is a token; none
    for any other host (a storage host's signed URL, a mirror, an https:// folder)."""
    tok = token(given) if on_endpoint(uri) else None
    return {"Authorization": f"Bearer {tok}"} if tok else {}


def on_endpoint(uri: str) -> bool:
    """Whether a URL is on the Hub's endpoint (the one host its token goes to)."""
    return uri.startswith(endpoint() + "/")


def resolvable(uri: str) -> bool:
    """A file of a pinned commit on the Hub's endpoint: its bytes may lie behind a redirect."""
    return on_endpoint(uri) and _COMMIT_URL.match(uri) is not None


def resolve(uri: str, given: str | None) -> str:
    """Where a Hub file's bytes are read: the signed URL its resolve URL redirects to (without
    following it, so no header of ours reaches the storage host), or the URL itself where the
    Hub serves the file directly. One request, no retry (storage.remote retries it)."""
    from huggingface_hub import get_hf_file_metadata

    return get_hf_file_metadata(uri, token=token(given) or False, retry_on_errors=False).location


def expiry(url: str) -> float | None:
    """When a signed URL stops working (seconds since the epoch), where its query says: a
    CloudFront or S3 (v2) `Expires`, or S3 v4's `X-Amz-Date` + `X-Amz-Expires`."""
    query = {k.lower(): v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    try:
        if "expires" in query:
            return float(query["expires"])
        if "x-amz-date" in query and "x-amz-expires" in query:
            signed = calendar.timegm(time.strptime(query["x-amz-date"], "%Y%m%dT%H%M%SZ"))
            return signed + float(query["x-amz-expires"])
    except ValueError:
        pass
    return None


def rate_limit_wait(headers: Mapping[str, str] | None) -> float | None:
    """Seconds a rate-limited answer asks to wait: its RateLimit header's reset where nothing
    remains (huggingface_hub parses it), else its Retry-After; None where it says neither."""
    if not headers:
        return None
    try:
        from huggingface_hub.utils import parse_ratelimit_headers

        info = parse_ratelimit_headers(headers)
    except ImportError:
        info = None
    if info is not None and info.remaining == 0:
        return float(info.reset_in_seconds)
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:  # an HTTP date: not given in seconds
        return None


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


@contextmanager
def one_commit_per_run() -> Iterator[None]:
    """Within the block (and the flows it runs), each Hub location's revision is looked up
    once: every merge of a sweep (or of any run that merges several times) reads the commit
    the first one pinned, however the branch moves meanwhile."""
    token = _run_pins.set({})
    try:
        yield
    finally:
        _run_pins.reset(token)


def pinned(uri: str, look_up) -> str:
    """The commit root a Hub location is pinned to: the run's, where a run pins once, else
    `look_up()` (and the run keeps it)."""
    pins = _run_pins.get()
    if pins is None:
        return look_up()
    with _lock:
        held = pins.get(uri)
    if held is not None:
        return held
    root = look_up()
    with _lock:
        return pins.setdefault(uri, root)


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


def list_commit(uri: str) -> list[str] | None | bool:
    """The files directly in a folder of a listed commit (None when it has none); False for any
    other URL (an https:// folder, which cannot be listed)."""
    known = _known(uri)
    if known is None:
        return False
    files, prefix = known
    prefix = prefix + "/" if prefix else ""
    names = [n[len(prefix) :] for n in files if n.startswith(prefix) and "/" not in n[len(prefix) :]]
    return sorted(names) or None
