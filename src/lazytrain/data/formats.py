"""Dataset formats: turn the records of a dataset (`sources.py`) into chat `Example`s.

Owns the column conventions of the supported formats and the final-answer rules used by exact
match. Knows nothing about tokenizers, sequence length or batches (that is `tokenize.py` and
`batching.py`).

Formats (plain dict registry `FORMATS`, read top to bottom):

| name         | required columns         | optional          | source of the convention        |
|--------------|--------------------------|-------------------|---------------------------------|
| `alpaca`     | `instruction`, `output`  | `input`, `system` | tatsu-lab/stanford_alpaca       |
| `gsm8k`      | `question`, `answer`     |                   | openai/grade-school-math        |
| `metamathqa` | `query`, `response`      |                   | meta-math/MetaMathQA            |
| `messages`   | `messages` (role/content)|                   | OpenAI chat format              |
| `sharegpt`   | `conversations` (from/value) |               | ShareGPT / LlamaFactory         |
| `prompt_completion` | `prompt`, `completion` | `system`     | TRL prompt-completion datasets  |
| `text`       | `text`                   |                   | TRL language-modeling datasets  |

`auto` picks the first format whose required columns are all among the dataset's columns
(its `datasets` features; a column absent from a record reads as null there).
Every format becomes a list of `Message`s (user prompt, assistant response with `train=True`),
and multi-turn formats train every assistant turn, not only the last. `prompt_completion` takes
TRL's two kinds: strings (a user prompt and an assistant completion, rendered with the chat
template like alpaca) or lists of role/content messages (conversational; the completion's
turns are trained). `text` is plain text: no chat template, every token trained, the
tokenizer's eos appended (as TRL does); one `Message` of role `TEXT_ROLE` holds it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from lazytrain.data.sources import load_table


@dataclass(kw_only=True, frozen=True, slots=True)
class Message:
    """One chat turn."""

    role: str
    """"system", "user" or "assistant"."""
    content: str
    """The turn's text, without any template markup."""
    train: bool = False
    """True when this turn's tokens count in the loss (assistant turns); prompt turns are masked."""


