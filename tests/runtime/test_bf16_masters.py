"""bf16 master weights (`train.master_dtype: bf16`, MegaTrain's 12 B/param host layout).

References (independent of the engine): an fp32 HF model holding the same bf16-representable
weights, run with plain autograd one micro-batch at a time; its gradients are accumulated as
the layout prescribes (the first micro-batch's gradient rounded to bf16, each further one added
in fp32 and the sum rounded); the update is torch's fused AdamW on fp32 copies of those values
with fp32 moments, the result rounded to bf16 after every step.

Tolerance: the engine's fp32 gradient and HF's may differ in the last fp32 bits (another
summation order), and with clipping the two global norms do (another reduction order), so an
element can round to the neighbouring bf16 value: one bf16 step is 2^-7 relative, plus a small
absolute term for values near zero. Nearly every element must match exactly (asserted: >=
MIN_EXACT_FRACTION; measured on torch 2.13 CPU: gradients and unclipped steps 100 %, the
clipped steps 99.8 %).
"""

from __future__ import annotations

import copy
import io
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_helpers import micro_batches, plan_for, tiny_config
from lazytrain.models import adapter_from_model
from lazytrain.planner.build import HOST_BYTES_PER_PARAM, HOST_BYTES_PER_PARAM_Q8
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.engine import Engine
from lazytrain.runtime.optim import BlockOptimizer, lr_at
from lazytrain.models.host_params import HostParams

R, H, D, N = "recompute", "hbm", "dram", "nvme"
TIERS, KEEP = [N, R, R, D, H], (2, 3)  # NVMe, a recomputed segment and kept internals
BF16_STEP = 2.0 ** -7
"""One bf16 step relative to the value (8 significand bits)."""
MIN_EXACT_FRACTION = 0.99
"""Elements that must equal the bf16 reference exactly (the rest differ by one bf16 step)."""


def bf16_pair(config, *, seed: int = 0):
    """(fp32 reference HF model, adapter with bf16 masters) holding the same weights: the
    random init rounded to bf16, so both sides start from identical values."""
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    twin = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    twin.load_state_dict(copy.deepcopy(ref.state_dict()))
    ref.train()
    return ref, adapter_from_model(twin, master_dtype="bf16")


