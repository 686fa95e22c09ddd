"""Save levels L1/L2 of one block (models/saved_tensors.py): the gradients of the input and of
every parameter equal plain HF autograd on the same layer, after the weights, the input and
the kwargs moved between forward and backward and the kept storages went through copies (as
the DRAM tier does); the kept bytes equal a saved-tensor-hooks count written here.

Reference: the HF decoder layer of an independent copy of the same tiny fp32 model, run with
plain autograd on the adapter's kwargs; loss = <block output, grad_out> (plus the router aux
term where tested). Families: dense (Llama), MoE (Qwen3-MoE, GPT-OSS's biased experts and
sinks, DeepSeek-V2's MLA and shared experts), hybrid linear attention (Qwen3-Next's Gated
DeltaNet with its gated shared expert), Gemma2 (post-feedforward norm: the family keeps the
full re-forward, so L1's re-forward runs the whole MLP) and Phi3 with dropout after the mixer.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from engine_helpers import BATCH, HIDDEN, SEQ, micro_batches  # noqa: E402
from lazytrain.models import adapter_from_model  # noqa: E402
from lazytrain.models import saved_tensors as st  # noqa: E402
from lazytrain.models.router_aux import RouterAux  # noqa: E402
from lazytrain.models.saved_tensors import (SavedInternals, backward_saved,  # noqa: E402
                                            forward_saving, token_mixer)
from lazytrain.runtime.block_autograd import grad_leaves  # noqa: E402
from test_families import family_config  # noqa: E402

CASES = {  # id -> (family, block): the block is a MoE one where the family has dense layers
    "llama": ("llama", 1),
    "qwen3_moe": ("qwen3_moe", 1),
    "qwen3_next_linear_attention": ("qwen3_next", 0),
    "gemma2": ("gemma2", 0),
    "gpt_oss": ("gpt_oss", 0),
    "deepseek_v2": ("deepseek_v2", 1),
}
LEVELS = ["L1", "L2"]
NAN = float("nan")


class Block:
    """One tiny model twice (HF reference, adapter over a copied state_dict), block j's input
    x [B, S, H], its kwargs and an output gradient, on `device`."""

    def __init__(self, config, j: int, *, device: str = "cpu") -> None:
        torch.manual_seed(0)
        self.ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        twin = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        twin.load_state_dict(copy.deepcopy(self.ref.state_dict()))
        self.ref.train()
        self.adapter = adapter_from_model(twin)
        self.j, self.layer = j, self.ref.model.layers[j].to(device)
        self.group, self.device = self.adapter.params.blocks[j], device
        batch = micro_batches(1)[0]  # last row right-padded
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(device)
        self.grad_out = torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(device)
        self.mask = batch["attention_mask"].to(device)
        self.kwargs = self.adapter.block_kwargs(batch["input_ids"].to(device), self.x,
                                                attention_mask=self.mask)[j]

    def flat(self) -> torch.Tensor:
        """A fresh copy of the block's flat weights on the device."""
        return self.group.master.to(self.device, copy=True)

    def reference(self, *, seed: int = 0, aux: RouterAux | None = None):
        """(output, {"x": grad, parameter name: grad or None}) of plain HF autograd."""
        x = self.x.clone().requires_grad_()
        logits = []
        hooks = [m.register_forward_hook(lambda _m, _i, out: logits.append(out[0]))
                 for m in self.layer.modules() if isinstance(m, self.adapter.router_cls or ())]
        torch.manual_seed(seed)
        try:
            out = self.layer(x, **self.kwargs)
        finally:
            for h in hooks:
                h.remove()
        out = out[0] if isinstance(out, tuple) else out
        loss = (out * self.grad_out).sum()
        if aux is not None:
            loss = loss + aux.block_term(logits)
        params = dict(self.layer.named_parameters())
        grads = torch.autograd.grad(loss, [x, *params.values()], allow_unused=True)
        return out.detach(), dict(zip(["x", *params], grads))

    def saved(self, level: str, *, seed: int = 0, aux: RouterAux | None = None):
        """(output, grads) through forward_saving and backward_saved, moving everything in
        between: the backward gets other weight, input and kwargs buffers with the same values
        (the forward's are overwritten with garbage) and copies of the kept storages (the
        originals overwritten) to the host and back."""
        flat = self.flat()
        x, kwargs = self.x.clone(), _clone(self.kwargs)
        logits = [] if aux is not None else None
        torch.manual_seed(seed)
        with torch.no_grad():  # the engine's forward runs without grad
            out, saved = forward_saving(self.adapter, self.j, x, grad_leaves(self.group, flat),
                                        flat, kwargs, level=level, router_logits=logits)
        if aux is not None:
            aux.observe(logits)
        flat_b, x_b = flat.clone(), x.clone()
        for t in (flat, x, *_tensors_in(kwargs)):
            _garbage(t)
        originals = saved.storages
        saved.replace_storages([s.to("cpu", copy=True) for s in originals])
        for s in originals:
            s.fill_(255)  # NaN in every float dtype
        saved.replace_storages([s.to(self.device, copy=True) for s in saved.storages])
        grad_x, grads = backward_saved(self.adapter, self.j, saved, x_b,
                                       grad_leaves(self.group, flat_b), flat_b, self.kwargs,
                                       self.grad_out, aux=aux)
        return out, {"x": grad_x, **grads}


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_clone(v) for v in tree)
    return tree