TEXT_ROLE = "text"
"""Role of the one message of a plain-text example (format `text`): no template, all trained."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Example:
    """One training or evaluation sample, format-independent."""

    messages: tuple[Message, ...]
    """The conversation; turns with `train=True` are the targets."""
    answer: str | None = None
    """Normalized final answer for exact match (GSM8K `#### n`, MetaMathQA `The answer is:`),
    or None when the format has no checkable answer (alpaca)."""

    @property
    def is_text(self) -> bool:
        """True for a plain-text example (format `text`: rendered without a template)."""
        return len(self.messages) == 1 and self.messages[0].role == TEXT_ROLE

    @property
    def prompt_messages(self) -> tuple[Message, ...]:
        """The turns before the last trained turn: what generation is conditioned on."""
        last = max(i for i, m in enumerate(self.messages) if m.train)
        return self.messages[:last]


_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalize_answer(text: str) -> str:
    """Canonical form of a final answer: no `$`, thousands commas, trailing `.` or spaces;
    numbers as the shortest decimal string ("72.0" -> "72")."""
    text = text.strip().replace("$", "").replace(",", "").rstrip(".").strip()
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() else repr(value)


def extract_final_answer(text: str) -> str | None:
    """Final answer of a worked solution, normalized; None when there is none.

    Rules, first that applies: the text after the last `####` (GSM8K); after the last
    `The answer is:` (MetaMathQA); otherwise the last number in the text (so a model that has
    not learned the `####` convention yet can still be scored).
    """
    for marker in ("####", "The answer is:"):
        if marker in text:
            tail = text.rsplit(marker, 1)[1].strip().splitlines()
            return normalize_answer(tail[0]) if tail and tail[0].strip() else None
    numbers = _NUMBER_RE.findall(text)
    return normalize_answer(numbers[-1]) if numbers else None


def _single_turn(prompt: str, response: str, *, system: str | None = None,
                 answer: str | None = None) -> Example:
    messages = [] if not system else [Message(role="system", content=system)]
    messages.append(Message(role="user", content=prompt))
    messages.append(Message(role="assistant", content=response, train=True))
    return Example(messages=tuple(messages), answer=answer)


def _alpaca(row: Mapping) -> Example:
    prompt = row["instruction"].strip()
    if str(row.get("input") or "").strip():
        prompt = f"{prompt}\n\n{row['input'].strip()}"
    return _single_turn(prompt, row["output"].strip(), system=row.get("system") or None)


def _gsm8k(row: Mapping) -> Example:
    # The `<<48/2=24>>` calculator annotations are tool calls, not text a model should learn.
    response = _CALCULATOR_RE.sub("", row["answer"]).strip()
    return _single_turn(row["question"].strip(), response,
                        answer=extract_final_answer(row["answer"]))


def _metamathqa(row: Mapping) -> Example:
    response = row["response"].strip()
    return _single_turn(row["query"].strip(), response, answer=extract_final_answer(response))


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system"}


def _turns(pairs: list[tuple[str, str]]) -> Example:
    messages = tuple(Message(role=role, content=content, train=role == "assistant")
                     for role, content in pairs)
    if not any(m.train for m in messages):
        raise ValueError("the conversation has no assistant turn to train on")
    last = [m.content for m in messages if m.train][-1]
    return Example(messages=messages, answer=None if "####" not in last
                   else extract_final_answer(last))


def _string(value, what: str) -> str:
    """`value` as text (a number as its digits); a list or mapping (OpenAI-style content
    parts, a nested column) would be trained on as its Python repr, so it is refused.

    Raises:
        ValueError: `value` is a list or a mapping (names `what` and its type).
    """
    if isinstance(value, (list, tuple, dict)):
        raise ValueError(f"{what} is a {type(value).__name__}, not a string; give it as text")
    return str(value)


def _messages(row: Mapping) -> Example:
    return _turns([(_string(t["role"], "a role"), _string(t["content"], "a message's content"))
                   for t in row["messages"]])


def _sharegpt(row: Mapping) -> Example:
    return _turns([(_SHAREGPT_ROLES[str(t["from"])], _string(t["value"], "a turn's value"))
                   for t in row["conversations"]])


def _prompt_completion(row: Mapping) -> Example:
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return _single_turn(prompt.strip(), completion.strip(), system=row.get("system") or None,
                            answer=extract_final_answer(completion) if "####" in completion
                            else None)
    if isinstance(prompt, str) or isinstance(completion, str):
        raise ValueError("prompt and completion must both be strings or both message lists")
    turns = [(_string(t["role"], "a role"), _string(t["content"], "a message's content"),
              False) for t in prompt]
    turns += [(_string(t["role"], "a role"), _string(t["content"], "a message's content"),
               t["role"] == "assistant") for t in completion]
    if not any(train for _, _, train in turns):
        raise ValueError("the completion has no assistant turn to train on")
    return Example(messages=tuple(Message(role=r, content=c, train=t) for r, c, t in turns))


def _text(row: Mapping) -> Example:
    text = _string(row["text"], "the text")
    if not text.strip():
        raise ValueError("the text is empty")
    return Example(messages=(Message(role=TEXT_ROLE, content=text, train=True),))


@dataclass(kw_only=True, frozen=True, slots=True)
class FormatSpec:
    """How one file format maps to `Example`s."""

    required: tuple[str, ...]
    """Columns every record must have (non-null)."""
    convert: Callable[[Mapping], Example]
    """Record -> Example, called after the columns were checked."""


FORMATS: dict[str, FormatSpec] = {
    "alpaca": FormatSpec(required=("instruction", "output"), convert=_alpaca),
    "gsm8k": FormatSpec(required=("question", "answer"), convert=_gsm8k),
    "metamathqa": FormatSpec(required=("query", "response"), convert=_metamathqa),
    "messages": FormatSpec(required=("messages",), convert=_messages),
    "sharegpt": FormatSpec(required=("conversations",), convert=_sharegpt),
    "prompt_completion": FormatSpec(required=("prompt", "completion"),
                                    convert=_prompt_completion),
    "text": FormatSpec(required=("text",), convert=_text),
}


def detect_format(columns: Iterable[str], *, path: str | Path = "<data>") -> str:
    """The first format in `FORMATS` whose required columns are all among `columns` (the
    dataset's column names, from its `datasets` features; a record dict works too).

    Raises:
        ValueError: when no format matches, listing the columns and each format's.
    """
    columns = list(columns)
    for name, spec in FORMATS.items():
        if all(col in columns for col in spec.required):
            return name
    known = "; ".join(f"{n}: {', '.join(s.required)}" for n, s in FORMATS.items())
    raise ValueError(f"data.format: cannot detect the format of {path} from columns "
                     f"{sorted(columns)}; known formats ({known}); set data.format")


def load_examples(path: str | Path, fmt: str = "auto", *, subset: str = "",
                  split: str = "train") -> list[Example]:
    """Read `path` and convert every record with format `fmt` ("auto" = detect).

    Same as `read_dataset(path, fmt, subset=subset, split=split)[0]`.
    """
    return read_dataset(path, fmt, subset=subset, split=split)[0]


def read_dataset(path: str | Path, fmt: str = "auto", *, subset: str = "",
                 split: str = "train") -> tuple[list[Example], str]:
    """Read `path` (a file, folder or Hub id: `sources.load_table`) and convert every record
    with format `fmt` ("auto" = detect from the column names).

    Returns:
        (examples, the format name used).

    Raises:
        ValueError: unknown format; a record missing a required column, or with a value there
            the format cannot read (naming the record index, the column and the columns it
            has); see also `sources.load_table` (unreadable file, no records, bad split).
        FileNotFoundError, ConnectionError: see `sources.load_table`.
    """
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"data.format: unknown format {fmt!r}; choose one of "
                         f"{['auto', *FORMATS]}")
    table = load_table(path, subset=subset, split=split)
    if fmt == "auto":
        fmt = detect_format(table.column_names, path=path)
    spec = FORMATS[fmt]
    missing = [col for col in spec.required if col not in table.column_names]
    if missing:
        raise ValueError(f"data.path: {path}: column {missing[0]!r} is missing (format {fmt!r} "
                         f"needs {list(spec.required)}; the data has {sorted(table.column_names)})"
                         f"; set data.format or fix the file")
    examples = []
    for index, record in enumerate(table):
        where = f"data.path: {path} record {index}"
        for col in spec.required:
            if record.get(col) is None:
                present = sorted(k for k, v in record.items() if v is not None)
                raise ValueError(f"{where}: column {col!r} is missing (format {fmt!r} needs "
                                 f"{list(spec.required)}; the record has {present})")
        try:
            examples.append(spec.convert(record))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"{where}: cannot read it as {fmt!r} ({type(exc).__name__}: "
                             f"{exc})") from None
    return examples, fmt
