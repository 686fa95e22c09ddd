"""The plan counts what the runtime holds, window by window, on every CPU backend.

The reference is the runtime's allocation ledger (`runtime/ledger.py`: every device allocation,
compute outputs included, booked per window) on one instrumented step; the prediction is the
evaluator's HBM of each window (the planner's fixed working set from `planner/build.py`, plus
the window's checkpoints and kept graphs). Each window's measured peak must stay within its
prediction, and the plan's peak must not be grossly above the measured one (10% plus one
block gradient: a drain that lags behind compute holds one more, which the synchronous `cpu`
backend never shows).

Cases: LM-head vocabularies from 512 to 128k at hidden 64 (the head's chunk workspace: logits,
fp32 softmax, their gradients and the head weight's [V, H] gradient), and `cpu-threaded`
copy delays under which block j+1's gradient is still draining while block j's backward
allocates its own.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_helpers import micro_batches, model_pair, tiny_config
from ledger_helpers import real_problem
from lazytrain.models import adapter_from_model
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.plan import SolveRecord
from lazytrain.runtime.device import make_device
from lazytrain.runtime.engine import Engine

R, H, D, N = "recompute", "hbm", "dram", "nvme"
MIXED = [R, D, H, N, H]


def _adapter(vocab: int):
    """A 4-layer, hidden-64 fp32 Llama with `vocab` tokens (untied head)."""
    config = tiny_config("llama")
    config.vocab_size = vocab
    torch.manual_seed(0)
    return adapter_from_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def _predicted_and_measured(adapter, tiers, tmp_path, *, device: str, seed: int = 0):
    """({window: the plan's HBM bytes}, {window: the ledger's peak bytes over micro-batches})."""
    problem = real_problem(adapter)
    decisions = decisions_from_tiers(problem, tuple(tiers), ())
    plan = build_plan(problem, decisions, solver=SolveRecord(backend="manual"))
    predicted = dict(zip((w.name for w in plan.windows), evaluate(problem, plan).hbm_by_window))
    dev = make_device(device, seed=seed)
    engine = Engine(adapter, plan, device=dev, nvme_dir=tmp_path / "nvme", grad_accum=2,
                    instrument=True, model_config_sha256=plan.provenance["model_config_sha256"])
    try:
        records = engine.step(micro_batches(2), lr=1e-3).windows
    finally:
        engine.close()
        dev.close()
    measured: dict[str, int] = {}
    for rec in records:
        for w in rec["windows"]:
            if w["name"] in predicted:
                measured[w["name"]] = max(measured.get(w["name"], 0), w["ledger"]["hbm_bytes"])
    return predicted, measured, max(problem.grad_bytes)


def _check(predicted, measured, block_grad_bytes) -> None:
    over = {w: (measured[w], int(predicted[w])) for w in predicted if measured[w] > predicted[w]}
    assert not over, f"measured > planned HBM bytes in {over}"
    peak_measured, peak_predicted = max(measured.values()), max(predicted.values())
    assert peak_predicted <= 1.10 * peak_measured + block_grad_bytes, (
        peak_predicted, peak_measured)


@pytest.mark.parametrize("vocab", [512, 4096, 16384, 131072], ids=lambda v: f"vocab{v}")
def test_the_plan_counts_the_heads_workspace_with_a_vocabulary_of(vocab, tmp_path):
    _check(*_predicted_and_measured(_adapter(vocab), MIXED, tmp_path, device="cpu"))


@pytest.mark.parametrize("device", ["cpu-checked", "cpu-threaded"])
def test_the_plan_counts_the_heads_workspace_on_the_backend(device, tmp_path):
    _check(*_predicted_and_measured(_adapter(16384), MIXED, tmp_path, device=device))


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"delays{s}")
@pytest.mark.parametrize("tiers", [[D, D, D, D, H], MIXED], ids=["all_dram", "mixed_tiers"])
def test_a_lagging_gradient_drain_stays_within_the_plan(tiers, seed, tmp_path):
    _, adapter = model_pair(tiny_config("llama"))
    _check(*_predicted_and_measured(adapter, tiers, tmp_path, device="cpu-threaded", seed=seed))
