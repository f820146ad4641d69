"""Models named by their Hugging Face Hub id, as vLLM and llama.cpp take them.

`org/name` (`org/name@revision` to pin one; `org/name:TAG` picks the GGUF file of a repo holding several whose name
has TAG, e.g. `:Q4_K_M`, as llama.cpp's `-hf` does). What radiance reads is fetched into the Hub's cache once with
`huggingface_hub` (its progress bars, HF_TOKEN / `hf auth login` for gated repos, HF_HUB_OFFLINE): config.json, the
tokenizer files and the .safetensors weights of a Transformers repo (not its other copies), or the one GGUF file.
A Hub that cannot be reached (or offline mode) falls back to what the cache already holds. Every failure is one
line naming the reference as typed (`org/name@revision:TAG`) and what to do.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import re
import socket
from dataclasses import dataclass
from urllib.parse import urlparse

from radiance.env import hub_offline_settings
from radiance.errors import CheckpointError

logger = logging.getLogger(__name__)

# what an HF model directory needs: config, generation config, tokenizer (fast or SentencePiece), chat templates,
# the weights and their index; not the copies some repos add in their makers' own layouts (Mistral's
# consolidated.safetensors, Meta's original/), which radiance does not read and which double the download
TRANSFORMERS_FILES = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken")
NOT_TRANSFORMERS_FILES = ("original/*", "consolidated*")
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+?))?"
                     r"(?::(?P<tag>[\w.-]+))?")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
_MERGE_SPLIT = "merge the parts with llama.cpp's llama-gguf-split --merge"
_LOG_IN = "`hf auth login` or HF_TOKEN"
_LISTED_FILES = 12  # a repo's files named in a message, at most


@dataclass(frozen=True)
class HubModel:
    repo: str
    revision: str | None = None
    tag: str | None = None  # part of the name of the GGUF file to take

    def __str__(self) -> str:
        """The reference as the user typed it: every message names this, tag included."""
        return self.repo + (f"@{self.revision}" if self.revision else "") + (f":{self.tag}" if self.tag else "")


def hub_model(spec: str) -> HubModel | None:
    """The Hub model `spec` names, or None when it cannot be an id (an absolute, home or dotted relative path)."""
    if os.path.isabs(spec) or spec.startswith(("~", ".")):
        return None
    match = _HUB_ID.fullmatch(spec)
    return HubModel(**match.groupdict()) if match else None


def fetch(model: HubModel) -> str:
    """The local path (a model directory or a .gguf file) of `model`, fetched into the Hub's cache if need be."""
    from huggingface_hub import list_repo_files

    _check_id(model)
    if _offline_mode() is not None:  # the Hub is not to be asked at all: what the cache holds, or why not
        logger.info("%s is no local path, and Hugging Face offline mode is on: looking it up in the Hub's cache",
                    model)
        return _cached(model, why=None)
    logger.info("%s is no local path: looking it up on the Hugging Face Hub", model)
    unreachable = _unresolvable_endpoint()
    if unreachable is not None:  # huggingface_hub retried a connection for ~25 s before it failed
        return _cached(model, unreachable)
    try:
        files = list_repo_files(model.repo, revision=model.revision)
    except Exception as exc:  # noqa: BLE001 - a refusal is said; offline, no network, the Hub down: the cache
        _raise_if_refused(model, exc)
        return _cached(model, exc)
    return _download(model, files)


