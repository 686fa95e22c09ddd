"""The plan counts what the runtime holds, window by window, on every CPU backend.

The reference is the runtime's allocation ledger (`runtime/ledger.py`: every device allocation,
compute outputs included, booked per window) on one instrumented step; the prediction is the
evaluator's HBM of each window (the planner's fixed working set from `planner/build.py`, plus
the window's checkpoints and kept graphs). Each window's measured peak must stay within its
prediction, and the plan's peak must not be grossly above the measured one (10% plus two
block gradients: the drain's copies that lag behind compute hold up to two more, which the
synchronous `cpu` backend never shows).

Cases: LM-head vocabularies from 512 to 128k at hidden 64 (the head's chunk workspace: logits,
fp32 softmax, their gradients and the head weight's [V, H] gradient), and `cpu-threaded`
copy delays under which block j+1's gradient is still draining while block j's backward
allocates its own (and block j+2's, the drain keeping two copies in flight).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from torch.utils._pytree import tree_flatten

from engine_helpers import BATCH, SEQ, micro_batches, model_pair, tiny_config
from ledger_helpers import real_problem
from lazytrain.models import adapter_from_model
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.plan import SolveRecord
from lazytrain.runtime.block_autograd import grad_leaves
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.build import make_engine
from lazytrain.spec.costs import analytic_costs
from lazytrain.spec.hardware import get_hardware
from lazytrain.spec.model import ModelSpec

R, H, D, N = "recompute", "hbm", "dram", "nvme"
MIXED = [R, D, H, N, H]


def _adapter(vocab: int):
    """A 4-layer, hidden-64 fp32 Llama with `vocab` tokens (untied head)."""
    config = tiny_config("llama")
    config.vocab_size = vocab
    torch.manual_seed(0)
    return adapter_from_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def _predicted_and_measured(adapter, tiers, tmp_path, *, device: str, seed: int = 0, keep=()):
    """({window: the plan's HBM bytes}, {window: the ledger's peak bytes over micro-batches},
    the largest block gradient in bytes)."""
    problem = real_problem(adapter)
    decisions = decisions_from_tiers(problem, tuple(tiers), tuple(keep))
    plan = build_plan(problem, decisions, solver=SolveRecord(backend="manual"))
    predicted = dict(zip((w.name for w in plan.windows), evaluate(problem, plan).hbm_by_window))
    dev = make_device(device, seed=seed)
    engine = make_engine(adapter, plan, device=dev, nvme_dir=tmp_path / "nvme", grad_accum=2,
                         instrument=True,
                         model_config_sha256=plan.provenance["model_config_sha256"])
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
    assert peak_predicted <= 1.10 * peak_measured + 2 * block_grad_bytes, (
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


def _saved_bytes(adapter, *, padded: bool, dtype: torch.dtype) -> int:
    """Bytes autograd saves in block 0's forward as the engine runs it for a kept graph
    (`ModelAdapter.forward_block` on the block's flat weights, the micro-batch's block inputs),
    less its input, its weights and the block inputs (counted elsewhere in the plan)."""
    mb = micro_batches(1, pad_last=padded)[0]
    ends = adapter.params.ends
    h = adapter.embed(mb["input_ids"], ends.views(ends.master)[adapter.embed_name]).to(dtype)
    kwargs = adapter.block_kwargs(mb["input_ids"], h,
                                  attention_mask=mb["attention_mask"] if padded else None)[0]
    x = h.detach().requires_grad_()
    leaves = grad_leaves(adapter.params.blocks[0], adapter.params.blocks[0].master.to(dtype))
    counted = {t.untyped_storage().data_ptr() for t in (x, *leaves.values(),
                                                         *tree_flatten(kwargs)[0])
               if isinstance(t, torch.Tensor)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in counted:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        adapter.forward_block(0, x, leaves, kwargs)
    return sum(saved.values())


def _attention_config(name: str):
    """A 4-layer fp32 config (head dim 16, hidden 16 x heads) whose block 0 is softmax attention
    of `name`'s kind."""
    heads, kv_heads = {"llama_gqa": (4, 2), "smollm2_heads": (9, 3), "llama_mha": (4, 4)}.get(
        name, (4, 2))
    common = dict(vocab_size=96, hidden_size=16 * heads, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                  max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0)
    if name == "qwen3_gqa":
        return tiny_config("qwen3")
    if name == "gemma3_gqa":  # four (1 + weight) fp32 norms, q/k norms, sliding block 0
        return transformers.Gemma3TextConfig(sliding_window=4, query_pre_attn_scalar=16,
                                             **common)
    if name == "qwen3_5_gated":  # full attention with the output gate, (1 + weight) norms
        return transformers.Qwen3_5TextConfig(
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, layer_types=["full_attention"] * 4, **common)
    return transformers.LlamaConfig(**common)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("name", ["llama_gqa", "smollm2_heads", "llama_mha", "qwen3_gqa",
                                  "gemma3_gqa", "qwen3_5_gated"])
def test_the_kept_graph_bytes_bound_what_autograd_saves(name, padded, dtype):
    torch.manual_seed(0)
    adapter = adapter_from_model(AutoModelForCausalLM.from_config(_attention_config(name),
                                                                  dtype=torch.float32))
    spec = ModelSpec.from_hf_config(adapter.config.to_dict(), name="tiny")
    costs = analytic_costs(spec, get_hardware("cpu"), seq_len=SEQ, micro_batch=BATCH,
                           compute_dtype="fp32" if dtype == torch.float32 else "bf16")
    measured = _saved_bytes(adapter, padded=padded, dtype=dtype)
    planned = costs.blocks[0].internal_bytes
    assert measured <= planned
    # above it by what the bound counts for every case: k/v expanded (only with a mask) and
    # the norm's compute-dtype cast (the fp32 tensor itself with fp32 compute)
    assert planned <= 1.35 * measured, (planned, measured)


@pytest.mark.parametrize("device", ["cpu", "cpu-threaded"])
def test_a_budget_of_exactly_the_plans_peak_runs_with_a_16k_vocabulary(device, tmp_path):
    # the HBM the planner's budget leaves (hbm_gb x 0.95, the default reserve) set to the plan's
    # own predicted peak: a plan accepted there must run with the ledger's hard limits on
    adapter = _adapter(16384)
    peak = evaluate(real_problem(adapter), decisions_from_tiers(
        real_problem(adapter), tuple(MIXED), ())).peak_hbm_bytes
    problem = real_problem(adapter, hbm_gb=(peak + 64) / 0.95 / 1e9)  # 64 B: int rounding
    plan = build_plan(problem, decisions_from_tiers(problem, tuple(MIXED), ()),
                      solver=SolveRecord(backend="manual"))
    assert problem.hbm_bytes >= plan.predicted.peak_hbm_bytes
    dev = make_device(device, seed=0)
    engine = make_engine(adapter, plan, device=dev, nvme_dir=tmp_path / "nvme", grad_accum=2,
                         budgets=True, model_config_sha256=plan.provenance["model_config_sha256"])
    try:
        engine.step(micro_batches(2), lr=1e-3)  # HbmBudgetExceeded at turn before
    finally:
        engine.close()
        dev.close()
