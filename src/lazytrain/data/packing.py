"""Sequence packing: several tokenized samples per `[seq_len]` row, attention kept per sample.

A packed micro-batch is `[micro_batch, seq_len]` like a padded one (the plan was made for that
shape), but each row holds as many whole samples as fit (first fit, in stream order), then a
padding tail. Isolation between the samples of a row comes from the position ids alone, the
convention of HF's padding-free collator (`DataCollatorWithFlattening`):

- `position_ids` restart at 0 at every sample (and at the padding tail);
- there is no `attention_mask` key: HF's mask builders then derive the sequence of each token
  from the position ids (`masking_utils.find_packed_sequence_indices`) and build a
  block-diagonal causal (or sliding-window) mask for sdpa/eager attention, while
  flash-attention kernels take the same position ids as varlen `cu_seqlens` and materialize no
  mask at all (padding-free);
- the first token of every sample has label -100: after the causal shift it would be predicted
  from the previous sample's last token, which the unpacked sample never does.

With these three rules a packed row computes, token for token, the same logits as the samples
run one by one, so the summed loss and its gradients are equal (tests/data/test_packing.py).

Models whose layers keep a recurrent state across positions (Gated DeltaNet, Mamba) would carry
that state from one sample into the next: packing is refused for them (`check_packing_supported`).
Knows nothing about formats or the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from lazytrain.data.tokenize import IGNORE_INDEX, Encoded

PACKABLE_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""HF `layer_types` values whose mask HF derives from packed position ids."""


def check_packing_supported(hf_config: Mapping | object | None) -> None:
    """Refuse packing for a model whose layers cannot be isolated by position ids.

    Args:
        hf_config: the model's HF config (object or dict; a nested `text_config` is read), or
            None when unknown (then nothing is checked).

    Raises:
        ValueError: a layer type other than softmax attention (linear attention, Mamba), naming
            the type and the fix.
    """
    if hf_config is None:
        return
    get = hf_config.get if isinstance(hf_config, Mapping) else (
        lambda k, d=None: getattr(hf_config, k, d))
    text = get("text_config")
    if text is not None:
        return check_packing_supported(text)
    layer_types = set(get("layer_types") or ())
    bad = sorted(layer_types - set(PACKABLE_LAYER_TYPES))
    if bad:
        raise ValueError(f"data.packing: the model has {', '.join(bad)} layers, whose recurrent "
                         f"state would flow from one packed sample into the next; set "
                         f"data.packing=false")


def fill_rows(draw: Callable[[], Encoded], put_back: Callable[[Encoded], None], *,
              rows: int, seq_len: int) -> list[list[Encoded]]:
    """Draw samples into `rows` rows of `seq_len` tokens, first fit, until one fits nowhere.

    Args:
        draw: returns the next sample (each at most `seq_len` tokens).
        put_back: returns a drawn sample to the stream (it comes first in the next batch).
        rows: rows of the micro-batch, >= 1.
        seq_len: tokens per row.

    Returns:
        `rows` lists of samples; every row holds at least one sample.
    """
    packed: list[list[Encoded]] = [[] for _ in range(rows)]
    used = [0] * rows
    while True:
        sample = draw()
        n = len(sample.input_ids)
        assert n <= seq_len, "the stream truncates or skips overlong samples"
        row = next((r for r in range(rows) if used[r] + n <= seq_len), None)
        if row is None:
            put_back(sample)
            return packed
        packed[row].append(sample)
        used[row] += n


def packed_batch(rows: list[list[Encoded]], *, seq_len: int, pad_id: int) -> dict:
    """Tensors of a packed micro-batch.

    Returns:
        `input_ids` [rows, seq_len] int64 (pad_id in the tail); `labels` [rows, seq_len] int64
        (IGNORE_INDEX on each sample's first token and on the tail); `position_ids`
        [rows, seq_len] int64 (0.. per sample, and 0.. over the tail); `token_mask`
        [rows, seq_len] int64 (1 = a sample's token, 0 = tail padding; for counting only, the
        engine does not read it). No `attention_mask` (see the module docstring).
    """
    B = len(rows)
    input_ids = torch.full((B, seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((B, seq_len), IGNORE_INDEX, dtype=torch.int64)
    position_ids = torch.zeros((B, seq_len), dtype=torch.int64)
    token_mask = torch.zeros((B, seq_len), dtype=torch.int64)
    for r, samples in enumerate(rows):
        start = 0
        for sample in samples:
            n = len(sample.input_ids)
            end = start + n
            input_ids[r, start:end] = torch.tensor(sample.input_ids, dtype=torch.int64)
            labels[r, start + 1:end] = torch.tensor(sample.labels[1:], dtype=torch.int64)
            position_ids[r, start:end] = torch.arange(n)
            token_mask[r, start:end] = 1
            start = end
        position_ids[r, start:] = torch.arange(seq_len - start)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
            "token_mask": token_mask}


def real_token_count(batch: Mapping) -> int:
    """Tokens of real samples in a padded or packed micro-batch (padding excluded).

    Args:
        batch: a `pad_batch` (with `attention_mask`) or `packed_batch` (with `token_mask`) dict.
    """
    mask = batch.get("token_mask")
    if mask is None:
        mask = batch["attention_mask"]
    return int(mask.sum())