def _check_id(model: HubModel) -> None:
    """The Hub's own rules for an id ('--' and '..' are refused, 96 characters at most), checked before anything
    is asked: otherwise an invalid id read as one the Hub could not be reached for, or the cache does not hold."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model.repo)
    except ValueError as exc:  # HFValidationError
        raise CheckpointError(f"{model}: no such local path, and no valid Hugging Face Hub id "
                              f"({_first_line(exc)})") from None


def _download(model: HubModel, files: list[str]) -> str:
    """Fetch what radiance reads of the repo listing `files` into the cache; its local path."""
    from huggingface_hub import hf_hub_download, snapshot_download

    gguf = pick_gguf(model, files)
    if gguf is None and not _has_transformers_weights(files):
        raise CheckpointError(f"{model} on the Hugging Face Hub holds neither a config.json with .safetensors weights "
                              f"nor a .gguf file (radiance reads those; its files: {_some(files)}): pick a repo "
                              "that does, e.g. a GGUF or safetensors conversion of this model")
    try:
        if gguf is not None:
            return hf_hub_download(model.repo, gguf, revision=model.revision)
        return snapshot_download(model.repo, revision=model.revision, allow_patterns=list(TRANSFORMERS_FILES),
                                 ignore_patterns=list(NOT_TRANSFORMERS_FILES))
    except Exception as exc:  # noqa: BLE001 - gated (the listing is public), disk full, the connection lost
        _raise_if_refused(model, exc)
        raise CheckpointError(_download_failure(model, exc)) from None


def pick_gguf(model: HubModel, files: list[str]) -> str | None:
    """The GGUF file to take: the one whose name has the tag (any case), or the repo's only one; None for a repo of
    Transformers weights without a tag. Multimodal projectors are never the model."""
    ggufs = _model_ggufs(files)
    if model.tag is None and (not ggufs or _has_transformers_weights(files)):
        return None
    matches = _tagged(model, ggufs)
    if len(matches) == 1:
        if _SPLIT_GGUF.search(matches[0]):
            raise CheckpointError(f"{model}: {matches[0]} is one part of a split GGUF, which radiance does not read "
                                  f"({_MERGE_SPLIT})")
        return matches[0]
    if not matches:
        raise CheckpointError(_no_match(model, files))
    names = _some(os.path.basename(f) for f in ggufs)
    if all(_SPLIT_GGUF.search(f) for f in matches):
        # the parts of one model share a name but for "-0000N-of-0000M": count models, not files
        models = {_SPLIT_GGUF.sub("", f) for f in matches}
        if len(models) == 1:
            what = f"{model.tag!r} names" if model.tag is not None else "its one GGUF model is"
            raise CheckpointError(f"{model}: {what} a split GGUF, which radiance does not read ({_MERGE_SPLIT})")
        what = f"the {len(models)} GGUF models {model.tag!r} names" if model.tag is not None else \
            f"all {len(models)} of its GGUF models"
        raise CheckpointError(f"{model}: {what} are split GGUFs ({_some(os.path.basename(m) for m in models)}), "
                              f"which radiance does not read (pick one and {_MERGE_SPLIT})")
    if model.tag is not None:
        raise CheckpointError(f"{model}: several GGUF files match {model.tag!r} (its GGUF files: {names}): name one "
                              f"by a longer part of its name")
    untagged = HubModel(model.repo, model.revision)
    raise CheckpointError(f"{model} holds several GGUF files: name one as {untagged}:TAG, TAG part of its name "
                          f"(e.g. {untagged}:Q4_K_M; its GGUF files: {names})")


def _no_match(model: HubModel, files: list[str]) -> str:
    """The tag matched no GGUF file: which ones there are, or, with none, what the repo holds instead."""
    ggufs = _model_ggufs(files)
    if ggufs:
        return (f"{model}: no GGUF file matches {model.tag!r} (its GGUF files: "
                f"{_some(os.path.basename(f) for f in ggufs)}): name one of them after the ':'")
    drop = f" (drop :{model.tag} to take its .safetensors weights)" if _has_transformers_weights(files) else ""
    return f"{model}: no GGUF file matches {model.tag!r}: the repo holds none (its files: {_some(files)}){drop}"


def _model_ggufs(files: list[str]) -> list[str]:
    return [f for f in files if f.endswith(".gguf") and "mmproj" not in os.path.basename(f).lower()]


def _tagged(model: HubModel, ggufs: list[str]) -> list[str]:
    return [f for f in ggufs if model.tag is None or model.tag.lower() in os.path.basename(f).lower()]


def _has_transformers_weights(files: list[str]) -> bool:
    return "config.json" in files and any(
        f.endswith(".safetensors") and not any(fnmatch.fnmatch(f, p) for p in NOT_TRANSFORMERS_FILES) for f in files)


def _some(files) -> str:
    """Up to _LISTED_FILES names, sorted, and how many more: a repo may hold hundreds."""
    names = sorted(files)
    more = f", ... ({len(names) - _LISTED_FILES} more)" if len(names) > _LISTED_FILES else ""
    return (", ".join(names[:_LISTED_FILES]) + more) or "none"


# ------------------------------------------------------------------------------ refusals and failures


def _raise_if_refused(model: HubModel, exc: Exception) -> None:
    """A CheckpointError when the Hub answered no (gated, unknown, no such revision, a bad token):
    the cache would not help, and 'could not be reached' would mislead."""
    from huggingface_hub import errors

    def refused(message: str) -> CheckpointError:
        return CheckpointError(f"{model}: {message}")

    page = f"{_endpoint()}/{model.repo}"
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, errors.GatedRepoError):
        raise refused(f"a gated model on the Hugging Face Hub, not open to this account: accept its terms at {page} "
                      f"and log in with that account ({_LOG_IN})") from None
    if isinstance(exc, errors.RepositoryNotFoundError):
        raise refused("no such local path, and no such model on the Hugging Face Hub: check the id (a private one "
                      f"needs {_LOG_IN})") from None
    if isinstance(exc, errors.RevisionNotFoundError):
        raise refused(f"the Hugging Face Hub has no revision {model.revision!r} of {model.repo} (a branch, tag or "
                      f"commit of it: see {page}/commits)") from None
    if isinstance(exc, getattr(errors, "DisabledRepoError", ())):
        raise refused(f"its repository is disabled on the Hugging Face Hub ({page}): pick another") from None
    if status == 401:
        raise refused("the Hugging Face Hub refused the token (401): HF_TOKEN or the one `hf auth login` saved is "
                      "invalid or expired: renew it, or unset it for a public model") from None
    if status == 403:
        raise refused(f"the Hugging Face Hub refused access (403): the token lacks read access to {model.repo} "
                      f"(a fine-grained token needs it; {_LOG_IN} with one that has it)") from None


def _download_failure(model: HubModel, exc: Exception) -> str:
    """What went wrong while the files came down, and what to do."""
    cache = _hub_cache()
    fault = _os_error(exc)
    if fault in (errno.ENOSPC, errno.EDQUOT):
        return (f"{model}: no space left on the device while downloading it into the Hugging Face cache ({cache}): "
                "free space there, or set HF_HUB_CACHE (or HF_HOME) to a folder on a disk with room, and retry")
    if fault in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"{model}: cannot write the Hugging Face cache ({cache}: {_reason(exc)}): set HF_HUB_CACHE (or "
                "HF_HOME) to a folder you can write")
    return (f"{model}: downloading it from the Hugging Face Hub failed ({_reason(exc)}): retry (what came down "
            "stays in the cache)")


def _os_error(exc: BaseException) -> int | None:
    """The errno of the OSError behind `exc` (its cause chain included), or of the Rust error text hf_xet passes."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code:
            return int(code.group(1))
        exc = exc.__cause__ or exc.__context__
    return None


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_first_line(exc)}".rstrip(": ")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


