"""Models named by their Hugging Face Hub id, as vLLM and llama.cpp take them.

`org/name` (`org/name@revision` to pin one; `org/name:TAG` picks the GGUF file of a repo holding several whose name
has TAG, e.g. `:Q4_K_M`, as llama.cpp's `-hf` does). What radiance reads is fetched into the Hub's cache once with
`huggingface_hub` (its progress bars, HF_TOKEN / `hf auth login` for gated repos, HF_HUB_OFFLINE): config.json, the
tokenizer files and the .safetensors weights of a Transformers repo (not its other copies), or the one GGUF file.
A Hub that cannot be reached falls back to what the cache already holds.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import socket
from dataclasses import dataclass
from urllib.parse import urlparse

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


@dataclass(frozen=True)
class HubModel:
    repo: str
    revision: str | None = None
    tag: str | None = None  # part of the name of the GGUF file to take


def hub_model(spec: str) -> HubModel | None:
    """The Hub model `spec` names, or None when it cannot be an id (an absolute, home or dotted relative path)."""
    if os.path.isabs(spec) or spec.startswith(("~", ".")):
        return None
    match = _HUB_ID.fullmatch(spec)
    return HubModel(**match.groupdict()) if match else None


def fetch(model: HubModel) -> str:
    """The local path (a model directory or a .gguf file) of `model`, fetched into the Hub's cache if need be."""
    from huggingface_hub import hf_hub_download, list_repo_files, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    where = model.repo + (f"@{model.revision}" if model.revision else "")
    logger.info("%s is no local path: looking it up on the Hugging Face Hub", where)
    unreachable = _unresolvable_endpoint()
    if unreachable is not None:  # huggingface_hub retried a connection for ~25 s before it failed
        return _cached(model, where, unreachable)
    try:
        files = list_repo_files(model.repo, revision=model.revision)
    except GatedRepoError:
        raise CheckpointError(f"{where} is a gated model on the Hugging Face Hub: accept its terms on its page and "
                              "log in (`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{where}: no such local path, and no such model on the Hugging Face Hub (a private "
                              "one needs `hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{where}: the Hugging Face Hub has no revision {model.revision!r}") from None
    except Exception as exc:  # noqa: BLE001 - offline, no network, the Hub down: what the cache holds, if anything
        return _cached(model, where, exc)
    gguf = pick_gguf(model, files, where)
    if gguf is not None:
        return hf_hub_download(model.repo, gguf, revision=model.revision)
    if _has_transformers_weights(files):
        return snapshot_download(model.repo, revision=model.revision, allow_patterns=list(TRANSFORMERS_FILES),
                                 ignore_patterns=list(NOT_TRANSFORMERS_FILES))
    raise CheckpointError(f"{where} on the Hugging Face Hub holds neither a config.json with .safetensors weights "
                          f"nor a .gguf file (radiance reads those; its files: {', '.join(sorted(files)[:12])})")


def pick_gguf(model: HubModel, files: list[str], where: str) -> str | None:
    """The GGUF file to take: the one whose name has the tag (any case), or the repo's only one; None for a repo of
    Transformers weights without a tag. Multimodal projectors are never the model."""
    ggufs = [f for f in files if f.endswith(".gguf") and "mmproj" not in os.path.basename(f).lower()]
    if model.tag is None and (not ggufs or _has_transformers_weights(files)):
        return None
    matches = [f for f in ggufs if model.tag is None or model.tag.lower() in os.path.basename(f).lower()]
    if len(matches) == 1:
        if _SPLIT_GGUF.search(matches[0]):
            raise CheckpointError(f"{where}: {matches[0]} is one part of a split GGUF, which radiance does not read "
                                  "(merge the parts with llama.cpp's llama-gguf-split --merge)")
        return matches[0]
    names = ", ".join(sorted(os.path.basename(f) for f in ggufs)) or "none"
    if not matches:
        raise CheckpointError(f"{where}: no GGUF file matches {model.tag!r} (its GGUF files: {names})")
    if all(_SPLIT_GGUF.search(f) for f in matches):
        raise CheckpointError(f"{where}: {model.tag!r} names a split GGUF, which radiance does not read (merge the "
                              "parts with llama.cpp's llama-gguf-split --merge)")
    raise CheckpointError(f"{where} holds several GGUF files: name one as {model.repo}:TAG, TAG part of its name "
                          f"(e.g. {model.repo}:Q4_K_M; its GGUF files: {names})")


def _has_transformers_weights(files: list[str]) -> bool:
    return "config.json" in files and any(
        f.endswith(".safetensors") and not any(fnmatch.fnmatch(f, p) for p in NOT_TRANSFORMERS_FILES) for f in files)


def _unresolvable_endpoint() -> OSError | None:
    """The error of resolving the Hub's host name (HF_ENDPOINT's), None when it resolves: no DNS means no network."""
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or ""
    try:
        socket.getaddrinfo(host, 443)
    except OSError as exc:
        return exc
    return None


def _cached(model: HubModel, where: str, why: Exception) -> str:
    """The model as the Hub's cache already holds it, when the Hub cannot be asked."""
    from huggingface_hub import snapshot_download

    reason = f"{type(why).__name__}: {str(why).splitlines()[0] if str(why) else ''}"
    try:
        folder = snapshot_download(model.repo, revision=model.revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached either
        raise CheckpointError(f"{where}: no such local path, and the Hugging Face Hub could not be reached to fetch "
                              f"it ({reason})") from None
    # said, so that a stale copy served because of a token or proxy problem is not a mystery
    logger.warning("%s: the Hugging Face Hub could not be asked (%s): serving the copy in its cache", where, reason)
    files = [os.path.relpath(os.path.join(root, name), folder)
             for root, _, names in os.walk(folder) for name in names]
    gguf = pick_gguf(model, files, where)
    if gguf is not None:
        return os.path.join(folder, gguf)
    if model.tag is None and "config.json" in files:
        return folder
    raise CheckpointError(f"{where}: the Hugging Face Hub could not be reached and the cache holds no model of it")
