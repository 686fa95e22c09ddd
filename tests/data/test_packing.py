"""Sequence packing: packed rows compute what the samples compute one by one.

Reference: plain HF autograd on an independent copy of a tiny Llama, each sample run alone as
a [1, n] batch; the packed micro-batch runs through the streaming engine (position ids, no
attention mask, the engine's own mask path). Token-weighted loss = sum of per-sample summed
losses / their label tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from engine_helpers import model_pair, plan_for, tiny_config  # noqa: E402

from lazytrain.data import TrainStream, packed_batch, real_token_count  # noqa: E402
from lazytrain.data.packing import check_packing_supported, fill_rows  # noqa: E402
from lazytrain.data.synthetic import arithmetic_dataset  # noqa: E402
from lazytrain.data.tokenize import IGNORE_INDEX, Encoded  # noqa: E402
from lazytrain.runtime.build import make_engine  # noqa: E402

ROWS, SEQ = 2, 12  # engine_helpers' BATCH and SEQ: the plan's batch shape
R, H, D = "recompute", "hbm", "dram"


def _sample(n: int, *, prompt: int, seed: int) -> Encoded:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 96, (n,), generator=g).tolist()
    labels = [IGNORE_INDEX] * prompt + ids[prompt:]
    return Encoded(input_ids=tuple(ids), labels=tuple(labels))


# Lengths 5, 4, 3 fill row 0 exactly; 7 and 3 go to row 1 (2 tokens of padding); 6 fits no row.
SAMPLES = [_sample(n, prompt=p, seed=i) for i, (n, p) in
           enumerate([(5, 2), (4, 1), (3, 0), (7, 3), (3, 1), (6, 2)])]


def _pack(samples: list[Encoded]) -> tuple[dict, list[Encoded], list[Encoded]]:
    """(packed batch, samples packed, samples put back) with the real packer."""
    queue, back = list(samples), []
    rows = fill_rows(lambda: queue.pop(0), back.append, rows=ROWS, seq_len=SEQ)
    return packed_batch(rows, seq_len=SEQ, pad_id=0), [s for r in rows for s in r], back


def test_first_fit_fills_rows_and_puts_back_the_sample_that_fits_nowhere():
    batch, packed, back = _pack(SAMPLES)
    assert packed == SAMPLES[:5] and back == [SAMPLES[5]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2],
                                              [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 1]]
    assert "attention_mask" not in batch  # HF derives the per-sample mask from position ids
    assert real_token_count(batch) == 22 and batch["token_mask"][1, 10:].tolist() == [0, 0]
    # Each sample's first token is never a target (it would be predicted from the previous
    # sample); the rest of its labels are copied; the tail is ignored.
    assert batch["labels"][1].tolist() == ([IGNORE_INDEX] * 3 + list(SAMPLES[3].input_ids[3:])
                                           + [IGNORE_INDEX] + list(SAMPLES[4].input_ids[1:])
                                           + [IGNORE_INDEX] * 2)


def _one_by_one(ref, samples: list[Encoded]) -> tuple[float, dict]:
    """Token-weighted loss and summed-then-normalised grads of the samples run alone (HF)."""
    counts = [sum(lab != IGNORE_INDEX for lab in s.labels[1:]) for s in samples]
    total = sum(counts)
    ref.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for s, n in zip(samples, counts):
        out = ref(input_ids=torch.tensor([s.input_ids]), labels=torch.tensor([s.labels]),
                  use_cache=False)
        (out.loss * n / total).backward()  # out.loss is the mean over this sample's n targets
        loss_sum += float(out.loss.detach()) * n
    return loss_sum / total, {k: p.grad for k, p in ref.named_parameters()}


@pytest.mark.parametrize("tiers", [[H] * 5, [R, D, H, R, H]], ids=["all_hbm", "mixed_tiers"])
def test_packed_batch_loss_equals_token_weighted_loss_of_samples_run_one_by_one(tiers,
                                                                              tmp_path):
    ref, adapter = model_pair(tiny_config("llama"))
    batch, packed, _ = _pack(SAMPLES)
    engine = make_engine(adapter, plan_for(adapter, tiers), device="cpu",
                         nvme_dir=tmp_path / "nvme")
    try:
        loss = engine.compute_gradients([batch])
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    ref_loss, ref_grads = _one_by_one(ref, packed)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, g in ref_grads.items():
        assert float((grads[name] - g).abs().max()) <= 1e-5 * scale, name


def test_packing_without_isolation_would_change_the_logits():
    """Control: the same row with plain positions (one long causal sequence) gives other
    logits, so the equality above really comes from the per-sample positions and mask."""
    ref, _ = model_pair(tiny_config("llama"))
    batch, packed, _ = _pack(SAMPLES)
    with torch.no_grad():
        iso = ref(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        mixed = ref(input_ids=batch["input_ids"]).logits
    # Row 0's first sample sees nothing before it either way; its later samples differ.
    assert torch.allclose(iso[0, :5], mixed[0, :5], atol=1e-6)
    assert float((iso[0, 5:] - mixed[0, 5:]).abs().max()) > 1e-3


def test_packed_stream_resumes_and_draws_every_sample_once(plain_tokenizer):
    examples, _ = arithmetic_dataset(num_train=40, num_eval=0, seed=3)

    def stream():
        return TrainStream(examples=examples, tokenizer=plain_tokenizer, micro_batch=2,
                           seq_len=160, pad_id=0, seed=5, packing=True)

    a = stream()
    first = [a.next_micro_batch() for _ in range(2)]
    state = a.state_dict()
    rest = [a.next_micro_batch() for _ in range(3)]
    b = stream()
    b.load_state_dict(state)
    for x, y in zip(rest, [b.next_micro_batch() for _ in range(3)]):
        assert all(torch.equal(x[k], y[k]) for k in x)
    # Samples start where position_ids restart at 0 inside token_mask; within one epoch the
    # count of packed samples equals the stream's drawn count (nothing lost when put back).
    batches = first + rest
    starts = sum(int(((bt["position_ids"] == 0) & (bt["token_mask"] == 1)).sum())
                 for bt in batches)
    assert a.epoch == 0 and starts == a.counts.drawn - a.counts.skipped
    assert all(bt["input_ids"].shape == (2, 160) for bt in batches)


@pytest.mark.parametrize("config", [
    {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]},
    {"model_type": "qwen3_5", "text_config": {"layer_types": ["linear_attention"] * 3
                                              + ["full_attention"]}},
], ids=["qwen3_next", "qwen3_5_nested"])
def test_packing_is_refused_for_models_with_recurrent_layers(config):
    with pytest.raises(ValueError, match="data.packing: the model has linear_attention"):
        check_packing_supported(config)


def test_packing_is_allowed_for_sliding_and_full_attention():
    check_packing_supported({"layer_types": ["sliding_attention", "full_attention"]})
    check_packing_supported(tiny_config("llama"))