# ------------------------------------------------------------------------------ the Hub's cache


def _offline_mode() -> list[str] | None:
    """The variables that turned huggingface_hub's offline mode on (["HF_HUB_OFFLINE=1"], ["TRANSFORMERS_OFFLINE=1"]
    or both), None when off. huggingface_hub reads them once, at import: its constant is what it acts on."""
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        return None
    return hub_offline_settings() or ["HF_HUB_OFFLINE=1"]


def _unresolvable_endpoint() -> OSError | None:
    """The error of resolving the Hub's host name (HF_ENDPOINT's), None when it resolves: no DNS means no network."""
    host = urlparse(_endpoint()).hostname or ""
    try:
        socket.getaddrinfo(host, 443)
    except OSError as exc:
        return exc
    return None


def _endpoint() -> str:
    from huggingface_hub import constants
    return constants.ENDPOINT


def _hub_cache() -> str:
    from huggingface_hub import constants
    return getattr(constants, "HF_HUB_CACHE", None) or constants.HUGGINGFACE_HUB_CACHE


def _cached(model: HubModel, why: Exception | None) -> str:
    """The model as the Hub's cache already holds it, when the Hub cannot be asked (`why`; None: offline mode)."""
    folder = _cached_snapshot(model)
    files = _files_under(folder) if folder else []
    path = _cached_model(model, folder, files)
    if path is None:
        raise CheckpointError(_not_cached(model, why, files))
    if why is None:
        logger.info("%s: served from the Hugging Face cache (offline mode: %s)", model, " and ".join(_offline_mode()))
    else:  # said, so that a stale copy served because of a token or proxy problem is not a mystery
        logger.warning("%s: the Hugging Face Hub could not be asked (%s): serving the copy in its cache", model,
                       _reason(why))
    return path


