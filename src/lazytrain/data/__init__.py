"""Datasets for training: formats, tokenization with prompt masking, padded micro-batches.

`build_data(data_cfg, tokenizer, ...)` is the one entry point `train/` uses: it reads the
configured source (a local JSON/JSONL/Parquet/Arrow/CSV file or folder, or a Hugging Face Hub
dataset id, all through `datasets` (`sources.py`), in one of `formats.FORMATS`; an entry of a
LlamaFactory `dataset_info.json` registry (`registry.py`); or `embedded:arithmetic`, the
project's own generated problems), splits off the held-out evaluation examples and returns a resumable
`TrainStream` (padded, or packed: `packing.py`). Knows nothing about the engine; reads the
model's HF config only to refuse packing where it cannot isolate samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lazytrain.data.batching import DataCounts, TrainStream, pad_batch
from lazytrain.data.formats import (FORMATS, Example, Message, extract_final_answer,
                                    load_examples, normalize_answer, read_dataset)
from lazytrain.data.packing import check_packing_supported, packed_batch, real_token_count
from lazytrain.data.registry import read_registry_dataset
from lazytrain.data.sources import looks_like_hub_id, mix_examples
from lazytrain.data.synthetic import arithmetic_dataset
from lazytrain.data.templates import TEMPLATES, stop_token_ids, use_template
from lazytrain.data.tokenize import IGNORE_INDEX, Encoded, encode, encode_prompt, render

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_TRAIN_SIZE = 2048
"""Training problems generated for `embedded:arithmetic` (more than the default job draws)."""

__all__ = ["DataBundle", "DataCounts", "EMBEDDED_PREFIX", "Encoded", "Example", "FORMATS",
           "IGNORE_INDEX", "Message", "TEMPLATES", "TrainStream", "build_data", "encode",
           "encode_prompt", "extract_final_answer", "load_examples", "normalize_answer",
           "packed_batch", "pad_batch", "real_token_count", "render", "stop_token_ids"]


@dataclass(kw_only=True, frozen=True, slots=True)
class DataBundle:
    """What training needs from the data layer."""

    train: TrainStream
    """Resumable micro-batch stream over the training examples."""
    eval_examples: tuple[Example, ...]
    """Held-out examples (never in `train`), at most `data.num_eval`."""
    source: str
    """Where the data came from (path or embedded name), for the summary."""
    format: str
    """The resolved format name."""
    notes: tuple[str, ...] = ()
    """One-line messages for the run log (e.g. that chatml was chosen as the template)."""


def _load_source(path: str, fmt: str, *, seed: int, num_eval: int, registry: str = "",
                 dataset_dir: str = "", subset: str = "", split: str = "train"
                 ) -> tuple[list[Example], list[Example], str]:
    """(train, eval, format) for a data path; eval is the file's tail when no eval file.

    With `registry` set, `path` is an entry name of that registry (files under `dataset_dir`,
    default: the registry's folder). `subset`/`split`: the dataset's configuration and split.
    """
    if registry:
        examples, resolved = read_registry_dataset(registry, path, dataset_dir=dataset_dir or None)
        return examples, [], resolved
    if path.startswith(EMBEDDED_PREFIX):
        name = path[len(EMBEDDED_PREFIX):]
        if name != "arithmetic":
            raise ValueError(f"data.path: unknown embedded dataset {name!r}; the embedded one "
                             f"is embedded:arithmetic")
        train, held = arithmetic_dataset(num_train=EMBEDDED_TRAIN_SIZE, num_eval=num_eval,
                                         seed=seed)
        return train, held, "arithmetic"
    if fmt == "arithmetic":
        raise ValueError("data.format: arithmetic is only for data.path=embedded:arithmetic")
    examples, resolved = read_dataset(path, fmt, subset=subset, split=split)
    return examples, [], resolved


def _resolver(base_dir: str | Path | None):
    """Path resolution against `base_dir` (default: the cwd); embedded names, absolute paths and
    Hub ids (a relative path that does not exist there) stay as they are."""
    base = Path(base_dir) if base_dir is not None else Path.cwd()

    def resolve(p: str) -> str:
        if p.startswith(EMBEDDED_PREFIX) or Path(p).is_absolute():
            return p
        local = base / p
        return p if not local.exists() and looks_like_hub_id(p) else str(local)

    return resolve


def corpus_texts(cfg: Any, *, seed: int, base_dir: str | Path | None = None) -> list[str]:
    """Every message text of the configured training data (a corpus to train a tokenizer on for
    a random-init model that ships none). Same arguments and errors as `build_data`."""
    train, held, _, _ = _load_configured(cfg, _resolver(base_dir), seed=seed)
    return [m.content for ex in [*train, *held] for m in ex.messages]


def _load_mix(cfg: Any, resolve, *, seed: int):
    """(train, held, format) of `data.mix`: every entry read, held-out examples from the first
    entry's own held-out set or tail (unless `eval_path` / `eval_split` supply them), the
    rest mixed by weight (`sources.mix_examples`)."""
    parts, formats, held = [], [], []
    for k, entry in enumerate(cfg.mix):
        train, own_held, fmt = _load_source(resolve(entry.path), entry.format, seed=seed,
                                            num_eval=cfg.num_eval, subset=entry.subset,
                                            split=entry.split)
        if k == 0 and not (cfg.eval_path or cfg.eval_split):
            held = own_held
            if not held and cfg.num_eval:
                if len(train) <= cfg.num_eval:
                    raise ValueError(f"data.num_eval: {entry.path} (the first data.mix entry, "
                                     f"which the held-out examples come from) has "
                                     f"{len(train)} examples, not more than num_eval="
                                     f"{cfg.num_eval}; lower data.num_eval or set "
                                     f"data.eval_path")
                train, held = train[: -cfg.num_eval], train[-cfg.num_eval:]
        parts.append(train)
        formats.append(fmt)
    mixed = mix_examples(parts, [e.weight for e in cfg.mix], seed=seed,
                         names=[e.path for e in cfg.mix])
    return mixed, held, "+".join(formats)


def _load_configured(cfg: Any, resolve, *, seed: int):
    """(train, held, format, registry path) of the `DataConfig`'s source (`data.mix` when set),
    paths resolved."""
    if cfg.mix:
        return (*_load_mix(cfg, resolve, seed=seed), "")
    registry = resolve(cfg.registry_path) if cfg.registry_path else ""
    dataset_dir = resolve(cfg.dataset_dir) if cfg.dataset_dir else ""
    train, held, fmt = _load_source(cfg.path if registry else resolve(cfg.path), cfg.format,
                                    seed=seed, num_eval=cfg.num_eval, registry=registry,
                                    dataset_dir=dataset_dir, subset=cfg.subset, split=cfg.split)
    return train, held, fmt, registry


def build_data(cfg: Any, tokenizer: Any, *, micro_batch: int, seed: int,
               base_dir: str | Path | None = None, hf_config: Any = None) -> DataBundle:
    """Read the data of a `DataConfig` and make the training stream and the eval set.

    Args:
        cfg: `lazytrain.config.DataConfig` (path, subset, split, eval_split, format, seq_len,
            packing, eval_path, num_eval, overlong, registry_path, dataset_dir).
        tokenizer: the model's fast HF tokenizer; its `chat_template` is set to the one
            `data.chat_template` chooses (`templates.use_template`), so a saved checkpoint
            keeps it.
        micro_batch: sequences (rows) per micro-batch (`train.micro_batch`).
        seed: `train.seed` (data order; also the embedded dataset's generator seed).
        base_dir: directory that relative data paths resolve against (default: the cwd).
        hf_config: the model's HF config; with packing on, models with recurrent (linear
            attention, Mamba) layers are refused. None: not checked.

    Raises:
        ValueError: packing on a model that cannot isolate packed samples, an unknown format
            or registry entry, a malformed or empty file, a missing column, an unknown subset
            or split, an unknown chat template, or a file that leaves no training examples after holding out `num_eval`.
        FileNotFoundError: a data or registry file does not exist; a Hub dataset that does
            not exist, or is not cached while HF_DATASETS_OFFLINE is set.
        ConnectionError: a Hub dataset while the Hub cannot be reached (not offline mode).
    """
    if cfg.packing:
        check_packing_supported(hf_config)
    resolve = _resolver(base_dir)
    train, held, fmt, registry = _load_configured(cfg, resolve, seed=seed)
    if cfg.eval_path or (cfg.eval_split and not registry):
        held = load_examples(resolve(cfg.eval_path or cfg.path), cfg.format, subset=cfg.subset,
                             split=cfg.eval_split or "train")[: cfg.num_eval]
    elif not held and cfg.num_eval:
        if len(train) <= cfg.num_eval:
            raise ValueError(f"data.num_eval: {cfg.path} has {len(train)} examples, not more "
                             f"than num_eval={cfg.num_eval}; lower data.num_eval or set "
                             f"data.eval_path")
        train, held = train[: -cfg.num_eval], train[-cfg.num_eval:]
    note = use_template(tokenizer, cfg.chat_template, base_dir=base_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("model: the tokenizer has neither a pad nor an eos token to pad with")
    stream = TrainStream(examples=train, tokenizer=tokenizer, micro_batch=micro_batch,
                         seq_len=cfg.seq_len, pad_id=pad_id, seed=seed, overlong=cfg.overlong,
                         packing=cfg.packing)
    return DataBundle(train=stream, eval_examples=tuple(held), source=cfg.path, format=fmt,
                      notes=(note,) if note else ())
