"""Tokenization with loss masking: chat `Example` -> token ids + labels of at most `seq_len`.

Every conversation is rendered with a chat template (`templates.py`: the tokenizer's own, a
configured one, or chatml when the tokenizer has none), through the tokenizer's
`apply_chat_template`. Which tokens are trained:

- a template that marks assistant text with `{% generation %}` (the named templates): the
  `assistant_masks` of `apply_chat_template(..., return_assistant_tokens_mask=True)`;
- a plain-text example (format `text`): no template; every token is trained;
- any other template (e.g. a model's own): decided on the rendered text. For every trained turn
  i, the template renders `messages[:i]` with the generation prompt (the prompt prefix) and
  `messages[:i+1]` (the prefix through the end of that turn); the characters between the two
  are the target. The whole text is tokenized once, with offsets, and a token is trained when
  its characters overlap a target span. That is exact even where a BPE merge crosses the
  prompt/target boundary (the merged token is one the model must predict).

Both need a fast (Rust `tokenizers`) tokenizer for the offsets. Labels follow the HF causal-LM
convention: `labels[t]` is the token at position t (or `contract.IGNORE_INDEX`, -100), and the model shifts by one
inside the loss. Knows nothing about batches or the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lazytrain.contract import IGNORE_INDEX
from lazytrain.data.formats import TEXT_ROLE, Example, Message
from lazytrain.data.templates import has_generation_marker, template_of


@dataclass(kw_only=True, frozen=True, slots=True)
class Encoded:
    """One tokenized sample."""

    input_ids: tuple[int, ...]
    """Token ids, length <= seq_len."""
    labels: tuple[int, ...]
    """Same length; IGNORE_INDEX on prompt and template tokens."""
    truncated: bool = False
    """True when the sample was longer than seq_len and cut."""


def _as_dicts(messages: tuple[Message, ...]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def render(tokenizer: Any, messages: tuple[Message, ...], *, add_generation_prompt: bool) -> str:
    """The text of `messages` as the model sees it: `apply_chat_template(..., tokenize=False)`
    with `templates.template_of(tokenizer)` (the tokenizer's template, else chatml); a
    plain-text example (one `TEXT_ROLE` message) is its text and the eos token."""
    if len(messages) == 1 and messages[0].role == TEXT_ROLE:
        return messages[0].content + (tokenizer.eos_token or "")
    return tokenizer.apply_chat_template(_as_dicts(messages), chat_template=template_of(tokenizer),
                                         tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def target_spans(tokenizer: Any, example: Example) -> tuple[str, list[tuple[int, int]]]:
    """The full text and the [start, end) character spans of its trained turns.

    Raises:
        ValueError: when the chat template does not render a conversation as an extension of
            its prefix (then prompt masking by prefix is impossible), naming the turn.
    """
    spans = []
    full = render(tokenizer, example.messages, add_generation_prompt=False)
    for i, message in enumerate(example.messages):
        if not message.train:
            continue
        prompt = render(tokenizer, example.messages[:i], add_generation_prompt=True)
        through = render(tokenizer, example.messages[: i + 1], add_generation_prompt=False)
        if not (through.startswith(prompt) and full.startswith(through)):
            raise ValueError(f"data: the tokenizer's chat template does not render turn {i} "
                             f"as a continuation of the turns before it; prompt masking needs "
                             f"a prefix-stable template")
        spans.append((len(prompt), len(through)))
    return full, spans


def _overlaps(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    """True when the token's characters [start, end) touch a target span.

    Overlap, not containment: a BPE token such as " 27" may begin with the prompt's last space
    and still be the first token the model must predict.
    """
    if start == end:
        return any(a <= start < b for a, b in spans)
    return any(start < b and end > a for a, b in spans)


def _trains_assistant_turns(example: Example) -> bool:
    """True when exactly the assistant turns are trained (what an assistant mask selects)."""
    return all(m.train == (m.role == "assistant") for m in example.messages)


def _ids_and_labels(tokenizer: Any, example: Example) -> tuple[list[int], list[int]]:
    """Full-length ids and labels: from the template's assistant mask when it has
    `{% generation %}` markers, else from the rendered prefixes (module docstring)."""
    if example.is_text:  # no template: every token, the appended eos included, is trained
        ids = list(tokenizer(render(tokenizer, example.messages, add_generation_prompt=False),
                             add_special_tokens=False)["input_ids"])
        return ids, list(ids)
    template = template_of(tokenizer)
    if has_generation_marker(template) and _trains_assistant_turns(example):
        out = tokenizer.apply_chat_template(_as_dicts(example.messages), chat_template=template,
                                            tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids = list(out["input_ids"])
        return ids, [tok if keep else IGNORE_INDEX for tok, keep in
                     zip(ids, out["assistant_masks"])]
    full, spans = target_spans(tokenizer, example)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    return ids, [tok if _overlaps(start, end, spans) else IGNORE_INDEX
                 for tok, (start, end) in zip(ids, enc["offset_mapping"])]


def encode(tokenizer: Any, example: Example, *, seq_len: int, overlong: str) -> Encoded | None:
    """Token ids and loss labels of `example`, or None when it must be skipped.

    Args:
        tokenizer: a fast HF tokenizer (offsets are needed).
        example: the conversation.
        seq_len: maximum tokens, >= 2.
        overlong: "truncate" (keep the first seq_len tokens) or "skip" (return None).

    Returns:
        The encoding; None when too long with overlong="skip", or when truncation left no
        trained token (nothing to learn from it).
    """
    ids, labels = _ids_and_labels(tokenizer, example)
    truncated = len(ids) > seq_len
    if truncated:
        if overlong == "skip":
            return None
        ids, labels = ids[:seq_len], labels[:seq_len]
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return None  # label 0 is never predicted (no token before it)
    return Encoded(input_ids=tuple(ids), labels=tuple(labels), truncated=truncated)


def encode_prompt(tokenizer: Any, example: Example) -> list[int]:
    """Token ids of the prompt of `example` (the turns before its last trained turn) plus the
    generation prompt: what greedy generation for exact match starts from."""
    text = render(tokenizer, example.prompt_messages, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