def bf16_accumulated_grads(ref, batches: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain HF autograd per micro-batch (loss normalised by every label token of the step),
    accumulated as the layout does: a block's in bf16, rounded per micro-batch; the ends'
    (embedding, final norm, head: no `.layers.` in the name) in fp32 on the device over the
    step, rounded once. Returns (loss, HF name -> bf16 gradient)."""
    n = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    acc: dict[str, torch.Tensor] = {}
    total = 0.0
    for k, b in enumerate(batches):
        ref.zero_grad(set_to_none=True)
        out = ref(**b, use_cache=False, num_items_in_batch=torch.tensor(n))
        out.loss.backward()
        total += float(out.loss.detach())
        for name, p in ref.named_parameters():
            dtype = torch.bfloat16 if ".layers." in name else torch.float32
            acc[name] = (p.grad if k == 0 else acc[name].float() + p.grad).to(dtype)
    ref.zero_grad(set_to_none=True)
    return total, {name: g.bfloat16() for name, g in acc.items()}


def _assert_bf16_close(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], *,
                       atol_rel: float) -> None:
    """Every tensor within one bf16 step of the reference (plus `atol_rel` x the largest
    magnitude for values near zero), and nearly every element exactly equal."""
    assert set(mine) == set(ref)
    scale = max(float(t.abs().max()) for t in ref.values())
    exact = total = 0
    for name, r in ref.items():
        m = mine[name].float()
        torch.testing.assert_close(m, r.float(), rtol=BF16_STEP, atol=atol_rel * scale,
                                   msg=lambda s, name=name: f"{name}: {s}")
        exact += int((m == r.float()).sum())
        total += r.numel()
    assert exact >= MIN_EXACT_FRACTION * total, f"only {exact} of {total} elements exact"


def test_bf16_masters_from_an_allocator_are_views_of_its_bf16_buffer():
    asked = []

    def allocate(numel: int, dtype: torch.dtype) -> torch.Tensor:  # as a node-shared mapping
        asked.append((numel, dtype))
        return torch.zeros(numel, dtype=dtype)

    store = HostParams([{"a": (2, 3)}], ["layers.0."], {"emb": (5, 2)}, master_dtype="bf16",
                       masters=allocate)
    assert asked == [(6 + 10, torch.bfloat16)]
    assert store.ends.master.data_ptr() == store.blocks[0].master.data_ptr() + 6 * 2  # bytes
    assert store.ends.grad.dtype == torch.bfloat16


def _engine(adapter, tmp_path, *, grad_accum: int = 1, **kw) -> Engine:
    plan = plan_for(adapter, TIERS, KEEP, grad_accum=grad_accum)
    return make_engine(adapter, plan, device="cpu", nvme_dir=tmp_path / "nvme",
                       grad_accum=grad_accum, **kw)


@pytest.mark.parametrize("n_micro,tied", [(1, False), (2, False), (1, True)],
                         ids=["one_micro_batch", "grad_accum_2", "tied_embeddings"])
def test_bf16_gradient_accumulator_equals_autograd_rounded_to_bf16(n_micro, tied, tmp_path):
    ref, adapter = bf16_pair(tiny_config("llama", tied=tied))
    engine = _engine(adapter, tmp_path, grad_accum=n_micro)
    batches = micro_batches(n_micro)
    try:
        loss = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    ref_loss, ref_grads = bf16_accumulated_grads(ref, batches)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert all(g.dtype == torch.bfloat16 for g in grads.values())
    if tied:  # HF lists the tied head once, as the embedding; both sides sum the two uses
        assert "lm_head.weight" not in grads and "lm_head.weight" not in ref_grads
    _assert_bf16_close(grads, ref_grads, atol_rel=1e-5)


@pytest.mark.parametrize("clip", [None, 0.5], ids=["no_clip", "clip_0.5"])
def test_three_bf16_engine_steps_match_fp32_adamw_rounded_to_bf16(clip, tmp_path):
    ref, adapter = bf16_pair(tiny_config("llama"))
    start = {k: v.detach().clone() for k, v in ref.named_parameters()}
    lrs = [lr_at(s, base_lr=1e-2, warmup_steps=1, total_steps=3) for s in range(3)]
    engine = _engine(adapter, tmp_path, grad_accum=2, lr=1e-2, weight_decay=0.01,
                     clip_grad_norm=clip)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    try:
        for step, lr in enumerate(lrs):
            batches = micro_batches(2, seed=10 + step)
            engine.step(batches, lr=lr)
            _, grads = bf16_accumulated_grads(ref, batches)
            for name, p in ref.named_parameters():
                p.grad = grads[name].float()
            if clip:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
            with torch.no_grad():
                for p in ref.parameters():
                    p.copy_(p.bfloat16().float())  # the bf16 master after the step
        mine = engine.named_parameters_fp32()
    finally:
        engine.close()
    theirs = {k: p.detach() for k, p in ref.named_parameters()}
    assert all(t.dtype == torch.float32 for t in mine.values())
    assert all(torch.equal(t, t.bfloat16().float()) for t in mine.values())  # bf16 values
    moved = sum(int((theirs[k] != start[k]).sum()) for k in theirs)
    assert moved > 0.9 * sum(t.numel() for t in theirs.values())  # the steps really move
    _assert_bf16_close(mine, theirs, atol_rel=1e-4)


@pytest.mark.parametrize("master_dtype", ["fp32", "bf16"])
def test_host_bytes_per_param_after_a_step_match_the_planner(master_dtype, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=2), dtype=torch.float32)
    adapter = adapter_from_model(model, master_dtype=master_dtype)
    plan = plan_for(adapter, [H, H, H])
    engine = make_engine(adapter, plan, device="cpu", nvme_dir=tmp_path / "nvme", lr=1e-3)
    try:
        engine.step(micro_batches(1))
        engine.optimizer.wait_all()
        params, nbytes = adapter.params, 0
        for g in params.groups:
            nbytes += g.master.numel() * g.master.element_size()
            nbytes += g.grad.numel() * g.grad.element_size()
            (state,) = engine.optimizer.optims[g.name].state.values()
            for key in ("exp_avg", "exp_avg_sq"):
                assert state[key].dtype == torch.float32 and state[key].numel() == g.numel
                nbytes += state[key].numel() * state[key].element_size()
        assert nbytes == HOST_BYTES_PER_PARAM[master_dtype] * params.total_numel()
        scratch = engine.optimizer.scratch
        if master_dtype == "fp32":
            assert scratch is None
        else:  # one shared transient: 8 B per element of the largest group, not per parameter
            assert scratch.dtype == torch.float32
            assert scratch.numel() == 2 * max(g.numel for g in params.groups)
    finally:
        engine.close()


def test_bf16_resume_from_state_dict_and_fp32_weights_equals_straight_run_bit_for_bit(tmp_path):
    config = tiny_config("llama")
    batches = [micro_batches(1, seed=20 + s) for s in range(4)]
    kw = dict(lr=1e-2, weight_decay=0.01, clip_grad_norm=1.0)

    _, adapter = bf16_pair(config)
    straight = _engine(adapter, tmp_path / "a", **kw)
    try:
        for b in batches:
            straight.step(b)
        expected = straight.named_parameters_fp32()
    finally:
        straight.close()

    _, adapter = bf16_pair(config)
    first = _engine(adapter, tmp_path / "b", **kw)
    try:
        for b in batches[:2]:
            first.step(b)
        buf = io.BytesIO()  # as a checkpoint: fp32 weights + torch.save'd engine state
        torch.save(first.state_dict(), buf)
        weights = {k: v.clone() for k, v in first.named_parameters_fp32().items()}
    finally:
        first.close()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(weights)
    resumed_adapter = adapter_from_model(model, master_dtype="bf16")  # fp32 -> bf16: exact
    resumed = _engine(resumed_adapter, tmp_path / "c", **kw)
    try:
        buf.seek(0)
        resumed.load_state_dict(torch.load(buf, weights_only=False))
        for b in batches[2:]:
            resumed.step(b)
        got = resumed.named_parameters_fp32()
    finally:
        resumed.close()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_8bit_moments_with_bf16_masters_step_through_the_fp32_scratch():
    bnb = pytest.importorskip("bitsandbytes", reason="8-bit optimizer states need the q8 extra")
    params = HostParams([{"w": (3000,)}, {"w": (3000,)}], ["a.", "b."], {"c": (7,)},
                        master_dtype="bf16")
    g = torch.Generator().manual_seed(3)
    for grp in params.groups:
        grp.master.copy_(torch.randn(grp.numel, generator=g))
    # reference for block 1: bitsandbytes' 8-bit AdamW on an fp32 copy, rounded to bf16
    ref = torch.nn.Parameter(params.blocks[1].master.float())
    ref_opt = bnb.optim.AdamW8bit([ref], lr=1e-2, weight_decay=0.01, min_8bit_size=1)
    opt = BlockOptimizer(params, lr=1e-2, weight_decay=0.01, q8_blocks=(1,))
    try:
        for step in range(3):
            for grp in params.groups:
                grp.grad.copy_(torch.randn(grp.numel, generator=g))
                opt.submit(grp, lr=1e-2)
            ref.grad = params.blocks[1].grad.float()
            ref_opt.step()
            with torch.no_grad():
                ref.copy_(ref.bfloat16().float())
            opt.wait_all()
            assert torch.equal(params.blocks[1].master.float(), ref.detach()), step
        state = next(iter(opt.optims["block1"].state.values()))
        assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8
        q8_bytes = sum(t.numel() * t.element_size() for t in (state["state1"], state["state2"]))
        blk = params.blocks[1]
        # master + grad + uint8 moments (the planner neglects the fp32 absmax per 256 values)
        host = 2 * blk.numel * blk.master.element_size() + q8_bytes
        assert host == HOST_BYTES_PER_PARAM_Q8["bf16"] * blk.numel
    finally:
        opt.close()


def test_lazytrain_train_with_bf16_masters_runs_the_tiny_config(repo_root, tmp_path, capsys):
    from lazytrain.cli.main import main
    from safetensors.torch import load_file
    from lazytrain.train.checkpoint import latest_checkpoint

    run_dir = tmp_path / "run"
    assert main(["train", "--config", str(repo_root / "configs" / "tiny-llama-cpu.yaml"),
                 "--run-dir", str(run_dir), "--set", "train.master_dtype=bf16",
                 "--set", "model.dtype=bf16", "--set", "data.num_eval=0",
                 "--no-progress"]) == 0
    assert "done: 3 steps" in capsys.readouterr().out
    losses = [json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    weights = load_file(str(latest_checkpoint(run_dir).path / "model.safetensors"))
    # model.dtype bf16 over bf16 masters: saved as the masters themselves (2 B per parameter)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())


def test_a_bf16_block_switched_to_8bit_and_back_keeps_its_moments_up_to_quantization():
    pytest.importorskip("bitsandbytes", reason="8-bit optimizer states need the q8 extra")
    from lazytrain.runtime import optim8bit
    params = HostParams([{"w": (3000,)}, {"w": (3000,)}], ["a.", "b."], {"c": (7,)},
                        master_dtype="bf16")
    g = torch.Generator().manual_seed(5)
    opt = BlockOptimizer(params, lr=1e-2)
    try:
        for _ in range(3):
            for grp in params.groups:
                grp.grad.copy_(torch.randn(grp.numel, generator=g))
                opt.submit(grp, lr=1e-2)
            opt.wait_all()
        st = opt.optims["block0"].state[opt.stepped["block0"]]
        m = st["exp_avg"].clone()
        opt.set_q8_blocks((0,))
        m8, _, step = optim8bit.moments_from_q8(opt.optims["block0"])
        assert step == 3
        # dynamic 8-bit map: relative error of a value near its block's absmax is about 1 %
        assert float((m8 - m).abs().max()) <= 0.02 * float(m.abs().max())
        opt.set_q8_blocks(())
        st = opt.optims["block0"].state[opt.stepped["block0"]]
        torch.testing.assert_close(st["exp_avg"], m8)
        assert int(st["step"]) == 3
        before = params.blocks[0].master.clone()
        opt.submit(params.blocks[0], lr=1e-2)  # the fused fp32 optimizer takes the state
        opt.wait_all()
        assert not torch.equal(params.blocks[0].master, before)
    finally:
        opt.close()
