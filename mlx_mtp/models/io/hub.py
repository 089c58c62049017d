"""Hugging Face Hub ids (``org/name[@revision]``) wherever a model path is taken.

Resolution goes through ``huggingface_hub`` as mlx-lm does: its cache (``HF_HOME`` /
``HF_HUB_CACHE``), ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``, tokens from ``HF_TOKEN`` or
``hf auth login``, its progress bars, and its resume of a dropped transfer (HTTP Range).
Only the files a command needs are fetched (``allow_patterns``), never the whole repo.
Every failure becomes a ``HubError`` whose message says what to do (CLI: exit 2).

Ids are checked before any request: the name by huggingface_hub's ``validate_repo_id``,
the revision as a git ref name that cannot act as a path (huggingface_hub stores
``refs/{revision}`` in the cache, so ``@/abs/path`` would write there). Every request waits
at most ``HF_HUB_ETAG_TIMEOUT`` seconds (default 10) to connect or for data: a Hub that
accepts connections and never answers fails instead of hanging.
"""

from __future__ import annotations

import hashlib
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

from ...errors import CheckpointError

# What loading a model reads: config, weights (mtp.safetensors included, unlike mlx-lm's
# ``model*.safetensors``), tokenizer, chat template, draft-vocab ranking. No ``*.py``:
# mlx-mtp never runs code from a checkpoint.
MODEL_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "tiktoken.model",
               "*.txt", "*.jsonl", "*.jinja")
# What reading a tokenizer needs (draft-vocab): no weights.
TOKENIZER_FILES = ("*.json", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt",
                   "*.jinja")

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@.+)?$")  # the shape; see check_hub_id
# A branch, tag or commit, by git's ref-name rules (git check-ref-format): components
# without control characters, spaces or ~^:?*[\ that do not start with a dot, joined by
# single slashes; so ``refs/{revision}`` stays inside the cache.
_REF_COMPONENT = r"[^\x00-\x20\x7f~^:?*\[\\/.][^\x00-\x20\x7f~^:?*\[\\/]*"
_REVISION = re.compile(rf"^{_REF_COMPONENT}(/{_REF_COMPONENT})*$")
MAX_REVISION_LENGTH = 255  # a file name's limit (the cache's ref file)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class HubError(CheckpointError):
    """A hub id that cannot be resolved; the message says why and what to do."""


def parse_repo_id(spec: str) -> Optional[Tuple[str, Optional[str]]]:
    """``(repo_id, revision)`` when ``spec`` reads as ``org/name[@revision]``, else None."""
    spec = str(spec)
    if not _REPO_ID.match(spec) or ".." in spec or "--" in spec.split("@")[0]:
        return None
    repo_id, _, revision = spec.partition("@")
    return repo_id, revision or None


def local_path_exists(spec) -> bool:
    """Whether ``spec`` names an existing local path (False for names no file system
    takes, e.g. a component longer than 255 bytes)."""
    try:
        return Path(str(spec)).expanduser().exists()
    except (OSError, ValueError):
        return False


def is_repo_id(spec) -> bool:
    """A string that is not an existing local path and reads as a hub id."""
    return (spec is not None and not local_path_exists(spec)
            and parse_repo_id(str(spec)) is not None)


def check_hub_id(repo_id: str, revision: Optional[str]) -> None:
    """Refuse an id huggingface_hub would not accept, or a revision that reads as a path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubError(f"{repo_id[:100]!r} is not a valid Hugging Face id: "
                       f"{str(e).split(':')[0]}.") from e
    if revision is not None and (
            len(revision) > MAX_REVISION_LENGTH or not _REVISION.match(revision)
            or ".." in revision or "@{" in revision or revision.endswith((".", ".lock"))):
        raise HubError(f"{revision[:100]!r} is not a valid revision of {repo_id}: pass a "
                       f"branch, tag or commit (a git ref name of at most "
                       f"{MAX_REVISION_LENGTH} characters: no '..', no leading '/').")


def _bound_request_time() -> None:
    """Every request of huggingface_hub's shared HTTP client gets a timeout: its API calls
    (repo info, file listings) pass none, so a silent endpoint would hang them."""
    from huggingface_hub import get_session

    hooks = get_session().event_hooks["request"]
    if _fill_in_timeouts not in hooks:
        hooks.append(_fill_in_timeouts)


def _fill_in_timeouts(request) -> None:
    """Request hook: ``HF_HUB_ETAG_TIMEOUT`` for each phase without a timeout of its own."""
    from huggingface_hub import constants

    timeouts = dict.fromkeys(("connect", "read", "write", "pool"))
    timeouts.update(request.extensions.get("timeout") or {})
    request.extensions["timeout"] = {phase: constants.HF_HUB_ETAG_TIMEOUT if t is None else t
                                     for phase, t in timeouts.items()}


def _hub_url(repo_id: str) -> str:
    from huggingface_hub import constants

    return f"{constants.ENDPOINT}/{repo_id}"


def _explain(spec: str, error: Exception) -> str:
    """What went wrong resolving ``spec`` and what to do about it."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    repo_id, revision = parse_repo_id(spec) or (spec, None)
    cache = constants.HF_HUB_CACHE
    if isinstance(error, GatedRepoError):
        return (f"{repo_id} is a gated model: accept its licence at {_hub_url(repo_id)}, then "
                "log in with `hf auth login` (or set HF_TOKEN) and run the command again.")
    if isinstance(error, RevisionNotFoundError):
        return (f"{repo_id} has no revision {revision!r}: pass a branch, tag or commit that "
                f"exists (see {_hub_url(repo_id)}/tree/main), or drop the @{revision}.")
    if isinstance(error, RepositoryNotFoundError):
        return (f"{spec!r} is neither a local directory nor a model on the Hub "
                f"({constants.ENDPOINT}): check the spelling; a private repo needs "
                "`hf auth login` (or HF_TOKEN).")
    offline = constants.HF_HUB_OFFLINE or isinstance(error, OfflineModeIsEnabled)
    if isinstance(error, EntryNotFoundError) and not isinstance(error, LocalEntryNotFoundError):
        return f"{repo_id} has no such file ({error})."
    if isinstance(error, LocalEntryNotFoundError) or offline or isinstance(error, OSError):
        if offline:
            return (f"{spec} is not (completely) in the Hugging Face cache ({cache}) and "
                    "HF_HUB_OFFLINE is set: unset HF_HUB_OFFLINE to download it, download it "
                    f"once while online (`hf download {repo_id}`), or pass a local directory.")
        waited = (f" within {constants.HF_HUB_ETAG_TIMEOUT} s (HF_HUB_ETAG_TIMEOUT)"
                  if "Timeout" in str(error) else "")
        return (f"Could not download {spec} from {constants.ENDPOINT}{waited} and it is not "
                f"(completely) in the cache ({cache}): check the network connection (or "
                "HF_ENDPOINT) and run the command again (downloads resume), or pass a local "
                f"directory. ({_first_line(error)})")
    return f"Could not fetch {spec} from {constants.ENDPOINT}: {_first_line(error)}"


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


