"""Datasets for training: formats, tokenization with prompt masking, padded micro-batches.

`build_data(data_cfg, tokenizer, ...)` is the one entry point `train/` uses: it reads the
configured source (a JSON/JSONL file in one of `formats.FORMATS`, or `embedded:arithmetic`,
the project's own generated problems), splits off the held-out evaluation examples and returns
a resumable `TrainStream`. Knows nothing about the model or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lazytrain.data.batching import DataCounts, TrainStream, pad_batch
from lazytrain.data.formats import (FORMATS, Example, Message, extract_final_answer,
                                    load_examples, normalize_answer, read_dataset)
from lazytrain.data.synthetic import arithmetic_dataset
from lazytrain.data.tokenize import IGNORE_INDEX, Encoded, encode, encode_prompt, render

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_TRAIN_SIZE = 2048
"""Training problems generated for `embedded:arithmetic` (more than the default job draws)."""

__all__ = ["DataBundle", "DataCounts", "EMBEDDED_PREFIX", "Encoded", "Example", "FORMATS",
           "IGNORE_INDEX", "Message", "TrainStream", "build_data", "encode", "encode_prompt",
           "extract_final_answer", "load_examples", "normalize_answer", "pad_batch", "render"]


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


def _load_source(path: str, fmt: str, *, seed: int, num_eval: int) -> tuple[list[Example],
                                                                            list[Example], str]:
    """(train, eval, format) for a data path; eval is the file's tail when no eval file."""
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
    examples, resolved = read_dataset(path, fmt)
    return examples, [], resolved


def build_data(cfg: Any, tokenizer: Any, *, micro_batch: int, seed: int,
               base_dir: str | Path | None = None) -> DataBundle:
    """Read the data of a `DataConfig` and make the training stream and the eval set.

    Args:
        cfg: `lazytrain.config.DataConfig` (path, format, seq_len, packing, eval_path,
            num_eval, overlong, registry_path).
        tokenizer: the model's fast HF tokenizer.
        micro_batch: sequences per micro-batch (`train.micro_batch`).
        seed: `train.seed` (data order; also the embedded dataset's generator seed).
        base_dir: directory that relative data paths resolve against (default: the cwd).

    Raises:
        ValueError: packing or a registry requested (not implemented yet), an unknown format,
            a malformed or empty file, a missing column, or a file that leaves no training
            examples after holding out `num_eval`.
        FileNotFoundError: a data file does not exist.
    """
    if cfg.packing:
        raise ValueError("data.packing: packing is not implemented yet (needs per-sequence "
                         "attention isolation in the engine); set data.packing=false")
    if cfg.registry_path:
        raise ValueError("data.registry_path: dataset registries are not implemented yet; "
                         "give the dataset file in data.path")
    base = Path(base_dir) if base_dir is not None else Path.cwd()

    def resolve(p: str) -> str:
        return p if p.startswith(EMBEDDED_PREFIX) or Path(p).is_absolute() else str(base / p)

    train, held, fmt = _load_source(resolve(cfg.path), cfg.format, seed=seed,
                                    num_eval=cfg.num_eval)
    if cfg.eval_path:
        held = load_examples(resolve(cfg.eval_path), cfg.format)[: cfg.num_eval]
    elif not held and cfg.num_eval:
        if len(train) <= cfg.num_eval:
            raise ValueError(f"data.num_eval: {cfg.path} has {len(train)} examples, not more "
                             f"than num_eval={cfg.num_eval}; lower data.num_eval or set "
                             f"data.eval_path")
        train, held = train[: -cfg.num_eval], train[-cfg.num_eval:]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("model: the tokenizer has neither a pad nor an eos token to pad with")
    stream = TrainStream(examples=train, tokenizer=tokenizer, micro_batch=micro_batch,
                         seq_len=cfg.seq_len, pad_id=pad_id, seed=seed, overlong=cfg.overlong)
    return DataBundle(train=stream, eval_examples=tuple(held), source=cfg.path, format=fmt)
