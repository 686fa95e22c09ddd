"""DPO's reference log-probs: computed once from the initial weights by a streamed forward pass,
cached in the run directory, so no reference model is ever held.

Every pair's chosen and rejected rows are scored with `evaluation.streamed_lm.StreamedLM
.token_logprobs` (forward only, through the engine's weight path, in the compute dtype) before
the first optimizer step; a row's reference log-prob is the sum of log p(token) over its
trained tokens, as the head sums the policy's (`train.dpo`). The table [N, 2] fp32 is written
atomically to `<run_dir>/reference_logps/<key>.pt`, the key a sha256 of the data fingerprint
(every row's token ids and labels: data, seq_len and template), the model hash (config and the
initial masters' bytes) and the chat template, so a resumed run, or a second run on the same
data and model, reads it back, and any change misses the cache.

Legend: N = pairs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

import torch
import xxhash

from lazytrain.atomic import atomic_path
from lazytrain.contract import IGNORE_INDEX
from lazytrain.data.tokenize import Encoded

CACHE_DIR = "reference_logps"
"""Folder of the cached tables inside the run directory."""


def cache_path(run_dir: str | Path, key: str) -> Path:
    """Where the table of `key` is cached: `<run_dir>/reference_logps/<key>.pt`."""
    return Path(run_dir) / CACHE_DIR / f"{key}.pt"


def model_hash(adapter) -> str:
    """xxh3-128 of the model's HF config hash and every host master's bytes (blocks, then the
    ends), hex: names the initial weights the reference log-probs come from."""
    h = xxhash.xxh3_128()
    h.update(str(adapter.hf_config_sha256).encode())
    for group in adapter.params.groups:
        h.update(group.master.detach().contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def reference_key(*, data_fingerprint: str, model: str, template: str) -> str:
    """sha256 (hex) naming one cache entry: the pairs' fingerprint
    (`data.preference.pairs_fingerprint`), `model_hash` and the chat template's text."""
    return hashlib.sha256("\n".join((data_fingerprint, model, template)).encode()).hexdigest()


def row_logps(token_logprobs: Callable[[list[list[int]]], list[torch.Tensor]],
              rows: list[Encoded]) -> torch.Tensor:
    """[len(rows)] fp32: per row, the sum of log p(input_ids[t] | input_ids[:t]) over the t
    whose label is not IGNORE_INDEX (t >= 1).

    Args:
        token_logprobs: `StreamedLM.token_logprobs` or one with its contract (per sequence of n
            tokens, [n - 1] fp32 log-probs of tokens 1..n-1).
        rows: the encoded rows.
    """
    scored = token_logprobs([list(r.input_ids) for r in rows])
    out = torch.empty(len(rows), dtype=torch.float32)
    for k, (row, lp) in enumerate(zip(rows, scored)):
        trained = torch.tensor(row.labels[1:]) != IGNORE_INDEX
        out[k] = lp.float()[trained].sum()
    return out


def reference_logps(pairs: list[tuple[Encoded, Encoded]], *,
                    token_logprobs: Callable[[list[list[int]]], list[torch.Tensor]],
                    run_dir: Path | None, key: str, log: Callable[[str], None] = print
                    ) -> torch.Tensor:
    """[N, 2] fp32 reference log-probs of (chosen, rejected) per pair: read from
    `<run_dir>/reference_logps/<key>.pt` when there (a hit), else computed with `row_logps`
    and written there atomically (a miss). `run_dir` None: computed, never cached.

    Raises:
        ValueError: a cached table of another shape than the pairs (a damaged entry).
        OSError: the cache cannot be written (names the file).
    """
    path = None if run_dir is None else cache_path(run_dir, key)
    if path is not None and path.is_file():
        table = torch.load(path, weights_only=True)
        if not isinstance(table, torch.Tensor) or tuple(table.shape) != (len(pairs), 2):
            raise ValueError(f"{path}: a reference log-prob table of shape "
                             f"{getattr(table, 'shape', None)}, not ({len(pairs)}, 2); delete "
                             f"the file to recompute it")
        log(f"reference log-probs: read {path} ({len(pairs)} pairs)")
        return table
    rows = [c for c, _ in pairs] + [r for _, r in pairs]
    flat = row_logps(token_logprobs, rows)
    table = torch.stack([flat[: len(pairs)], flat[len(pairs):]], dim=1).contiguous()
    if path is not None:
        with atomic_path(path) as tmp:
            torch.save(table, tmp)
        log(f"reference log-probs: {len(pairs)} pairs scored with the initial weights, "
            f"cached in {path}")
    return table
