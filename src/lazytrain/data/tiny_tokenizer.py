"""A small byte-level BPE tokenizer trained on the fly, for tiny random test models.

Real runs take the tokenizer from the model directory; tests and benchmarks on tiny random
models need one whose vocabulary fits the model, so they train it here with the `tokenizers`
library on the data they use. Byte-level: every string encodes, offsets are exact.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
"""Ids 0..4, in this order."""

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A minimal ChatML template without `{% generation %}` markers (the convention SmolLM2 and Qwen
use), for the tests of masking by rendered prefixes."""


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 512,
                    chat_template: str | None = None):
    """A `PreTrainedTokenizerFast` trained on `texts`.

    Args:
        texts: training corpus (a few hundred samples is plenty).
        vocab_size: target vocabulary including the 256 byte symbols and SPECIAL_TOKENS.
        chat_template: Jinja chat template to attach (e.g. CHATML_TEMPLATE); None: none, so the
            data layer uses its default (chatml, `templates.py`).

    Returns:
        The tokenizer, with pad/bos/eos set to `<|pad|>`, `<|bos|>`, `<|eos|>`.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>",
                                      bos_token="<|bos|>", eos_token="<|eos|>",
                                      additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat_template is not None:
        wrapped.chat_template = chat_template
    return wrapped