def _tensors_in(tree) -> list[torch.Tensor]:
    """Every tensor of a kwargs tree (dicts, tuples, lists)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else \
        tree if isinstance(tree, (tuple, list)) else ()
    return [t for item in items for t in _tensors_in(item)]


def _garbage(t: torch.Tensor) -> None:
    if t.dtype == torch.bool:
        t.logical_not_()
    elif t.is_floating_point() or t.is_complex():
        t.fill_(NAN)
    else:
        t.fill_(10**6)  # an index far out of range


def _assert_grads_equal(grads: dict, ref: dict, *, rel: float = 1e-5) -> None:
    """Both None, or equal within `rel` of the largest reference gradient (1e-5 as
    test_families)."""
    assert set(grads) == set(ref)
    scale = max(float(g.abs().max()) for g in ref.values() if g is not None)
    for name, r in ref.items():
        assert (grads[name] is None) == (r is None), f"{name}: one gradient is None"
        if r is not None:
            diff = float((grads[name] - r).abs().max())
            assert diff <= rel * scale, f"{name}: max abs diff {diff:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", list(CASES))
def test_saved_level_grads_equal_hf_autograd_after_weights_input_and_storages_moved(case, level):
    family, j = CASES[case]
    block = Block(family_config(family), j)
    ref_out, ref_grads = block.reference()
    out, grads = block.saved(level)
    assert torch.equal(out, ref_out)  # the forward's output is the block's real output
    _assert_grads_equal(grads, ref_grads)


def _hook_count(block: Block) -> dict[str, int]:
    """Bytes of the distinct storages autograd saves in block j's forward (a plain graph on
    leaves over `flat`), counted with our own saved_tensors_hooks:

        S1     saved up to the token mixer's return, plus the mixer output's storage
        S2     saved anywhere in the block
        plain  S2 plus the weights, input and kwargs storages it saved (a kept graph's bytes)

    S1 and S2 exclude the storages of the flat weights, the input and the kwargs tensors."""
    flat = block.flat()
    x = block.x.clone().requires_grad_()
    outside = {t.untyped_storage().data_ptr() for t in (flat, x, *_tensors_in(block.kwargs))}
    layer = block.adapter.blocks[block.j]
    mixer = layer.self_attn if hasattr(layer, "self_attn") else layer.linear_attn
    upto, rest, mixer_out, held = {}, {}, {}, []  # storage address -> bytes
    phase = [upto]

    def pack(t):
        held.append(t)  # alive until counted: no storage address is reused
        phase[0][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def mixer_returned(_m, _args, out):
        t = out[0] if isinstance(out, tuple) else out
        held.append(t)
        phase[0] = rest
        mixer_out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    hook = mixer.register_forward_hook(mixer_returned)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block.adapter.forward_block(block.j, x, grad_leaves(block.group, flat),
                                        block.kwargs)
    finally:
        hook.remove()
    everything = {**upto, **rest}
    return {"S1": sum(v for k, v in {**upto, **mixer_out}.items() if k not in outside),
            "S2": sum(v for k, v in everything.items() if k not in outside),
            "plain": sum(everything.values())}


@pytest.mark.parametrize("case", list(CASES))
def test_kept_bytes_equal_a_hook_count_and_l1_keeps_less_than_l2_less_than_a_kept_graph(case):
    family, j = CASES[case]
    block = Block(family_config(family), j)
    counted = _hook_count(block)
    kept = {}
    for level in LEVELS:
        flat = block.flat()
        with torch.no_grad():
            _, saved = forward_saving(block.adapter, j, block.x.clone(),
                                      grad_leaves(block.group, flat), flat, block.kwargs,
                                      level=level)
        assert saved.nbytes == sum(s.numel() for s in saved.storages)
        assert all(s.dtype == torch.uint8 and s.dim() == 1 for s in saved.storages)
        kept[level] = saved
    assert kept["L1"].nbytes == counted["S1"]
    assert kept["L2"].nbytes == counted["S2"]
    assert kept["L1"].nbytes < kept["L2"].nbytes < counted["plain"]
    assert kept["L1"].dropped > 0 and kept["L2"].dropped == 0


@pytest.mark.parametrize("level", LEVELS)
def test_l1_backward_never_unpacks_a_dropped_tensor(level, monkeypatch):
    block = Block(family_config("qwen3_moe"), 1)
    unpacked = []
    original = SavedInternals._unpack

    def recording(self, packed):
        unpacked.append(packed)
        return original(self, packed)

    monkeypatch.setattr(SavedInternals, "_unpack", recording)
    _, grads = block.saved(level)
    _assert_grads_equal(grads, block.reference()[1])
    assert unpacked  # the kept graph was read through the hooks
    assert not any(isinstance(p, st._Dropped) for p in unpacked)


def test_unpacking_a_dropped_tensor_raises():
    with pytest.raises(RuntimeError, match="dropped at save level L1"):
        SavedInternals("L1")._unpack(st._DROPPED)


AUX_CASES = {"qwen3_moe": ("qwen3_moe", 1, 6), "gpt_oss": ("gpt_oss", 0, 4)}  # ..., experts


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", list(AUX_CASES))
def test_router_aux_term_grads_equal_hf_autograd(case, level):
    family, j, experts = AUX_CASES[case]
    block = Block(family_config(family), j)
    aux = RouterAux(num_experts=experts, top_k=2, coef=0.5, attention_mask=block.mask)
    _, grads = block.saved(level, aux=aux)  # observes the forward's logits into `aux`
    _, ref_grads = block.reference(aux=aux)
    _assert_grads_equal(grads, ref_grads)
    _, without = block.reference()
    assert any(float((ref_grads[n] - without[n]).abs().max()) > 1e-3 * float(
        ref_grads[n].abs().max()) for n in ref_grads if ref_grads[n] is not None)


@pytest.mark.parametrize("level", LEVELS)
def test_dropout_after_the_mixer_draws_the_forwards_masks_and_leaves_the_rng(level):
    config = family_config("phi3")
    config.resid_pdrop = config.attention_dropout = 0.3  # in and after the token mixer
    block = Block(config, 1)
    ref_out, ref_grads = block.reference(seed=11)
    block.layer.eval()
    assert not torch.allclose(block.reference()[0], ref_out)  # dropout is on
    block.layer.train()
    out, grads = block.saved(level, seed=11)
    assert torch.equal(out, ref_out)
    _assert_grads_equal(grads, ref_grads)


def test_backward_leaves_the_callers_rng_as_it_was():
    config = family_config("phi3")
    config.resid_pdrop = 0.3
    block = Block(config, 1)
    flat = block.flat()
    with torch.no_grad():
        _, saved = forward_saving(block.adapter, 1, block.x, grad_leaves(block.group, flat),
                                  flat, block.kwargs, level="L1")
    before = torch.get_rng_state()
    backward_saved(block.adapter, 1, saved, block.x, grad_leaves(block.group, flat), flat,
                   block.kwargs, block.grad_out)
    assert torch.equal(torch.get_rng_state(), before)


def test_bad_inputs_raise_naming_the_field():
    block = Block(family_config("llama"), 0)
    flat = block.flat()
    leaves = grad_leaves(block.group, flat)
    with pytest.raises(ValueError, match="save level 'L3'"):
        forward_saving(block.adapter, 0, block.x, leaves, flat, block.kwargs, level="L3")
    with pytest.raises(ValueError, match="not a view of flat"):
        forward_saving(block.adapter, 0, block.x, leaves, flat.clone(), block.kwargs,
                       level="L2")
    with pytest.raises(ValueError, match="mamba: decoder layer Linear"):
        token_mixer(nn.Linear(2, 2), family="mamba")
    with torch.no_grad():
        _, saved = forward_saving(block.adapter, 0, block.x, leaves, flat, block.kwargs,
                                  level="L2")
    with pytest.raises(ValueError, match=r"storages\[0\]"):
        saved.replace_storages([s[:-1] for s in saved.storages])
    with pytest.raises(ValueError, match="got 0 storages"):
        saved.replace_storages([])
    with pytest.raises(ValueError, match="backward_saved: x is"):
        backward_saved(block.adapter, 0, saved, block.x[:, :-1], leaves, flat, block.kwargs,
                       block.grad_out)


GPU_CASES = {"llama": ("llama", 1), "qwen3_next_linear_attention": ("qwen3_next", 0),
             "phi3_dropout": ("phi3", 1)}


@pytest.mark.gpu
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_saved_level_grads_equal_hf_autograd_on_cuda(case, level):
    family, j = GPU_CASES[case]
    config = family_config(family)
    if family == "phi3":
        config.resid_pdrop = config.attention_dropout = 0.3  # the CUDA RNG state is replayed
    block = Block(config, j, device="cuda")
    ref_out, ref_grads = block.reference(seed=11)
    out, grads = block.saved(level, seed=11)
    assert torch.allclose(out, ref_out, rtol=0, atol=1e-5)
    _assert_grads_equal(grads, ref_grads, rel=1e-4)  # CUDA kernels may reorder sums
