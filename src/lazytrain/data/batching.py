"""Micro-batches: a deterministic, resumable stream of padded `[batch, seq_len]` tensors.

Samples are encoded lazily as the stream reaches them (a 395K-row MetaMathQA file costs no
start-up time), in an order that is a pure function of (seed, epoch), so the position
`(epoch, cursor)` is the whole data state a checkpoint needs. Every batch is padded on the right
to exactly `seq_len` (the plan was made for that shape); with causal attention and right
padding, real tokens never attend to padding, and padding carries label -100.

With `packing=True` each row holds several whole samples instead (`packing.py`: per-sample
position ids, no cross-attention); a sample that fits no row of this batch is put back and
opens the next one, so the position stays `(epoch, cursor)`. Knows nothing about the model.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from lazytrain.data.formats import Example
from lazytrain.data.packing import fill_rows, packed_batch
from lazytrain.data.tokenize import IGNORE_INDEX, Encoded, encode


@dataclass(kw_only=True, slots=True)
class DataCounts:
    """What happened to the samples the stream has drawn so far (for the run summary)."""

    drawn: int = 0
    """Samples read from the dataset (including skipped ones)."""
    truncated: int = 0
    """Samples longer than seq_len that were cut (overlong="truncate")."""
    skipped: int = 0
    """Samples dropped: longer than seq_len with overlong="skip", or no trained token left."""

    def to_dict(self) -> dict[str, int]:
        return {"drawn": self.drawn, "truncated": self.truncated, "skipped": self.skipped}

    def line(self, *, seq_len: int, overlong: str) -> str:
        """The run log's line: "data: 24 samples drawn, 24 truncated to data.seq_len=64 (...)
        , 0 skipped", with the fix when a sample was cut or dropped."""
        text = (f"data: {self.drawn} samples drawn, {self.truncated} truncated to "
                f"data.seq_len={seq_len}, {self.skipped} skipped")
        if self.truncated:
            text += ("; the truncated samples lost their tail: raise data.seq_len, or set "
                     "data.overlong=skip to drop them")
        elif self.skipped and overlong == "skip":
            text += "; raise data.seq_len to train on the skipped samples"
        return text


