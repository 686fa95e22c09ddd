"""A resume on other data of the same size names both ways the data is given: a data.mix run
was told to resume "with the run's data.path", a key it does not use."""

from __future__ import annotations

import pytest

from lazytrain.data.batching import TrainStream
from lazytrain.data.formats import Example, Message


def _stream(word: str) -> TrainStream:
    examples = [Example(messages=(Message(role="user", content=f"{word} {i}"),
                                  Message(role="assistant", content="ok", train=True)))
                for i in range(3)]
    return TrainStream(examples=examples, tokenizer=None, micro_batch=1, seq_len=16, pad_id=0,
                       seed=0)


def test_other_data_of_the_same_size_names_data_path_and_data_mix():
    saved = _stream("a").state_dict()
    with pytest.raises(ValueError, match="other data of the same size") as info:
        _stream("b").load_state_dict(saved)
    assert "data.path" in str(info.value) and "data.mix" in str(info.value)
