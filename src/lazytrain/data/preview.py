"""What training sees of its data, for `lazytrain data`: samples as the model reads them with
the trained tokens marked, and what `data.seq_len` cuts or drops.

Reads `Example`s and a tokenizer through `tokenize.encode`, the function the training stream
uses, so the preview marks exactly the tokens the loss counts; preference pairs through
`preference.encode_pair` / `encode_pairs`, the DPO trainer's. Knows nothing about the CLI or
the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lazytrain.data.batching import DataCounts
from lazytrain.data.formats import Example
from lazytrain.data.preference import PreferencePair, encode_pair, encode_pairs
from lazytrain.data.tokenize import IGNORE_INDEX, Encoded, encode

TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"
"""Marks around each run of trained tokens (labels that count in the loss) in `marked_text`."""


def marked_text(tokenizer: Any, encoded: Encoded, *, start: int = 0) -> str:
    """The sample's text from token `start` on as the model reads it (template markup
    included, cut at seq_len), each run of trained tokens between `TRAINED_OPEN` and
    `TRAINED_CLOSE`. Runs are decoded whole, so a character split over several byte-level
    tokens stays intact. Token 0 is never predicted (no token before it) and is never
    marked."""
    runs: list[tuple[bool, list[int]]] = []
    for position in range(start, len(encoded.input_ids)):
        token, label = encoded.input_ids[position], encoded.labels[position]
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
        trained += trained_count(encoded)
    return counts, trained


UNCUT = 1 << 30
"""A `seq_len` no sample reaches: `encode` at it gives a sample's whole length."""


def _first_trained(encoded: Encoded) -> int:
    """Position of the first trained token (>= 1); the length when none is trained."""
    return next((k for k in range(1, len(encoded.labels)) if encoded.labels[k] != IGNORE_INDEX),
                len(encoded.labels))


def trained_count(encoded: Encoded) -> int:
    """Tokens of `encoded` that count in the loss (label set, position > 0)."""
    return sum(label != IGNORE_INDEX for label in encoded.labels[1:])


def pair_lines(tokenizer: Any, pair: PreferencePair, *, seq_len: int, overlong: str
               ) -> list[str]:
    """What the DPO trainer makes of `pair` at `seq_len` (`preference.encode_pair`), as lines:
    the rendered prompt (the chosen row's tokens before its first trained one), then per
    response its row's tokens (prompt included) and trained tokens against `seq_len` and its
    text from the first trained token on, trained tokens between `TRAINED_OPEN` and
    `TRAINED_CLOSE`; a dropped pair shows its whole rows and says why."""
    kept = encode_pair(tokenizer, pair, seq_len=seq_len, overlong=overlong)
    whole = encode_pair(tokenizer, pair, seq_len=UNCUT, overlong="truncate")
    if whole is None:  # a response without a trained token: parse_pair refuses it, so rare
        return ["(dropped: a response has no trained token)"]
    shown = kept if kept is not None else whole
    lines = ["prompt: " + tokenizer.decode(list(shown[0].input_ids[:_first_trained(shown[0])]))]
    for name, enc, full in zip(("chosen", "rejected"), shown, whole):
        size = (f"row of {len(full.input_ids)} tokens, {trained_count(full)} trained"
                if not enc.truncated else
                f"row of {len(full.input_ids)} tokens cut to {len(enc.input_ids)}, "
                f"{trained_count(enc)} of {trained_count(full)} trained kept")
        lines.append(f"{name} ({size}; data.seq_len={seq_len}): "
                     f"{marked_text(tokenizer, enc, start=_first_trained(enc))}")
    if kept is None and overlong == "skip":
        over = [f"{n} ({len(f.input_ids)} tokens)" for n, f in zip(("chosen", "rejected"), whole)
                if len(f.input_ids) > seq_len]
        lines.append(f"(dropped: {' and '.join(over)} over data.seq_len={seq_len}, "
                     f"data.overlong=skip)")
    elif kept is None:
        empty = [n for n, f in zip(("chosen", "rejected"), whole) if _first_trained(f) >= seq_len]
        lines.append(f"(dropped: the cut at data.seq_len={seq_len} leaves {' and '.join(empty)} "
                     f"no trained token)")
    return lines


def count_pairs(tokenizer: Any, pairs: list[PreferencePair], *, seq_len: int, overlong: str
                ) -> tuple[DataCounts, int, list[int]]:
    """What `preference.encode_pairs` (the DPO trainer's encoding) does with `pairs` at
    `seq_len`: (counts of pairs read, truncated and dropped; trained tokens kept over both
    responses; indices of the dropped pairs)."""
    encoded, counts = encode_pairs(tokenizer, pairs, seq_len=seq_len, overlong=overlong)
    trained = sum(trained_count(e) for enc in encoded if enc is not None for e in enc)
    return counts, trained, [k for k, enc in enumerate(encoded) if enc is None]
