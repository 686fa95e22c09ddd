"""Fixtures for the data tests: tokenizers trained on the embedded arithmetic problems."""

from __future__ import annotations

import pytest

from lazytrain.data.synthetic import arithmetic_dataset
from lazytrain.data.tiny_tokenizer import CHATML_TEMPLATE, train_tokenizer


def _corpus() -> list[str]:
    train, _ = arithmetic_dataset(num_train=200, num_eval=0, seed=1)
    return [m.content for ex in train for m in ex.messages] + ["Question: Answer: ####"]


@pytest.fixture(scope="session")
def plain_tokenizer():
    """A byte-level BPE tokenizer without a chat template (plain Question/Answer rendering)."""
    return train_tokenizer(_corpus(), vocab_size=400)


@pytest.fixture(scope="session")
def chat_tokenizer():
    """The same kind of tokenizer with a ChatML chat template."""
    return train_tokenizer(_corpus(), vocab_size=400, chat_template=CHATML_TEMPLATE)
