"""train.epochs: steps from the data size, every sample once per epoch in a per-epoch order
from the seed, and a run stopped mid-epoch and resumed draws the same batches as a straight one.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from train_helpers import tiny_config
from lazytrain.data import TrainStream, encode
from lazytrain.data.batching import steps_for_epochs
from lazytrain.data.synthetic import arithmetic_dataset
from lazytrain.train.loop import TrainHooks, train


def _stream(tokenizer, examples, *, seed=0, micro_batch=2, packing=False):
    return TrainStream(examples=examples, tokenizer=tokenizer, micro_batch=micro_batch,
                       seq_len=160, pad_id=0, seed=seed, packing=packing)


def _rows(batch):
    """Each row's real tokens, as a tuple (identifies the sample)."""
    return [tuple(ids[mask.bool()].tolist())
            for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]


@pytest.fixture(scope="module")
def tokenizer(arithmetic_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(arithmetic_model_dir)


@pytest.mark.parametrize("epochs, n, micro, per_step, expected", [
    (2, 10, 2, 1, 10),    # 20 samples / 2 per step
    (1, 10, 4, 1, 3),     # 10 / 4 = 2.5 -> 3 (the last step runs into epoch 2)
    (1.5, 10, 2, 2, 4),   # 15 / 4 = 3.75 -> 4
    (0.01, 10, 2, 1, 1),  # at least one step
])
def test_padded_steps_for_epochs_are_the_hand_computed_ceiling(tokenizer, epochs, n, micro,
                                                                per_step, expected):
    examples, _ = arithmetic_dataset(num_train=n, num_eval=0, seed=0)
    stream = _stream(tokenizer, examples, micro_batch=micro)
    assert steps_for_epochs(stream, epochs=epochs, micro_batches_per_step=per_step) == expected


def test_packed_steps_for_epochs_draw_exactly_into_the_last_epoch(tokenizer):
    examples, _ = arithmetic_dataset(num_train=12, num_eval=0, seed=0)
    stream = _stream(tokenizer, examples, packing=True)
    steps = steps_for_epochs(stream, epochs=2, micro_batches_per_step=1)
    assert (stream.epoch, stream.cursor) == (0, 0)  # the count used a copy
    for _ in range(steps - 1):
        stream.next_micro_batch()
    assert stream.counts.drawn < 2 * 12  # one step fewer would not finish epoch 2
    stream.next_micro_batch()
    assert stream.counts.drawn >= 2 * 12


def test_each_epoch_draws_every_sample_once_in_a_new_order_from_the_seed(tokenizer):
    examples, _ = arithmetic_dataset(num_train=10, num_eval=0, seed=0)

    def epochs_of(seed):
        stream = _stream(tokenizer, examples, seed=seed)
        rows = [r for _ in range(10) for r in _rows(stream.next_micro_batch())]
        return rows[:10], rows[10:]

    first, second = epochs_of(0)
    # the samples' own encodings identify them (the order, not the encoding, is tested here)
    everything = {encode(tokenizer, ex, seq_len=160, overlong="truncate").input_ids
                  for ex in examples}
    assert set(first) == set(second) == everything and len(set(first)) == 10
    assert first != second  # reshuffled
    assert epochs_of(0) == (first, second)  # from the seed
    assert epochs_of(1)[0] != first


@pytest.mark.slow
def test_two_epochs_equal_a_run_stopped_mid_epoch_and_resumed(arithmetic_model_dir, tiny_plan,
                                                              tmp_path, monkeypatch):
    train_set, _ = arithmetic_dataset(num_train=10, num_eval=0, seed=5)
    data = tmp_path / "problems.jsonl"  # GSM8K-format file: 10 samples, 5 steps an epoch
    data.write_text("".join(json.dumps({"question": ex.messages[0].content,
                                        "answer": ex.messages[1].content}) + "\n"
                            for ex in train_set))
    drawn: list = []
    original = TrainStream.next_micro_batch

    def recording(self):
        batch = original(self)
        drawn.append(_rows(batch))
        return batch

    monkeypatch.setattr(TrainStream, "next_micro_batch", recording)
    extra = ("train.epochs=2", f"data.path={data}", "data.num_eval=0", "train.steps=1")
    straight = train(tiny_config(arithmetic_model_dir, tmp_path / "a", *extra), plan=tiny_plan,
                     progress=False)
    assert straight["steps_completed"] == 10  # train.steps=1 is replaced by the epochs' 10
    straight_batches, drawn[:] = list(drawn), []

    def stop_mid_second_epoch(step, stats):
        if step == 7:
            os.kill(os.getpid(), signal.SIGTERM)  # saves after this step and returns

    cfg = tiny_config(arithmetic_model_dir, tmp_path / "b", *extra)
    first = train(cfg, plan=tiny_plan, progress=False,
                  hooks=TrainHooks(on_step_end=stop_mid_second_epoch))
    assert first["stopped_by"] == "SIGTERM" and first["steps_completed"] == 7
    resumed = train(cfg, resume=True, progress=False)
    assert resumed["steps_this_run"] == 3
    assert drawn == straight_batches
    losses = [[json.loads(ln)["loss"] for ln in (tmp_path / d / "metrics.jsonl").read_text()
               .splitlines() if "loss" in ln] for d in ("a", "b")]
    assert losses[0] == losses[1]
    # every sample once per epoch
    flat = [r for b in straight_batches for r in b]
    assert len(set(flat[:10])) == 10 and set(flat[:10]) == set(flat[10:])
