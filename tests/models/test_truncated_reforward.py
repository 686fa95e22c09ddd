"""Truncated re-forward: the re-forward feeding a block's own backward skips its last projection
(the MLP's down projection, or the routed experts' down projections and combine), and the
gradients still equal plain HF autograd.

"Skipped" is checked against plain HF autograd, not against the engine: count the matrix
products that have the shape of a tail's forward (inner dimension the MLP/expert intermediate
size I, output width the hidden size H). Plain HF forward + backward runs each tail's forward
once (plus, for a dense MLP, the gate/up input gradients, which have the same shape). An engine
step whose every block is re-forwarded runs the forward once more per block; a truncated
re-forward adds none, so the counts must be equal; the full re-forward of a family that keeps
it (Gemma2: its post-feedforward norm reads the projection) adds exactly the tail's forward per
re-forwarded block, which we count in a plain HF forward.

Gradient equivalence with HF runs for a dense (Llama, also with MLP biases), a hybrid
linear-attention (Qwen3.5), a MoE (Qwen3-MoE, GPT-OSS's biased experts, Qwen3-Next with its
gated shared expert) and sliding-window (Mistral, Gemma2) model under the `cpu-checked` and
`cpu-threaded` ordering checkers (tests/models/test_families.py runs every family on `cpu`).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from engine_helpers import HIDDEN, micro_batches, plan_for, reference_grads  # noqa: E402
from lazytrain.models import adapter_from_model  # noqa: E402
from lazytrain.models.families import LAYOUTS  # noqa: E402
from lazytrain.runtime.backends import make_device  # noqa: E402
from lazytrain.runtime.build import make_engine  # noqa: E402
from test_families import ATTN, _assert_grads_match, family_config  # noqa: E402

H, D, R = "hbm", "dram", "recompute"
ALL_REFORWARDED = [H, H, H, H, H]  # every block re-forwarded in its own window, none kept
MIXED = [D, R, H, D, H]


class _TailShapedProducts(TorchDispatchMode):
    """Counts mm/addmm/bmm whose inner dimension is `inner` and whose output width is HIDDEN."""

    def __init__(self, inner: int) -> None:
        super().__init__()
        self.inner, self.count = inner, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "overloadpacket", None)
        if packet in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            a = args[1] if packet is torch.ops.aten.addmm else args[0]
            if a.shape[-1] == self.inner and out.shape[-1] == HIDDEN:
                self.count += 1
        return out


def _pair(config):
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    twin = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    twin.load_state_dict(copy.deepcopy(ref.state_dict()))
    ref.train()
    return ref, adapter_from_model(twin)


def _engine_grads(adapter, tiers, device, tmp_path, *, inner: int = 1):
    # a problem with re-forward data gives the plan save levels (all L0): truncated
    plan = plan_for(adapter, tiers, reforward_ms=(1.0,) * adapter.num_blocks)
    engine = make_engine(adapter, plan, device=device, nvme_dir=tmp_path / "nvme")
    counter = _TailShapedProducts(inner)
    try:
        torch.manual_seed(123)
        with counter:
            engine.compute_gradients(micro_batches(1))
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        dev = engine.dev
        engine.close()
        if getattr(dev, "violations", None):
            raise dev.violations[0]
    return grads, counter.count


def _hf_counts(ref, inner: int) -> tuple[int, int, dict]:
    """(tail-shaped products in HF forward + backward, in a HF forward alone, HF grads)."""
    batches = micro_batches(1)
    with _TailShapedProducts(inner) as train:
        torch.manual_seed(123)
        _, grads = reference_grads(ref, batches)
    with torch.no_grad(), _TailShapedProducts(inner) as forward:
        ref(**batches[0], use_cache=False)
    return train.count, forward.count, grads


CASES = {  # family -> (config, intermediate size of its tails)
    "llama": (family_config("llama"), 128),
    "llama_mlp_bias": (tf.LlamaConfig(intermediate_size=128, mlp_bias=True, **ATTN), 128),
    "qwen3_5_text": (family_config("qwen3_5_text"), 128),
    "qwen3_moe": (family_config("qwen3_moe"), 32),
    "mixtral": (family_config("mixtral"), 32),
    "gpt_oss": (family_config("gpt_oss"), 32),
    "deepseek_v2": (family_config("deepseek_v2"), 32),  # routed and shared experts: I = 32
    "mistral": (family_config("mistral"), 128),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reforward_runs_no_tail_forward_beyond_plain_autograd(case, tmp_path):
    config, inner = CASES[case]
    ref, adapter = _pair(config)
    grads, engine_count = _engine_grads(adapter, ALL_REFORWARDED, "cpu", tmp_path, inner=inner)
    hf_count, _, ref_grads = _hf_counts(ref, inner)
    assert hf_count > 0
    assert engine_count == hf_count  # the full re-forward runs one more tail per block
    _assert_grads_match(grads, ref_grads)


def test_family_that_reads_its_tail_keeps_the_full_reforward(tmp_path):
    reason = LAYOUTS["gemma2"].full_reforward_reason
    assert reason and "post_feedforward_layernorm" in reason
    ref, adapter = _pair(family_config("gemma2"))
    assert not adapter.truncated_reforward
    grads, engine_count = _engine_grads(adapter, ALL_REFORWARDED, "cpu", tmp_path, inner=128)
    hf_count, forward_count, ref_grads = _hf_counts(ref, 128)
    assert forward_count == adapter.num_blocks  # one down projection per block
    assert engine_count == hf_count + forward_count
    _assert_grads_match(grads, ref_grads)


def test_every_listed_family_truncates_or_says_why():
    for name, layout in LAYOUTS.items():
        reason = layout.full_reforward_reason
        assert reason is None or len(reason) > 20, name


CHECKED = ["llama_mlp_bias", "qwen3_5_text", "qwen3_moe", "gpt_oss", "qwen3_next", "mistral",
           "gemma2"]


@pytest.mark.parametrize("backend", ["cpu-checked", "cpu-threaded"])
@pytest.mark.parametrize("family", CHECKED)
def test_truncated_reforward_grads_equal_autograd_under_checker(family, backend, tmp_path):
    config = CASES[family][0] if family in CASES else family_config(family)
    ref, adapter = _pair(config)
    grads, _ = _engine_grads(adapter, MIXED, make_device(backend, seed=7), tmp_path)
    torch.manual_seed(123)
    _, ref_grads = reference_grads(ref, micro_batches(1))
    _assert_grads_match(grads, ref_grads)
