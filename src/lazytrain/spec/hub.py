"""Hugging Face hub model ids (`org/name`) as `model.config_path`, through `huggingface_hub`.

Files land in the standard HF cache (`HF_HUB_CACHE`, default `~/.cache/huggingface/hub`), so a
model downloaded by any HF tool is reused and nothing is copied. Planning fetches only
`config.json` (`hub_config_file`); training fetches the weights and tokenizer
(`hub_model_dir`). `HF_HUB_OFFLINE=1` is honoured, read when the call is made: only the cache
is looked at, and a model not in it is a one-line error naming the download command. A hub
that cannot be reached (`reachable`: no TCP connection within 3 s) is treated the same way, at
once, instead of after huggingface_hub's retries.

A local path always wins over a hub id of the same spelling (`is_hub_id`). Knows nothing of
torch (the planner calls it).
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

import huggingface_hub
from huggingface_hub import constants, errors

from lazytrain.errors import UserError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""`org/name`, the form of a Hugging Face hub model id."""

MODEL_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
"""Files `hub_model_dir` downloads: configs, safetensors weights (no .bin/.pt pickles, no
GGUF/ONNX copies) and the tokenizer files."""


class HubModelError(UserError, FileNotFoundError):
    """A hub model that is not available: offline and not cached, unknown, or gated. A
    user error (also a FileNotFoundError): the input names something that is not there (the
    CLI exits 2)."""


def is_hub_id(config_path: str) -> bool:
    """True when `config_path` has the form `org/name` and names no local file or directory."""
    return bool(HUB_ID.fullmatch(str(config_path))) and not Path(config_path).expanduser().exists()


def offline() -> bool:
    """`HF_HUB_OFFLINE` as set now (1/true/yes/on), not when huggingface_hub was imported."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


REACH_TIMEOUT_S = 3.0
"""How long `reachable` waits for a TCP connection to the hub, s. huggingface_hub itself retries
a failed request five times with back-off (about 23 s) before giving up; a connection to a
reachable host takes well under a second."""
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
"""With one of these set the hub is reached through a proxy, which `reachable` does not probe."""


def reachable() -> bool:
    """Whether a TCP connection to the hub's endpoint (`HF_ENDPOINT`, default huggingface.co,
    port 443 or the URL's) opens within `REACH_TIMEOUT_S`. True when a proxy is configured
    (`PROXY_VARS`): the proxy decides. A False makes the look-ups read the cache only, so a
    machine without network gets its one-line error at once."""
    if any(os.environ.get(var) for var in PROXY_VARS):
        return True
    url = urlsplit(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=REACH_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def _cache_only() -> bool:
    """Look in the cache only: `HF_HUB_OFFLINE` is set, or the hub cannot be reached."""
    return offline() or not reachable()


def _cache_dir() -> str | None:
    """`HF_HUB_CACHE` as set now (None: huggingface_hub's default)."""
    return os.environ.get("HF_HUB_CACHE") or None


def _error(repo_id: str, what: str, exc: Exception) -> Exception:
    get = f"hf download {repo_id}" + (" config.json" if what == "config.json" else "")
    local = ("set model.config_path to the downloaded config.json"
             if what == "config.json" else "set model.config_path to the downloaded directory")
    where = _cache_dir() or "the HF cache (~/.cache/huggingface/hub, HF_HUB_CACHE)"
    if offline():
        return HubModelError(f"model.config_path: {repo_id} ({what}) is not in {where} and "
                             f"HF_HUB_OFFLINE=1 forbids downloading; run `{get}` where there "
                             f"is network and {local}, or unset HF_HUB_OFFLINE")
    if isinstance(exc, errors.LocalEntryNotFoundError):  # no network and not cached
        return OSError(f"model.config_path: {repo_id} ({what}) is not in {where} and the hub "
                       f"cannot be reached; check the network, or run `{get}` elsewhere and "
                       f"{local}")
    if isinstance(exc, (errors.RepositoryNotFoundError, errors.GatedRepoError,
                        errors.RemoteEntryNotFoundError, errors.RevisionNotFoundError)):
        return HubModelError(f"model.config_path: {repo_id}: {type(exc).__name__} ("
                             f"{str(exc).splitlines()[0][:160]}); check the id, or log in "
                             f"(`hf auth login`) for a gated model")
    first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    return OSError(f"model.config_path: downloading {repo_id} ({what}) failed: {first}; "
                   f"retry, or download it with `{get}` and set HF_HUB_OFFLINE=1")


def hub_config_file(repo_id: str) -> Path:
    """The model's `config.json` in the HF cache, downloaded first unless offline.

    Raises:
        HubModelError: offline and not cached, or no such (accessible) repository.
        OSError: the download failed (network).
    """
    # an attribute of the module, read at the call: huggingface_hub loads its file_download
    # module only then, so planning a local model never does
    try:
        return Path(huggingface_hub.hf_hub_download(
            repo_id, "config.json", cache_dir=_cache_dir(), local_files_only=_cache_only()))
    except Exception as exc:  # huggingface_hub raises its own classes and requests' errors
        raise _error(repo_id, "config.json", exc) from None


def hub_model_dir(repo_id: str) -> Path:
    """The model's snapshot directory in the HF cache (configs, safetensors weights, tokenizer:
    `MODEL_PATTERNS`), downloaded first unless offline.

    Raises:
        HubModelError: offline and not cached, or no such (accessible) repository.
        OSError: the download failed (network).
    """
    try:
        return Path(huggingface_hub.snapshot_download(
            repo_id, cache_dir=_cache_dir(), local_files_only=_cache_only(),
            allow_patterns=MODEL_PATTERNS))
    except Exception as exc:
        raise _error(repo_id, "weights", exc) from None
