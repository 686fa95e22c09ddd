"""A data-parallel evaluation's shares combine to the one-process evaluation: each rank
evaluates its contiguous share of the held-out set, and `combine` weights the losses by their
trained tokens and sums the counts (reference: the same StreamedLM over the whole set)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from lazytrain.data import stop_token_ids
from lazytrain.data.synthetic import arithmetic_dataset
from lazytrain.evaluation.streamed_lm import StreamedLM
from lazytrain.models.hf_loader import load_adapter_from_dir
from lazytrain.runtime.backends import make_device
from lazytrain.train.evaluate import combine, evaluate_heldout, share_of


@pytest.mark.parametrize("world_size", [2, 3])
def test_shares_of_a_data_parallel_evaluation_combine_to_the_whole(arithmetic_model_dir,
                                                                   world_size):
    tok = AutoTokenizer.from_pretrained(arithmetic_model_dir)
    lm = StreamedLM(load_adapter_from_dir(arithmetic_model_dir), tok,
                    device=make_device("cpu"), weights="host",
                    eos_token_ids=set(stop_token_ids(tok)))
    _, examples = arithmetic_dataset(num_train=0, num_eval=7, seed=3)
    kw = dict(seq_len=160, data_format="arithmetic")
    whole = evaluate_heldout(lm, list(examples), **kw)
    parts = [evaluate_heldout(lm, share_of(list(examples), rank=r, world_size=world_size), **kw)
             for r in range(world_size)]
    assert sum(p.num_examples for p in parts) == 7  # every example in exactly one share
    # each rank's all_sum returns the sum of what every rank passed in the same call
    calls = [[] for _ in parts]
    for k, p in enumerate(parts):
        combine(p, lambda v, k=k: calls[k].append(v) or v)
    totals = iter([sum(vals) for vals in zip(*calls)])
    got = combine(parts[0], lambda v: next(totals))
    assert got.loss == pytest.approx(whole.loss, rel=1e-9)
    assert (got.loss_tokens, got.num_examples, got.num_scored, got.num_correct,
            got.exact_match) == (whole.loss_tokens, whole.num_examples, whole.num_scored,
                                 whole.num_correct, whole.exact_match)
    assert got.samples == whole.samples[:len(parts[0].samples)]  # rank 0 holds the first
