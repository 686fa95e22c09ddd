"""Shared builders for the engine tests: tiny HF models, hand-made planning problems and plans,
and the independent reference (plain HF autograd on a copied state_dict)."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from lazytrain.models import adapter_from_model
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
from lazytrain.planner.plan import SolveRecord
from lazytrain.planner.problem import PlanningProblem

VOCAB, HIDDEN, BATCH, SEQ = 96, 64, 2, 12
torch.set_num_threads(1)  # tiny tensors: threads only add overhead on a shared 2-core machine


def tiny_config(family: str = "llama", *, layers: int = 4, tied: bool = False,
                dropout: float = 0.0):
    """A 2-4 layer, hidden-64 fp32 config of `family` ("llama" or "qwen3")."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=tied,
                  attention_dropout=dropout, pad_token_id=0)
    if family == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    return LlamaConfig(**common)


def model_pair(config, *, seed: int = 0):
    """(reference HF model, adapter) with identical fp32 weights (a copied state_dict)."""
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    twin = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    twin.load_state_dict(copy.deepcopy(ref.state_dict()))
    ref.train()
    return ref, adapter_from_model(twin)


def micro_batches(n: int, *, seed: int = 1, pad_last: bool = True) -> list[dict]:
    """n micro-batches [BATCH, SEQ]; the labels ignore a prompt prefix, and (pad_last) the
    last row is right-padded with an attention mask."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        if pad_last:
            ids[-1, -4:] = 0
            labels[-1, -4:] = -100
            mask[-1, -4:] = 0
        out.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return out


def problem_for(adapter, *, grad_accum: int = 1, **overrides) -> PlanningProblem:
    """A hand-made problem whose boundary bytes equal the real fp32 tensors
    (BATCH * SEQ * HIDDEN * 4) and whose provenance matches the adapter and batch shape."""
    L = adapter.num_blocks
    A = BATCH * SEQ * HIDDEN * 4
    P = adapter.params.blocks[0].numel * 4
    kw = dict(fwd_ms=(1.0,) * L, fwd_grad_ms=(1.2,) * L, bwd_ms=(2.0,) * L,
              weight_bytes=(P,) * L, grad_bytes=(P,) * L, internal_bytes=(4 * A,) * L,
              boundary_bytes=(A,) * (L + 1), params_per_block=(P // 4,) * L,
              h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, duplex_bytes_per_s=1.5e9,
              nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9,
              hbm_bytes=10**12, dram_bytes=10**12, nvme_bytes=10**12, grad_accum=grad_accum,
              provenance={"model": "tiny", "model_config_sha256": adapter.hf_config_sha256,
                          "seq_len": SEQ, "micro_batch": BATCH, "grad_accum": grad_accum,
                          "dtype": "fp32"})
    kw.update(overrides)
    return PlanningProblem(**kw)


_R, _H, _D, _N = "recompute", "hbm", "dram", "nvme"
PLAN_KINDS = {
    "all_hbm_segments_of_1": ([_H, _H, _H, _H, _H], ()),
    "all_dram": ([_D, _D, _D, _D, _H], ()),
    "all_nvme": ([_N, _N, _N, _N, _H], ()),
    "mixed_tiers": ([_R, _D, _H, _N, _H], ()),
    "segments_of_2": ([_H, _R, _H, _R, _H], ()),
    "segments_of_3_and_1": ([_D, _R, _R, _H, _H], ()),
    "one_segment_of_4_reembedded": ([_R, _R, _R, _R, _H], ()),
    "keep_internals_last_blocks": ([_H, _R, _H, _H, _H], (2, 3)),
    "keep_after_recomputed_segment": ([_N, _R, _R, _D, _H], (2, 3)),
}
"""The plan-kind matrix for a 4-block model: name -> (boundary tiers, keep_internals)."""


def plan_for(adapter, tiers, keep=(), **problem_overrides):
    """A validated Plan with a legal transfer schedule for `tiers` (len L+1)."""
    problem = problem_for(adapter, **problem_overrides)
    decisions = decisions_from_tiers(problem, tuple(tiers), tuple(keep))
    return build_plan(problem, decisions, solver=SolveRecord(backend="manual"))


def reference_grads(ref, batches: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain HF autograd over the micro-batches, loss normalised by all label tokens."""
    n = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    ref.zero_grad(set_to_none=True)
    total = 0.0
    for b in batches:
        out = ref(**b, use_cache=False, num_items_in_batch=torch.tensor(n))
        out.loss.backward()
        total += float(out.loss.detach())
    return total, {name: p.grad for name, p in ref.named_parameters()}