@contextmanager
def _hub_errors(spec: str):
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    try:
        yield
    except HubError:
        raise
    except (HfHubHTTPError, EntryNotFoundError, OSError, ValueError, _transport_error()) as e:
        # huggingface_hub's errors (HTTP, not found, offline, incomplete) and the transport's.
        raise HubError(_explain(spec, e)) from e


def _transport_error() -> type:
    """The HTTP client's base error (huggingface_hub >= 1 uses httpx or its fork httpx2)."""
    for name in ("httpx2", "httpx"):
        try:
            return __import__(name).HTTPError
        except (ImportError, AttributeError):
            continue
    return OSError


_resolved: Dict[Tuple[str, Tuple[str, ...]], Path] = {}


def snapshot(spec: str, patterns: Iterable[str] = MODEL_FILES) -> Path:
    """Local directory of the hub model ``spec`` (``org/name[@revision]``) holding the files
    matching ``patterns``, downloaded (resumably) into the Hugging Face cache if needed.
    Resolved once per process."""
    parsed = parse_repo_id(spec)
    if parsed is None:
        raise HubError(f"{spec!r} is not a hub id (expected org/name or org/name@revision).")
    key = (spec, tuple(patterns))
    if key not in _resolved:
        from huggingface_hub import snapshot_download

        repo_id, revision = parsed
        check_hub_id(repo_id, revision)
        _bound_request_time()
        with _hub_errors(spec):
            path = Path(snapshot_download(repo_id, revision=revision,
                                          allow_patterns=list(patterns)))
        if not (path / "config.json").exists():
            raise HubError(f"{spec} has no config.json: it is not a model repo mlx-mtp can "
                           f"load (see {_hub_url(parsed[0])}).")
        _resolved[key] = path
    return _resolved[key]


def download_file(repo_id: str, filename: str, revision: Optional[str] = None,
                  verify: bool = False, missing_ok: bool = False) -> Optional[Path]:
    """One file of a hub repo (``hf_hub_download``: cached, resumable). ``verify``: check
    the content against the sha256 the Hub names the blob by (LFS files). ``missing_ok``:
    None when the repo has no such file."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    spec = repo_id + (f"@{revision}" if revision else "")
    check_hub_id(repo_id, revision)
    _bound_request_time()
    try:
        with _hub_errors(spec):
            path = Path(hf_hub_download(repo_id, filename, revision=revision))
    except HubError as e:
        cause = e.__cause__
        if (missing_ok and isinstance(cause, EntryNotFoundError)
                and not isinstance(cause, LocalEntryNotFoundError)):
            return None
        raise
    if verify:
        check_sha256(path, filename, spec)
    return path


def check_sha256(path: Path, filename: str, spec: str) -> None:
    """The cache stores LFS blobs under their sha256: compare the content with it."""
    blob = Path(os.path.realpath(path))
    expected = blob.name
    if not _SHA256.match(expected):
        return  # a small git file (no sha256 to compare against)
    digest = hashlib.sha256()
    with open(blob, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        blob.unlink(missing_ok=True)
        raise HubError(f"{filename} of {spec} does not match its checksum (sha256 "
                       f"{digest.hexdigest()[:12]}... instead of {expected[:12]}...): the copy "
                       "was damaged and has been removed; run the command again to download it.")