def pad_batch(samples: list[Encoded], *, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Stack encodings into one right-padded micro-batch.

    Returns:
        `input_ids` [batch, seq_len] int64 (pad_id after each sample), `labels` [batch, seq_len]
        int64 (IGNORE_INDEX on padding), `attention_mask` [batch, seq_len] int64 (1 = real).
    """
    batch = len(samples)
    input_ids = torch.full((batch, seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((batch, seq_len), IGNORE_INDEX, dtype=torch.int64)
    attention_mask = torch.zeros((batch, seq_len), dtype=torch.int64)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = torch.tensor(sample.input_ids, dtype=torch.int64)
        labels[row, :n] = torch.tensor(sample.labels, dtype=torch.int64)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


@dataclass(kw_only=True, slots=True)
class TrainStream:
    """Endless micro-batches over `examples`, reshuffled each epoch, resumable bit for bit."""

    examples: list[Example]
    """The training set (not empty)."""
    tokenizer: Any
    """A fast HF tokenizer (see `tokenize.encode`)."""
    micro_batch: int
    """Samples per micro-batch, >= 1."""
    seq_len: int
    """Row length in tokens."""
    pad_id: int
    """Token id used for padding (its label is always IGNORE_INDEX)."""
    seed: int
    """Data-order seed (`train.seed`)."""
    overlong: str = "truncate"
    """"truncate" or "skip" (see `tokenize.encode`)."""
    epoch: int = 0
    """Current pass over the data."""
    cursor: int = 0
    """Next index into this epoch's order."""
    counts: DataCounts = field(default_factory=DataCounts)
    """Running counts of drawn / truncated / skipped samples."""
    packing: bool = False
    """Pack several samples per row (`packing.py`) instead of one padded sample per row."""
    _order_cache: tuple[int, list[int]] | None = field(default=None, init=False, repr=False)
    _ahead: tuple | None = field(default=None, init=False, repr=False)
    """A put-back sample: ((epoch, cursor) it starts at, (epoch, cursor, counts) after it,
    the encoding), so drawing it again costs no re-encoding."""

    def _order(self, epoch: int) -> list[int]:
        """This epoch's sample order (cached: a shuffle is O(n))."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            # A string seed gives the same order on every platform and ignores global RNG state.
            order = list(range(len(self.examples)))
            random.Random(f"lazytrain-data-{self.seed}-{epoch}").shuffle(order)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _next_sample(self) -> Encoded:
        """The next usable encoding, advancing (epoch, cursor).

        Raises:
            ValueError: when a whole epoch yields no usable sample (all too long or empty).
        """
        if self._ahead is not None and self._ahead[0] == (self.epoch, self.cursor):
            _, (self.epoch, self.cursor, counts), sample = self._ahead
            self.counts, self._ahead = DataCounts(**counts), None
            return sample
        misses = 0
        while True:
            if self.cursor >= len(self.examples):
                self.epoch, self.cursor = self.epoch + 1, 0
            index = self._order(self.epoch)[self.cursor]
            self.cursor += 1
            self.counts.drawn += 1
            sample = encode(self.tokenizer, self.examples[index], seq_len=self.seq_len,
                            overlong=self.overlong)
            if sample is not None:
                self.counts.truncated += int(sample.truncated)
                return sample
            self.counts.skipped += 1
            misses += 1
            if misses >= len(self.examples):
                why = ("no sample keeps a trained (answer) token within it: the prompt and "
                       "the chat template fill it; raise data.seq_len"
                       if self.overlong == "truncate" else
                       "every sample is longer; raise data.seq_len or set "
                       "data.overlong=truncate")
                raise ValueError(f"data: no sample fits data.seq_len={self.seq_len} "
                                 f"(data.overlong={self.overlong!r}): {why}")

    def check_usable(self) -> None:
        """Draw one sample and put the stream back as it was (position, counts): data of which
        no sample fits `seq_len` is refused when this is called (before a run writes a file),
        not at the first step.

        Raises:
            ValueError: as `_next_sample`: a whole epoch yields no usable sample.
        """
        saved = (self.epoch, self.cursor, self.counts.to_dict(), self._ahead)
        try:
            self._next_sample()
        finally:
            self.epoch, self.cursor, counts, self._ahead = saved
            self.counts = DataCounts(**counts)

    def next_micro_batch(self) -> dict[str, torch.Tensor]:
        """The next `[micro_batch, seq_len]` batch (`pad_batch`, or `packing.packed_batch`)."""
        if self.packing:
            return self._next_packed()
        samples = [self._next_sample() for _ in range(self.micro_batch)]
        return pad_batch(samples, seq_len=self.seq_len, pad_id=self.pad_id)

    def _next_packed(self) -> dict[str, torch.Tensor]:
        """First-fit packing of the next samples; the one that fits no row is put back."""
        marks: list[tuple] = []

        def draw() -> Encoded:
            marks.append((self.epoch, self.cursor, self.counts.to_dict()))
            return self._next_sample()

        def put_back(sample: Encoded) -> None:
            epoch, cursor, counts = marks[-1]
            self._ahead = ((epoch, cursor), (self.epoch, self.cursor, self.counts.to_dict()),
                           sample)
            self.epoch, self.cursor, self.counts = epoch, cursor, DataCounts(**counts)

        rows = fill_rows(draw, put_back, rows=self.micro_batch, seq_len=self.seq_len)
        return packed_batch(rows, seq_len=self.seq_len, pad_id=self.pad_id)

    def state_dict(self) -> dict[str, Any]:
        """Position and counts; with the same examples and seed this restores the stream."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "num_examples": len(self.examples), "counts": self.counts.to_dict(),
                "fingerprint": self.fingerprint()}

    def fingerprint(self) -> str:
        """sha256 (16 hex) of every example's turns (role, text, trained) and answer, in order:
        other data of the same size has another fingerprint."""
        h = hashlib.sha256()
        for ex in self.examples:
            for m in ex.messages:
                h.update(f"{m.role}\0{m.content}\0{int(m.train)}\1".encode())
            h.update(f"{ex.answer}\2".encode())
        return h.hexdigest()[:16]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`.

        Raises:
            ValueError: when the dataset size, its fingerprint (`fingerprint`) or the seed
                differs from the saved one (resuming on different data would not continue the
                same run).
        """
        if state["num_examples"] != len(self.examples) or state["seed"] != self.seed:
            raise ValueError(f"data: checkpoint was made on {state['num_examples']} samples with "
                             f"seed {state['seed']}; this run has {len(self.examples)} samples "
                             f"with seed {self.seed}; resume with the same data and train.seed")
        saved = state.get("fingerprint")  # absent in checkpoints written before it
        if saved is not None and saved != self.fingerprint():
            raise ValueError(f"data: checkpoint was made on other data of the same size "
                             f"({state['num_examples']} samples, fingerprint {saved}; this run's "
                             f"is {self.fingerprint()}); resume with the run's data (data.path or "
                             f"data.mix, as it was)")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.counts = DataCounts(**state["counts"])
        self._ahead = None


def steps_for_epochs(stream: TrainStream, *, epochs: float, micro_batches_per_step: int) -> int:
    """Optimizer steps that draw `epochs` passes over the stream's examples, >= 1.

    Padded rows: ceil(epochs * N / (micro_batch * micro_batches_per_step)), N the number of
    examples (a skipped sample counts as drawn). Packed rows hold a varying number of samples,
    so a fresh copy of the stream is packed until it has drawn epochs * N samples (every
    sample is tokenized once per epoch for that count).

    Args:
        stream: the training stream (its position is not changed).
        epochs: passes over the data, > 0 (fractions allowed).
        micro_batches_per_step: micro-batches one optimizer step draws (grad_accum, times the
            world size under data parallelism).
    """
    n = len(stream.examples)
    target = epochs * n
    if not stream.packing:
        return max(1, math.ceil(target / (stream.micro_batch * micro_batches_per_step)))
    dry = TrainStream(examples=stream.examples, tokenizer=stream.tokenizer,
                      micro_batch=stream.micro_batch, seq_len=stream.seq_len,
                      pad_id=stream.pad_id, seed=stream.seed, overlong=stream.overlong,
                      packing=True)
    micro_batches = 0
    while dry.epoch * n + dry.cursor < target:
        dry.next_micro_batch()
        micro_batches += 1
    return max(1, math.ceil(micro_batches / micro_batches_per_step))
