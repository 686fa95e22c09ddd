"""Preference data for DPO: records -> `PreferencePair`s -> two-row micro-batches.

Record formats (auto-detected per record; every text rendered with the chat template, as SFT):

| layout | fields | source of the convention |
|---|---|---|
| explicit prompt | `prompt`, `chosen`, `rejected` (each text or a messages list), `system` optional | TRL preference datasets |
| implicit prompt | `chosen`, `rejected` as full conversations sharing the prompt turns | TRL (e.g. Anthropic/hh-rlhf) |
| LlamaFactory ranking, sharegpt | `conversations` (from/value turns), `chosen`, `rejected` (a from/value turn or text), `system` optional | LlamaFactory `data/README.md` |
| LlamaFactory ranking, alpaca | `instruction`, `input` optional, `chosen`, `rejected` (text), `system` optional | LlamaFactory `data/README.md` |

An entry of a LlamaFactory `dataset_info.json` registry with `"ranking": true` is read by
`read_registry_pairs`: `registry.read_ranking_records` maps its columns and tags to the
explicit-prompt layout, and `parse_pair` reads each record as it reads a file's.

`chosen` and `rejected` may be text (one assistant turn), one message (role/content or
from/value) or a list of messages; their assistant turns are trained (their tokens get labels),
the prompt's are not. A record that cannot be read is one error naming the record and the
field. `embedded:arithmetic` makes pairs from the embedded problems (`data.synthetic`): the
worked answer against one with a wrong step.

A micro-batch of P pairs has 2P rows: rows [0, P) the chosen responses, rows [P, 2P) the
rejected ones (`train.dpo`), right-padded to `data.seq_len` (no packing), with `ref_logp` [2P]
fp32 (the reference log-probs, `train.reference`) once they are attached. Knows nothing about
the engine or the reference model.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lazytrain.data.batching import DataCounts, pad_batch
from lazytrain.data.formats import Example, Message, extract_final_answer, normalize_answer
from lazytrain.data.registry import read_ranking_records
from lazytrain.data.sources import load_table
from lazytrain.data.synthetic import arithmetic_problem
from lazytrain.data.tokenize import Encoded, encode

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "system": "system", "observation": "user", "function": "assistant"}
"""ShareGPT `from` / OpenAI `role` values -> roles."""


@dataclass(kw_only=True, frozen=True, slots=True)
class PreferencePair:
    """A prompt and two responses, the first preferred."""

    prompt: tuple[Message, ...]
    """The shared turns before the responses (system, user, earlier assistant turns)."""
    chosen: tuple[Message, ...]
    """The preferred response's turns (assistant turns trained)."""
    rejected: tuple[Message, ...]
    """The dispreferred response's turns."""
    answer: str | None = None
    """The chosen response's final answer (`#### n`), for exact match; None when it has none."""

    def example(self, which: str) -> Example:
        """The conversation prompt + `which` ("chosen" or "rejected") as an `Example`."""
        return Example(messages=self.prompt + getattr(self, which), answer=self.answer)


def _message(turn: Any, *, where: str) -> Message:
    """One role/content or from/value mapping -> a Message (assistant turns trained)."""
    if not isinstance(turn, Mapping):
        raise ValueError(f"{where} must be a message (role/content or from/value); got "
                         f"{type(turn).__name__}")
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if role not in ROLES or not isinstance(content, str):
        raise ValueError(f"{where} needs a role (one of {sorted(ROLES)}) and text content; got "
                         f"keys {sorted(turn)}")
    role = ROLES[role]
    return Message(role=role, content=content, train=role == "assistant")


