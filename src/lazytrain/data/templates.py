"""Chat templates: which Jinja template renders a conversation, and where its turns end.

`data.chat_template` picks one (`choose_template`):

| value           | template                                                                |
|-----------------|-------------------------------------------------------------------------|
| empty (default) | the tokenizer's own `chat_template`; chatml when it has none            |
| `chatml`        | `<|im_start|>role\\ncontent<|im_end|>\\n` (OpenAI ChatML; SmolLM2, Qwen)  |
| `qwen`          | chatml with Qwen2.5's default system prompt when the chat has none       |
| `llama3`        | `<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>` after BOS |
| a `.jinja` path | that file's text                                                        |

The named templates mark every assistant turn with `{% generation %}`, so
`apply_chat_template(..., return_assistant_tokens_mask=True)` yields the loss mask directly
(`tokenize.py`); for a template without the marker the mask comes from rendering prefixes.
The chosen template is set on the tokenizer, so the checkpoint's tokenizer saves it and
inference renders prompts the same way. Knows nothing about datasets or batches.

Source: the ChatML, Qwen2.5-Instruct and Llama-3-Instruct `tokenizer_config.json` templates
(Hugging Face Hub), re-written with the generation marker; HF transformers chat-templating
docs for `{% generation %}`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
"""ChatML; the assistant content and its `<|im_end|>` are the generation (trained) part."""

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
"""Qwen2.5-Instruct's default system prompt (its template adds it when the chat has none)."""

QWEN = ("{%- if messages[0]['role'] != 'system' %}"
        "{{- '<|im_start|>system\\n" + QWEN_SYSTEM + "<|im_end|>\\n' }}{%- endif %}" + CHATML)
"""Qwen2.5-Instruct: ChatML with a default system turn."""

LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
"""Llama-3-Instruct (no default system prompt or date line)."""

TEMPLATES = {"chatml": CHATML, "qwen": QWEN, "llama3": LLAMA3}
"""Named templates for `data.chat_template`."""

DEFAULT_TEMPLATE = "chatml"
"""Used when the tokenizer has no template and none is configured."""

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")
"""Turn-end markers of common templates: generation also stops at the one a template uses."""

_GENERATION_RE = re.compile(r"{%-?\s*generation\s*-?%}")


def has_generation_marker(template: str) -> bool:
    """True when the template marks assistant text with `{% generation %}`."""
    return bool(_GENERATION_RE.search(template))


def choose_template(tokenizer: Any, choice: str, *, base_dir: str | Path | None = None
                    ) -> tuple[str, str | None]:
    """The template for `data.chat_template` = `choice`, and a note to print (or None).

    Args:
        tokenizer: the model's HF tokenizer (its own `chat_template` is used for "").
        choice: "", a name in TEMPLATES, or a path to a Jinja file.
        base_dir: directory a relative Jinja path resolves against (default: the cwd).

    Returns:
        (template text, note): the note says that chatml was chosen because the tokenizer has
        no template; None otherwise.

    Raises:
        ValueError: `choice` is neither a name nor an existing file, or the file is empty.
    """
    if not choice:
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, str) and own:
            return own, None
        return TEMPLATES[DEFAULT_TEMPLATE], (
            f"data: the tokenizer has no chat template and data.chat_template is empty: using "
            f"{DEFAULT_TEMPLATE} (saved with the checkpoint's tokenizer)")
    if choice in TEMPLATES:
        return TEMPLATES[choice], None
    path = Path(choice).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise ValueError(f"data.chat_template: {choice!r} is neither a named template "
                         f"({', '.join(TEMPLATES)}) nor a Jinja file; give one of those")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"data.chat_template: {path} is empty; give a Jinja chat template")
    return text, None


def use_template(tokenizer: Any, choice: str, *, base_dir: str | Path | None = None
                 ) -> str | None:
    """Set the chosen template on `tokenizer` (so `save_pretrained` writes it); returns the
    note of `choose_template`. Raises what `choose_template` raises."""
    template, note = choose_template(tokenizer, choice, base_dir=base_dir)
    tokenizer.chat_template = template
    return note


def template_of(tokenizer: Any) -> str:
    """The template `tokenize.py` renders with: the tokenizer's, else the default (chatml)."""
    own = getattr(tokenizer, "chat_template", None)
    return own if isinstance(own, str) and own else TEMPLATES[DEFAULT_TEMPLATE]


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Token ids that end an assistant turn: eos plus every END_OF_TURN marker that the
    template uses and the vocabulary holds as one token (for greedy generation)."""
    template = template_of(tokenizer)
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    vocab = tokenizer.get_vocab()
    for marker in END_OF_TURN:
        if marker in template and marker in vocab and vocab[marker] not in ids:
            ids.append(vocab[marker])
    return ids
