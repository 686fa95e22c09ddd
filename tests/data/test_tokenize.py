"""Prompt masking with and without a chat template, overlong samples, padded batches."""

from __future__ import annotations

import pytest
import torch

from lazytrain.data import DataCounts, TrainStream, encode, encode_prompt, pad_batch
from lazytrain.data.formats import Example, Message
from lazytrain.data.synthetic import arithmetic_dataset
from lazytrain.data.tokenize import IGNORE_INDEX

EXAMPLE = Example(messages=(Message(role="user", content="Ava has 3 apples. How many?"),
                            Message(role="assistant", content="3 apples.\n#### 3", train=True)),
                  answer="3")


def _trained_text(tok, enc):
    return tok.decode([t for t, lab in zip(enc.input_ids, enc.labels) if lab != IGNORE_INDEX])


def test_a_tokenizer_without_template_renders_chatml_and_trains_the_answer(plain_tokenizer):
    # Hand-built reference: the three pieces tokenized apart (special tokens and the newline
    # before the answer are pre-token boundaries, so BPE cannot merge across them).
    prompt = "<|im_start|>user\nAva has 3 apples. How many?<|im_end|>\n<|im_start|>assistant\n"
    target, tail = "3 apples.\n#### 3<|im_end|>", "\n"
    ids = [plain_tokenizer(t, add_special_tokens=False)["input_ids"] for t in (prompt, target,
                                                                               tail)]
    enc = encode(plain_tokenizer, EXAMPLE, seq_len=128, overlong="truncate")
    assert list(enc.input_ids) == ids[0] + ids[1] + ids[2]
    assert list(enc.labels) == [IGNORE_INDEX] * len(ids[0]) + ids[1] + [IGNORE_INDEX]
    assert encode_prompt(plain_tokenizer, EXAMPLE) == ids[0]


def test_chat_template_masks_the_template_and_the_user_turn(chat_tokenizer):
    enc = encode(chat_tokenizer, EXAMPLE, seq_len=128, overlong="truncate")
    text = chat_tokenizer.decode(enc.input_ids)
    assert text.startswith("<|im_start|>user\nAva has 3 apples.")
    assert _trained_text(chat_tokenizer, enc) == "3 apples.\n#### 3<|im_end|>\n"
    assert chat_tokenizer.decode(encode_prompt(chat_tokenizer, EXAMPLE)).endswith(
        "<|im_start|>assistant\n")


def test_chat_template_trains_every_assistant_turn(chat_tokenizer):
    ex = Example(messages=(Message(role="user", content="a"),
                           Message(role="assistant", content="first", train=True),
                           Message(role="user", content="b"),
                           Message(role="assistant", content="second", train=True)))
    enc = encode(chat_tokenizer, ex, seq_len=128, overlong="truncate")
    assert _trained_text(chat_tokenizer, enc) == "first<|im_end|>\nsecond<|im_end|>\n"


def test_overlong_samples_truncate_or_skip(plain_tokenizer):
    full = encode(plain_tokenizer, EXAMPLE, seq_len=128, overlong="truncate")
    n = len(full.input_ids)
    cut = encode(plain_tokenizer, EXAMPLE, seq_len=n - 2, overlong="truncate")
    assert cut.truncated and cut.input_ids == full.input_ids[: n - 2]
    assert cut.labels == full.labels[: n - 2]
    assert encode(plain_tokenizer, EXAMPLE, seq_len=n - 2, overlong="skip") is None
    # Cut inside the prompt: nothing left to learn, so the sample is dropped.
    assert encode(plain_tokenizer, EXAMPLE, seq_len=4, overlong="truncate") is None


def test_pad_batch_pads_right_with_ignored_labels(plain_tokenizer):
    a = encode(plain_tokenizer, EXAMPLE, seq_len=128, overlong="truncate")
    batch = pad_batch([a], seq_len=len(a.input_ids) + 3, pad_id=0)
    n = len(a.input_ids)
    assert batch["input_ids"].shape == (1, n + 3) and batch["input_ids"].dtype == torch.int64
    assert batch["input_ids"][0, n:].tolist() == [0, 0, 0]
    assert batch["labels"][0, n:].tolist() == [IGNORE_INDEX] * 3
    assert batch["attention_mask"][0].tolist() == [1] * n + [0] * 3


def _stream(tokenizer, examples, seq_len=160, overlong="truncate", micro_batch=3):
    return TrainStream(examples=examples, tokenizer=tokenizer, micro_batch=micro_batch,
                       seq_len=seq_len, pad_id=0, seed=5, overlong=overlong)


def test_stream_resumes_at_the_same_position(plain_tokenizer):
    examples, _ = arithmetic_dataset(num_train=7, num_eval=0, seed=0)
    straight = _stream(plain_tokenizer, examples)
    expected = [straight.next_micro_batch()["input_ids"] for _ in range(5)]  # crosses epochs
    first = _stream(plain_tokenizer, examples)
    got = [first.next_micro_batch()["input_ids"] for _ in range(2)]
    resumed = _stream(plain_tokenizer, examples)
    resumed.load_state_dict(first.state_dict())
    got += [resumed.next_micro_batch()["input_ids"] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert resumed.counts == DataCounts(drawn=15, truncated=0, skipped=0)


def test_stream_counts_skipped_and_refuses_when_nothing_fits(plain_tokenizer):
    examples, _ = arithmetic_dataset(num_train=4, num_eval=0, seed=0)
    with pytest.raises(ValueError, match="no sample fits data.seq_len=8"):
        _stream(plain_tokenizer, examples, seq_len=8, overlong="skip").next_micro_batch()
    # Reference from the untruncated encodings: longer than `cut` tokens -> truncated, unless
    # no trained token is left in the first `cut` -> skipped. `cut` is the median length, so
    # some samples are longer.
    examples, _ = arithmetic_dataset(num_train=7, num_eval=0, seed=0)
    full = [encode(plain_tokenizer, ex, seq_len=1000, overlong="truncate") for ex in examples]
    cut = sorted(len(f.input_ids) for f in full)[3]
    long = [f for f in full if len(f.input_ids) > cut]
    n_skip = sum(all(lab == IGNORE_INDEX for lab in f.labels[1:cut]) for f in long)
    assert long and len(long) > n_skip  # the fixture exercises truncation
    stream = _stream(plain_tokenizer, examples, seq_len=cut, micro_batch=7 - n_skip)
    batch = stream.next_micro_batch()
    assert batch["input_ids"].shape == (7 - n_skip, cut)
    assert stream.counts.truncated == len(long) - n_skip
    assert stream.counts.drawn - stream.counts.skipped == 7 - n_skip
