"""Both sides of the plan/runtime contract equal `lazytrain.contract`: the runtime's objects
built with their defaults (what they allocate, counted here from the tensors), and the
planner's memory model on the seed config. Each test fails when one side changes a number
alone; the expected values are the documented ones (4 weight slots, 16 / 12 B per parameter,
4 KiB), written out by hand."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from lazytrain import contract
from lazytrain.config import RuntimeConfig, load_config
from lazytrain.models.host_params import HostParams
from lazytrain.planner import chains
from lazytrain.planner.build import problem_from_config
from lazytrain.planner.plan import Transfer
from lazytrain.planner.windows import TRANSFER_KINDS, window_names, window_ord
from lazytrain.planner.staging import staging_by_window
from lazytrain.runtime import engine, nvme
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.device import Device
from lazytrain.runtime.ends import ResidentEnds
from lazytrain.runtime.optim import BlockOptimizer
from lazytrain.runtime.streams import DeviceWeights, GradDrain, StagingPool
from lazytrain.sim import SimOptions
from lazytrain.spec.costs import analytic_costs, profile_costs

SEED = "configs/qwen3.6-27b-h800.yaml"
LARGEST_BLOCK = 8 * 4
"""Elements of the largest block of `_host_params` (block 0: an [8, 4] weight)."""


def _host_params(master_dtype: str = "fp32") -> HostParams:
    """Two blocks (32 and 27 elements) and the ends (40 elements)."""
    return HostParams([{"w": (8, 4)}, {"w": (6, 4), "b": (3,)}],
                      ["model.layers.0.", "model.layers.1."], {"embed": (10, 4)},
                      master_dtype=master_dtype)


@pytest.fixture
def dev():
    device = Device()
    yield device
    device.close()


# --- device buffers --------------------------------------------------------------------------


def test_the_default_weight_ring_and_its_staging_are_the_contracts(dev):
    weights = DeviceWeights(_host_params(), dev, torch.bfloat16)
    try:
        assert len(weights.slots) == contract.DEVICE_WEIGHT_SLOTS == 4
        assert len(weights.staging.buffers) == contract.WEIGHT_STAGING_BUFFERS == 4
        # each one the largest block, as the planner counts max P per slot and per buffer
        assert {s.numel() for s in weights.slots} == {LARGEST_BLOCK}
        assert {b.numel() for b in weights.staging.buffers} == {LARGEST_BLOCK}
    finally:
        weights.close()
    pool = StagingPool(LARGEST_BLOCK, torch.bfloat16, device=dev)
    assert len(pool.buffers) == contract.WEIGHT_STAGING_BUFFERS


def test_the_default_gradient_drain_has_the_contracts_buffers(dev):
    drain = GradDrain(dev, LARGEST_BLOCK, dtype=torch.bfloat16)
    try:
        assert len(drain.buffers) == contract.GRAD_DRAIN_BUFFERS == 2
        assert {b.numel() for b in drain.buffers} == {LARGEST_BLOCK}
    finally:
        drain.close()


def test_the_ends_gradient_has_the_contracts_bytes_per_parameter(dev):
    params = _host_params()
    ends = ResidentEnds(SimpleNamespace(params=params), dev, dtype=torch.bfloat16,
                        head_chunk_tokens=contract.HEAD_CHUNK_TOKENS)
    ends.reset_gradient()
    assert ends.grad.numel() == params.ends.numel == 40
    assert ends.grad.element_size() == contract.ENDS_GRAD_BYTES_PER_PARAM == 4


def test_the_head_chunk_default_is_the_contracts_on_both_sides():
    assert contract.HEAD_CHUNK_TOKENS == 1024
    assert RuntimeConfig().head_chunk_tokens == contract.HEAD_CHUNK_TOKENS
    defaults = [inspect.signature(f).parameters["head_chunk_tokens"].default
                for f in (make_engine, analytic_costs, profile_costs)]
    assert defaults == [contract.HEAD_CHUNK_TOKENS] * 3


def test_the_simulator_defaults_are_the_contracts_buffers():
    opts = SimOptions()
    assert (opts.weight_buffers, opts.grad_buffers) == (contract.DEVICE_WEIGHT_SLOTS,
                                                        contract.DEVICE_GRAD_BUFFERS)


# --- host state ------------------------------------------------------------------------------


def _moment_bytes_per_param(opt: BlockOptimizer, group) -> float:
    """Bytes of the optimizer state tensors of `group` that hold one value per parameter."""
    state = opt.optims[group.name].state
    total = sum(t.numel() * t.element_size() for st in state.values() for k, t in st.items()
                if isinstance(t, torch.Tensor) and k in ("exp_avg", "exp_avg_sq", "state1",
                                                         "state2"))
    return total / group.numel


@pytest.mark.parametrize(("master_dtype", "expected"), [("fp32", 16), ("bf16", 12)])
def test_host_bytes_per_parameter_are_what_the_runtime_allocates(master_dtype, expected):
    params = _host_params(master_dtype)
    opt = BlockOptimizer(params, lr=1e-3)
    try:
        group = params.blocks[0]
        group.grad.fill_(0.25)
        opt.submit(group, lr=1e-3)
        opt.wait_all()
        host = (group.master.element_size() + group.grad.element_size()
                + _moment_bytes_per_param(opt, group))
        assert host == contract.HOST_BYTES_PER_PARAM[master_dtype] == expected
        assert group.master.element_size() == contract.MASTER_BYTES[master_dtype]
        if master_dtype == "bf16":  # the fp32 [2, largest group] scratch; the ends are largest
            scratch = opt.scratch.numel() * opt.scratch.element_size()
            assert scratch == contract.OPTIMIZER_SCRATCH_BYTES_PER_PARAM * 40
        else:
            assert opt.scratch is None
    finally:
        opt.close()


@pytest.mark.parametrize(("master_dtype", "expected"), [("fp32", 10), ("bf16", 6)])
def test_host_bytes_per_parameter_with_8bit_moments(master_dtype, expected):
    pytest.importorskip("bitsandbytes")
    params = _host_params(master_dtype)
    opt = BlockOptimizer(params, lr=1e-3, q8_blocks=(0,))
    try:
        group = params.blocks[0]
        group.grad.fill_(0.25)
        opt.submit(group, lr=1e-3)
        opt.wait_all()
        host = (group.master.element_size() + group.grad.element_size()
                + _moment_bytes_per_param(opt, group))
        assert host == contract.HOST_BYTES_PER_PARAM_Q8[master_dtype] == expected
    finally:
        opt.close()


# --- the planner's memory model --------------------------------------------------------------


def test_the_planners_fixed_bytes_count_the_contracts_buffers(repo_root, shared_dir):
    p = problem_from_config(load_config(repo_root / SEED))  # bf16 compute and masters
    mem = p.provenance["memory"]
    max_p, max_g, a = max(p.weight_bytes), max(p.grad_bytes), max(p.boundary_bytes)
    assert mem["weight_buffers_bytes"] == 4 * max_p
    assert mem["grad_buffers_bytes"] == 2 * max_g
    assert mem["ends_bytes"] == (2 + 4) * p.ends_params  # bf16 weights, fp32 gradient
    assert mem["weight_pool_bytes"] == 4 * max_p
    assert mem["grad_landing_bytes"] == 2 * max_g
    assert mem["nvme_bounce_bytes"] == 2 * (-(-a // 4096) * 4096)
    assert p.host_bytes_per_param == 12 and p.host_bytes_per_param_q8 == 6
    largest = max(max(p.params_per_block), p.ends_params)
    assert mem["optimizer_scratch_bytes"] == 8 * largest


# --- NVMe alignment, transfer order, window names ------------------------------------------


def test_the_nvme_alignment_is_the_contracts_on_both_sides():
    assert nvme.ALIGN_BYTES == contract.ALIGN_BYTES == 4096
    assert nvme.aligned_empty(100).data_ptr() % 4096 == 0
    assert [contract.align_up(n) for n in (0, 1, 4096, 5000.5)] == [0, 4096, 4096, 8192]
    # planner: boundary 1 (5000 B, nvme tier) out in f1..turn, back in b1: one 8 KiB buffer
    transfers = [Transfer(boundary=1, kind="d2h", window="f1", fraction=1.0),
                 Transfer(boundary=1, kind="nvme_write", window="turn", fraction=1.0),
                 Transfer(boundary=1, kind="nvme_read", window="b1", fraction=1.0),
                 Transfer(boundary=1, kind="h2d", window="b1", fraction=1.0)]
    held = staging_by_window([5000] * 3, ["hbm", "nvme", "hbm"], transfers, 2)
    assert held == [0, 8192, 8192, 8192, 0]


def test_both_sides_issue_transfers_in_the_contracts_order():
    assert contract.TRANSFER_ORDER == ("d2h", "nvme_write", "nvme_read", "h2d")
    assert sorted(contract.TRANSFER_ORDER) == sorted(TRANSFER_KINDS)
    # the same object on both sides: neither restates the order
    assert engine.TRANSFER_ORDER is contract.TRANSFER_ORDER
    assert chains.TRANSFER_ORDER is contract.TRANSFER_ORDER


def test_the_plans_window_names_are_the_contracts_spelling():
    assert window_names(2) == ["f0", "f1", "turn", "b1", "b0"]
    assert [contract.forward_window(0), contract.TURN_WINDOW, contract.backward_window(1)] == [
        "f0", "turn", "b1"]
    assert [window_ord(name, 3) for name in window_names(3)] == list(range(7))