def _cached_snapshot(model: HubModel) -> str | None:
    """The cache's snapshot folder of the repo at the revision, None when it holds none."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model.repo, revision=model.revision, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - not cached (LocalEntryNotFoundError), or cached in part:
        # huggingface_hub >= 1.x says IncompleteSnapshotError for a snapshot that lacks some of the repo's files,
        # which radiance's own downloads always do (it leaves the .bin and consolidated copies): what it needs may
        # be there
        return getattr(exc, "snapshot_path", None)


def _files_under(folder: str) -> list[str]:
    return [os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            for root, _, names in os.walk(folder) for name in names]


def _cached_model(model: HubModel, folder: str | None, files: list[str]) -> str | None:
    """The local path of the model in the cached `folder` holding `files`, None when what it needs is not there."""
    if folder is None or (model.tag is not None and not _tagged(model, _model_ggufs(files))):
        return None
    gguf = pick_gguf(model, files)
    if gguf is not None:
        return os.path.join(folder, gguf)
    if model.tag is None and _has_transformers_weights(files) and not _missing_shards(folder, files):
        return folder
    return None


def _missing_shards(folder: str, files: list[str]) -> list[str]:
    """The weight shards the cached index names that the cache does not hold (a download cut short)."""
    index = "model.safetensors.index.json"
    if index not in files:
        return []
    try:
        with open(os.path.join(folder, index), encoding="utf-8") as f:
            shards = set(json.load(f).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        return []  # the reader says what is wrong with it
    return sorted(shards - set(files))


def _not_cached(model: HubModel, why: Exception | None, files: list[str]) -> str:
    """Why the model cannot be served: the Hub not asked (offline mode) or not reached, and the cache lacking it."""
    held = f" (of it the cache holds: {_some(files)})" if files else ""
    cache = f"the Hugging Face cache ({_hub_cache()})"
    if why is None:
        flags = _offline_mode()
        names = " and ".join(flag.split("=")[0] for flag in flags)
        # HF_HUB_OFFLINE=0 turns it off whichever is set: huggingface_hub reads HF_HUB_OFFLINE first
        return (f"{model}: no such local path, and Hugging Face offline mode is on ({' and '.join(flags)}) while "
                f"{cache} does not hold this model{held}: unset {names} so that radiance downloads it, or download "
                f"it first where the Hub is reachable (e.g. `HF_HUB_OFFLINE=0 radiance inspect {model}`)")
    status = getattr(getattr(why, "response", None), "status_code", None)
    if isinstance(status, int) and status >= 500:  # the Hub was reached: the network is not the one to check
        return (f"{model}: no such local path, and the Hugging Face Hub answered with a server error "
                f"({_reason(why)}) while {cache} does not hold it{held}: the Hub is failing, retry later")
    return (f"{model}: no such local path, and the Hugging Face Hub could not be reached to fetch it "
            f"({_reason(why)}) while {cache} does not hold it{held}: check the network (or HF_ENDPOINT, a proxy) "
            "and retry")