def _turns(value: Any, *, where: str, response: bool) -> tuple[Message, ...]:
    """Text (a user prompt, or an assistant response when `response`), one message or a list
    of messages -> Messages."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where} is empty")
        role = "assistant" if response else "user"
        return (Message(role=role, content=value.strip(), train=response),)
    if isinstance(value, Mapping):
        return (_message(value, where=where),)
    if isinstance(value, (list, tuple)) and value:
        return tuple(_message(t, where=f"{where}[{k}]") for k, t in enumerate(value))
    raise ValueError(f"{where} must be text, a message or a non-empty list of messages; got "
                     f"{type(value).__name__ if value is not None else 'null'}")


def _prompt_of(record: Mapping, *, where: str) -> tuple[Message, ...] | None:
    """The explicit prompt turns of a record (`prompt`, `conversations`/`messages`,
    `instruction` + `input`), with `system` first; None when the record has none."""
    if record.get("prompt") is not None:
        turns = _turns(record["prompt"], where=f"{where}: `prompt`", response=False)
    elif record.get("conversations") is not None or record.get("messages") is not None:
        key = "conversations" if record.get("conversations") is not None else "messages"
        turns = _turns(record[key], where=f"{where}: `{key}`", response=False)
    elif record.get("instruction") is not None:
        text = str(record["instruction"]).strip()
        if str(record.get("input") or "").strip():
            text = f"{text}\n\n{str(record['input']).strip()}"
        turns = _turns(text, where=f"{where}: `instruction`", response=False)
    else:
        return None
    system = record.get("system")
    if system and not any(m.role == "system" for m in turns):
        turns = (Message(role="system", content=str(system)),) + turns
    return tuple(Message(role=m.role, content=m.content) for m in turns)  # prompt: untrained


def parse_pair(record: Mapping, *, where: str = "record 0") -> PreferencePair:
    """One preference record (module docstring's layouts) -> a `PreferencePair`.

    Raises:
        ValueError: a missing or unreadable field, naming `where` and the field (`chosen`,
            `rejected`, `prompt`, `conversations`, ...), or responses without an assistant turn.
    """
    for key in ("chosen", "rejected"):
        if record.get(key) is None:
            raise ValueError(f"{where}: no `{key}` field (a preference record needs prompt, "
                             f"chosen and rejected); it has {sorted(record)}")
    prompt = _prompt_of(record, where=where)
    chosen = _turns(record["chosen"], where=f"{where}: `chosen`", response=True)
    rejected = _turns(record["rejected"], where=f"{where}: `rejected`", response=True)
    if prompt is None:  # implicit prompt: the turns both conversations share
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise ValueError(f"{where}: no `prompt` (or `conversations`, `instruction`) field, "
                             f"and `chosen` and `rejected` share no prompt turns")
        prompt = tuple(Message(role=m.role, content=m.content) for m in chosen[:n])
        chosen, rejected = chosen[n:], rejected[n:]
    for key, turns in (("chosen", chosen), ("rejected", rejected)):
        if not any(m.train for m in turns):
            raise ValueError(f"{where}: `{key}` has no assistant turn to train on")
    last = [m.content for m in chosen if m.train][-1]
    return PreferencePair(prompt=prompt, chosen=chosen, rejected=rejected,
                          answer=extract_final_answer(last) if "####" in last else None)


def read_pairs(path: str, *, subset: str = "", split: str = "train") -> list[PreferencePair]:
    """Every record of `path` (a file, folder or Hub id: `sources.load_table`) as a pair.

    Raises:
        ValueError: as `parse_pair` (naming the record index), or `sources.load_table`'s.
        FileNotFoundError, ConnectionError: as `sources.load_table`.
    """
    table = load_table(path, subset=subset, split=split)
    return [parse_pair(row, where=f"data: {path} record {k}") for k, row in enumerate(table)]


def read_registry_pairs(registry_path: str, name: str, *,
                        dataset_dir: str | None = None) -> list[PreferencePair]:
    """Every record of the `"ranking": true` entry `name` of a LlamaFactory registry (its first
    `num_samples`) as a pair: `registry.read_ranking_records`, then `parse_pair`.

    Raises:
        ValueError: as `registry.read_ranking_records` (an entry without ranking, a record
            whose columns do not convert) and `parse_pair` (naming the entry and the record).
        FileNotFoundError, ConnectionError: as `sources.load_table`.
    """
    records = read_ranking_records(registry_path, name, dataset_dir=dataset_dir)
    return [parse_pair(row, where=f"data.path: registry entry {name!r} record {k}")
            for k, row in enumerate(records)]


_LINE = re.compile(r"^(-?\d+) ([+-]) (\d+) = (-?\d+)\.$")


def wrong_answer(work: str, rng: random.Random) -> str:
    """A worked arithmetic answer (`data.synthetic`) with one step's result off by 1-3 and the
    later lines and the `#### n` line carried on from it: a plausible, wrong solution."""
    lines = work.split("\n")
    steps = [k for k, line in enumerate(lines) if _LINE.match(line)]
    k0 = rng.choice(steps)
    total = None
    for k in steps:
        a, op, n, r = _LINE.match(lines[k]).groups()
        a = int(a) if total is None or k <= k0 else total
        total = a + int(n) if op == "+" else a - int(n)
        if k == k0:
            total += rng.choice((-3, -2, -1, 1, 2, 3))
        lines[k] = f"{a} {op} {n} = {total}."
    lines[-1] = f"#### {total}"
    return "\n".join(lines)


def arithmetic_pairs(*, num_train: int, num_eval: int, seed: int
                     ) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out) pairs from the embedded problems: the worked answer chosen, a
    `wrong_answer` rejected; no held-out question in train; deterministic by `seed`."""
    def pairs(rng: random.Random, n: int, skip: set[str]) -> list[PreferencePair]:
        out = []
        while len(out) < n:
            ex = arithmetic_problem(rng)
            if ex.messages[0].content in skip:
                continue
            prompt, good = ex.messages[0], ex.messages[1]
            bad = Message(role="assistant", content=wrong_answer(good.content, rng), train=True)
            out.append(PreferencePair(prompt=(prompt,), chosen=(good,), rejected=(bad,),
                                      answer=normalize_answer(ex.answer)))
        return out
    held = pairs(random.Random(f"lazytrain-arithmetic-pairs-eval-{seed}"), num_eval, set())
    skip = {p.prompt[0].content for p in held}
    return pairs(random.Random(f"lazytrain-arithmetic-pairs-train-{seed}"), num_train, skip), held


def encode_pair(tokenizer: Any, pair: PreferencePair, *, seq_len: int, overlong: str
                ) -> tuple[Encoded, Encoded] | None:
    """(chosen, rejected) encodings with the chat template (`tokenize.encode`); None when either
    is skipped (too long with overlong="skip", or no trained token left after truncation)."""
    chosen = encode(tokenizer, pair.example("chosen"), seq_len=seq_len, overlong=overlong)
    rejected = encode(tokenizer, pair.example("rejected"), seq_len=seq_len, overlong=overlong)
    return None if chosen is None or rejected is None else (chosen, rejected)


def encode_pairs(tokenizer: Any, pairs: list[PreferencePair], *, seq_len: int, overlong: str
                 ) -> tuple[list[tuple[Encoded, Encoded] | None], DataCounts]:
    """`encode_pair` of each of `pairs`, in order (None where the pair is dropped), and the
    counts: drawn (every pair), truncated (either response cut), skipped (dropped)."""
    counts, out = DataCounts(drawn=len(pairs)), []
    for pair in pairs:
        enc = encode_pair(tokenizer, pair, seq_len=seq_len, overlong=overlong)
        counts.skipped += int(enc is None)
        counts.truncated += int(enc is not None and any(e.truncated for e in enc))
        out.append(enc)
    return out, counts


def pair_batch(pairs: list[tuple[Encoded, Encoded]], *, seq_len: int, pad_id: int,
               ref_logp: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """P encoded pairs -> one micro-batch of 2P right-padded rows, chosen rows first
    (`batching.pad_batch`: input_ids, labels, attention_mask [2P, seq_len] int64), plus
    `ref_logp` [2P] fp32 (ordered as the rows) when given as [P, 2] (chosen, rejected)."""
    rows = [c for c, _ in pairs] + [r for _, r in pairs]
    batch = pad_batch(rows, seq_len=seq_len, pad_id=pad_id)
    if ref_logp is not None:
        batch["ref_logp"] = torch.cat([ref_logp[:, 0], ref_logp[:, 1]]).float()
    return batch


def pairs_fingerprint(encoded: list[tuple[Encoded, Encoded]]) -> str:
    """sha256 of every pair's token ids and labels, in order: names the exact rows whose
    reference log-probs a cache holds (data, template and seq_len all show in the tokens)."""
    h = hashlib.sha256()
    for pair in encoded:
        for enc in pair:
            h.update(repr((enc.input_ids, enc.labels)).encode())
    return h.hexdigest()


@dataclass(kw_only=True, slots=True)
class PreferenceStream:
    """Endless micro-batches of `micro_batch` pairs, reshuffled each epoch from `seed`,
    resumable (`state_dict`); each batch carries its pairs' reference log-probs once
    `ref_logp` [N, 2] is set."""

    pairs: list[tuple[Encoded, Encoded]]
    """The encoded training pairs (not empty)."""
    micro_batch: int
    """Pairs per micro-batch (`train.micro_batch`): 2 x micro_batch rows."""
    seq_len: int
    pad_id: int
    seed: int
    ref_logp: torch.Tensor | None = None
    """[N, 2] fp32 summed reference log-probs of (chosen, rejected) per pair."""
    reference_key: str | None = None
    """The cache key of `ref_logp` (`train.reference`), saved with the position: a resume
    reads the same table."""
    counts: DataCounts = field(default_factory=DataCounts)
    """What encoding did to the dataset's pairs (drawn, truncated, skipped), for the summary."""
    epoch: int = 0
    position: int = 0
    packing = False  # (as `TrainStream`: `batching.steps_for_epochs` reads it)
    _order: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.pairs:
            raise ValueError("data: no preference pair fits data.seq_len (each chosen and "
                             "rejected response needs a trained token); raise data.seq_len")
        self._order = self._shuffled(self.epoch)

    @property
    def examples(self) -> list[tuple[Encoded, Encoded]]:
        """The pairs (what an epoch passes over: `batching.steps_for_epochs`)."""
        return self.pairs

    def check_usable(self) -> None:
        """Nothing to check: the constructor refused an empty pair list."""

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.pairs)))
        random.Random(f"lazytrain-pairs-{self.seed}-{epoch}").shuffle(order)
        return order

    def next_micro_batch(self) -> dict[str, torch.Tensor]:
        """The next `micro_batch` pairs as `pair_batch` rows (with `ref_logp` when set)."""
        picked = []
        for _ in range(self.micro_batch):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            picked.append(self._order[self.position])
            self.position += 1
        ref = None if self.ref_logp is None else self.ref_logp[picked]
        return pair_batch([self.pairs[k] for k in picked], seq_len=self.seq_len,
                          pad_id=self.pad_id, ref_logp=ref)

    def state_dict(self) -> dict[str, Any]:
        """Position in the data, the data's fingerprint (a resume checks it) and the reference
        table's key."""
        return {"epoch": self.epoch, "position": self.position,
                "fingerprint": pairs_fingerprint(self.pairs), "reference_key": self.reference_key}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` stopped.

        Raises:
            ValueError: the state was saved over other pairs (another fingerprint).
        """
        if state.get("fingerprint") != pairs_fingerprint(self.pairs):
            raise ValueError("--resume: the run's preference pairs differ from this data "
                             "(another data.path, seed, seq_len or chat template)")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.reference_key = state.get("reference_key")
        self._order = self._shuffled(self.epoch)
