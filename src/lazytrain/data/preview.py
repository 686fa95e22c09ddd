"""What training sees of its data, for `lazytrain data`: samples as the model reads them with
the trained tokens marked, and what `data.seq_len` cuts or drops.

Reads `Example`s and a tokenizer through `tokenize.encode`, the function the training stream
uses, so the preview marks exactly the tokens the loss counts. Knows nothing about the CLI or
the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lazytrain.data.batching import DataCounts
from lazytrain.data.formats import Example
from lazytrain.data.tokenize import IGNORE_INDEX, Encoded, encode

TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"
"""Marks around each run of trained tokens (labels that count in the loss) in `marked_text`."""


def marked_text(tokenizer: Any, encoded: Encoded) -> str:
    """The sample's text as the model reads it (template markup included, cut at seq_len),
    each run of trained tokens between `TRAINED_OPEN` and `TRAINED_CLOSE`. Runs are decoded
    whole, so a character split over several byte-level tokens stays intact. Token 0 is never
    predicted (no token before it) and is never marked."""
    runs: list[tuple[bool, list[int]]] = []
    for position, (token, label) in enumerate(zip(encoded.input_ids, encoded.labels)):
        trained = position > 0 and label != IGNORE_INDEX
        if runs and runs[-1][0] == trained:
            runs[-1][1].append(token)
        else:
            runs.append((trained, [token]))
    return "".join(f"{TRAINED_OPEN}{tokenizer.decode(ids)}{TRAINED_CLOSE}" if trained
                   else tokenizer.decode(ids) for trained, ids in runs)


def count_samples(tokenizer: Any, examples: Iterable[Example], *, seq_len: int,
                  overlong: str) -> tuple[DataCounts, int]:
    """What the training stream does with each of `examples` at `seq_len`: (counts of samples
    read, truncated and skipped, as `batching.DataCounts`; trained tokens kept in total)."""
    counts, trained = DataCounts(), 0
    for example in examples:
        counts.drawn += 1
        encoded = encode(tokenizer, example, seq_len=seq_len, overlong=overlong)
        if encoded is None:
            counts.skipped += 1
            continue
        counts.truncated += int(encoded.truncated)
        trained += sum(label != IGNORE_INDEX for label in encoded.labels[1:])
    return counts, trained
