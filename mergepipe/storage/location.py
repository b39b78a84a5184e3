"""Where bytes live: local paths, or fsspec URIs (s3://bucket/prefix) with their filesystems.

Storage options (credentials, endpoint) belong to a merge, not to the process: they are held in
a context variable, set by the flow that validated its config (or by a task that read them from
the config's location) for its own context, and never travel in plans, manifests, task
parameters or logs. Threads that read for a merge run in a copy of its context (ContextPool),
so two merges in one process (a Dask worker, a sweep) each read with their own. Without
options, s3fs falls back to the usual AWS environment variables (AWS_ACCESS_KEY_ID,
AWS_ENDPOINT_URL, AWS_PROFILE, …) and profiles."""

from __future__ import annotations

import contextvars
import os
import posixpath
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

from mergepipe.errors import BadInput

_options: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "mergepipe_storage_options", default=MappingProxyType({})
)

# Listings must be fresh: a cached listing would hide an object overwritten or deleted since.
# Uploads go in parts of exactly the writer's block size (storage.remote.open_writer), so what a
# writer holds is bounded by it, whatever the size of each write.
_DEFAULTS = {"s3": {"use_listings_cache": False, "fixed_upload_size": True}}
HTTP = ("http", "https")
# The storage option that holds a Hugging Face token (s3fs's own `token` is an AWS session token).
HUB_TOKEN = "hf_token"


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def protocol(uri: str) -> str:
    return uri.split("://", 1)[0] if is_remote(uri) else "file"


def join(root: str, *names: str) -> str:
    """A name under root; a name that is a location of its own (a view's file in another model,
    config/views.py) is that location."""
    for i in range(len(names) - 1, -1, -1):
        if is_remote(names[i]) or os.path.isabs(names[i]):
            return join(names[i], *names[i + 1 :])
    if is_remote(root):
        return posixpath.join(root.rstrip("/"), *names)
    return os.path.join(root, *names)


def split(uri: str) -> tuple[str, str]:
    """(parent, name) of a file's location."""
    if is_remote(uri):
        head, _, name = uri.rstrip("/").rpartition("/")
        return head, name
    return os.path.split(uri)


def normalize(uri: str) -> str:
    """A remote URI without a trailing slash or doubled slashes in its key."""
    if not is_remote(uri):
        return uri
    proto, rest = uri.split("://", 1)
    parts = [p for p in rest.split("/") if p]
    if not parts:
        raise BadInput(f"{uri}: no bucket in the URI")
    return f"{proto}://{'/'.join(parts)}"


def trailing_names(uri: str) -> list[str]:
    """A location's candidate display names, shortest first: its last part, its last two parts, …,
    then the whole location (s3://bucket/runs/math -> math, runs/math, bucket/runs/math, the uri)."""
    scheme, sep, rest = uri.rpartition("://")
    parts = [p for p in rest.split("/") if p]
    names = ["/".join(parts[-n:]) for n in range(1, len(parts) + 1)]
    return [*names, uri] if names[-1:] != [uri] else names


def inside(child: str, parent: str) -> bool:
    """Whether `child` is `parent` or lies under it (remote URIs, compared as keys)."""
    child, parent = normalize(child).rstrip("/"), normalize(parent).rstrip("/")
    return child == parent or child.startswith(parent + "/")


def set_storage_options(options: Mapping[str, Any] | None) -> None:
    """Options for the remote filesystems opened in the calling context from now on (a flow's
    own context: flows.orchestration runs each flow in a copy of its caller's)."""
    _options.set(MappingProxyType(dict(options or {})))


@contextmanager
def storage_options(options: Mapping[str, Any] | None) -> Iterator[None]:
    """These options for the block's storage calls (and the ContextPool threads it starts), the
    caller's again after it: a task on a shared worker reads with its own merge's options."""
    token = _options.set(MappingProxyType(dict(options or {})))
    try:
        yield
    finally:
        _options.reset(token)


def current_options() -> dict[str, Any]:
    return dict(_options.get())


def hub_token() -> str | None:
    """The Hub token a config's storage_options give, if any."""
    return _options.get().get(HUB_TOKEN)


class ContextPool(ThreadPoolExecutor):
    """A thread pool whose calls run in a copy of the submitting thread's context: its storage
    options (and Prefect's run context) reach the threads that read for it."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)


def filesystem(uri: str):
    """The fsspec filesystem for a remote URI. fsspec caches instances by their arguments."""
    proto = protocol(uri)
    try:
        import fsspec

        cls = fsspec.get_filesystem_class(proto)
    except (ImportError, ValueError) as err:
        hint = " (install mergepipe[s3])" if proto in ("s3", "s3a") else ""
        raise BadInput(f"{uri}: no filesystem for {proto}://{hint}: {err}") from None
    opts = {**_DEFAULTS.get(proto, {}), **_options.get()}
    token = opts.pop(HUB_TOKEN, None)
    if proto in HTTP:  # exact ranges (no read-ahead blocks); the Hub's token in a header, never in a URL
        from mergepipe.storage.hub import headers_for

        opts = {"block_size": 0, "headers": headers_for(uri, token)}
    try:
        return cls(**opts)
    except TypeError as err:
        # The message names the offending keyword, never a value.
        raise BadInput(f"storage_options: not accepted by the {proto}:// filesystem ({err})") from None


def fs_path(uri: str) -> str:
    """The path as the filesystem names it (no protocol; a URL stays whole)."""
    return uri if protocol(uri) in HTTP else uri.split("://", 1)[1]
