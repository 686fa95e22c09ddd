"""Text in, text out over a `StreamedLM` (`lazytrain generate`): prompts rendered with the
checkpoint's chat template, generation stopped at stop strings, completions cut before them.

Knows nothing of the engine: it drives `StreamedLM.generate` (token ids in, token ids out) and
the checkpoint's HF tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lazytrain.evaluation.streamed_lm import StreamedLM


def prompt_ids(tokenizer: Any, text: str, *, chat: bool) -> list[int]:
    """Token ids of `text`: as one user turn rendered with the tokenizer's chat template and
    the assistant's turn opened (`chat`), else the text as it is (the tokenizer's own special
    tokens added, as a plain `encode`).

    Raises:
        ValueError: `chat` and the tokenizer has no chat template.
    """
    if not chat:
        return tokenizer.encode(text)
    if not tokenizer.chat_template:
        raise ValueError(f"{tokenizer.name_or_path}: the checkpoint's tokenizer has no chat "
                         "template; pass --raw to send the prompt as plain text")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    # the template writes its own BOS where the model wants one: encode without adding more
    return tokenizer.encode(rendered, add_special_tokens=False)


def stop_on(tokenizer: Any, stops: Sequence[str]) -> Callable[[list[int]], bool] | None:
    """The `StreamedLM.generate` stop test for `stops`: the new tokens' text (special tokens
    kept) holds one of them; None when there is no non-empty stop string."""
    strings = [s for s in stops if s]
    if not strings:
        return None

    def stop(tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        return any(s in text for s in strings)

    return stop


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """`text` up to (without) the earliest occurrence of any non-empty stop string."""
    ends = [text.find(s) for s in stops if s and s in text]
    return text[:min(ends)] if ends else text


def complete(lm: "StreamedLM", prompts: Sequence[str], *, chat: bool, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             stops: Sequence[str] = ()) -> list[str]:
    """One completion per prompt, generated in one `StreamedLM.generate` call.

    Args:
        lm: the streamed model with its checkpoint's tokenizer.
        prompts: texts (`prompt_ids` renders them).
        chat: render each prompt as a user turn with the chat template.
        max_new_tokens: tokens generated at most per prompt.
        temperature: 0 greedy, else the sampling temperature.
        top_p: nucleus mass kept when sampling, in (0, 1].
        seed: seed of the sampling generator (the same call gives the same text).
        stops: strings that end a completion; it is cut before the first one.

    Returns:
        The completions, special tokens (EOS) dropped.

    Raises:
        ValueError: `chat` without a chat template (`prompt_ids`); a prompt too long for
            `max_new_tokens` or an out-of-range sampling value (`StreamedLM.generate`).
    """
    ids = [prompt_ids(lm.tokenizer, text, chat=chat) for text in prompts]
    outputs = lm.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, seed=seed, stop=stop_on(lm.tokenizer, stops))
    return [cut_at_stops(lm.tokenizer.decode(tokens, skip_special_tokens=True), stops)
            for tokens in outputs]
