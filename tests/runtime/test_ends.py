"""The head/loss chunk loop (`runtime/ends.head_loss_chunks`) against plain autograd on the HF
reference model's final norm and LM head over the whole sequence at once (copied weights)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import BATCH, HIDDEN, SEQ, micro_batches, model_pair, tiny_config
from lazytrain.models.adapter import shift_labels
from lazytrain.runtime.ends import head_loss_chunks


@pytest.mark.parametrize("tied", [False, True], ids=["untied_head", "tied_head"])
@pytest.mark.parametrize("chunk_tokens", [2 * 5, 2 * SEQ, 10_000],
                         ids=["chunks_with_a_short_last_one", "one_chunk", "fewer_tokens"])
def test_head_loss_chunks_equal_one_autograd_pass_over_the_whole_sequence(tied, chunk_tokens):
    ref, adapter = model_pair(tiny_config("llama", layers=2, tied=tied))
    batch = micro_batches(1)[0]
    targets = shift_labels(batch["labels"])
    tokens = int((targets != -100).sum()) + 3  # a step's count: more than this micro-batch's
    h = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(3))

    # reference: HF modules, full [B, S, V] logits, one backward
    x = h.clone().requires_grad_()
    logits = ref.lm_head(ref.model.norm(x))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                           reduction="sum") / tokens
    loss.backward()

    ends = adapter.params.ends
    grad = torch.zeros(ends.numel, dtype=torch.float32)
    total, grad_h = head_loss_chunks(adapter, ends, weights=ends.master.clone(), grad=grad,
                                     h=h, targets=targets, tokens=tokens,
                                     chunk_tokens=chunk_tokens)
    views = ends.views(grad)
    torch.testing.assert_close(total, loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_h, x.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(views["model.norm.weight"], ref.model.norm.weight.grad,
                               rtol=1e-5, atol=1e-7)
    head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert adapter.head_name == head_name
    torch.testing.assert_close(views[head_name], ref.lm_head.weight.grad, rtol=1e-5, atol=1e-7)
