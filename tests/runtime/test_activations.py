"""ActivationStore on CPU: bit-exact round trips per tier, per-window accounting against hand
arithmetic, the HBM budget check, and refusing partial data."""

from __future__ import annotations

import pytest
import torch

from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.device import Device
from lazytrain.runtime.errors import (
    CheckpointNotResidentError,
    HbmBudgetExceeded,
    TransferOrderError,
)
from lazytrain.runtime.nvme import supports_o_direct

CPU = torch.device("cpu")
SMALL_CHUNK_BYTES = 8192  # several NVMe requests per boundary in every test


def make_store(tmp_path, **kwargs) -> ActivationStore:
    kwargs.setdefault("chunk_bytes", SMALL_CHUNK_BYTES)
    return ActivationStore(device=CPU, nvme_dir=tmp_path / "nvme", **kwargs)


def boundary_tensor(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[3, 5, 1001] activations: 15015 elements, 60060 B (fp32) / 30030 B (bf16), neither a
    multiple of 4 KiB."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, 5, 1001, generator=gen).to(dtype)


def direct_modes():
    return [pytest.param(False, id="buffered"), pytest.param(True, id="o_direct")]


def require_direct(direct: bool, tmp_path) -> None:
    if direct and not supports_o_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tier", ["hbm", "recompute", "dram", "nvme"])
@pytest.mark.parametrize("direct", direct_modes())
def test_boundary_round_trips_bit_exact_through_each_tier_with_split_fractions(tmp_path, tier, dtype, direct):
    require_direct(direct, tmp_path)
    tensor = boundary_tensor(dtype)
    reference = tensor.clone()
    with make_store(tmp_path, direct=direct) as store:
        store.begin_window("f1")
        store.put(1, tensor, tier)
        if tier in ("dram", "nvme"):
            store.transfer(1, "d2h", 0.3)
        if tier == "nvme":
            store.transfer(1, "nvme_write", 0.3)
        store.end_window()
        store.begin_window("f2")
        if tier in ("dram", "nvme"):
            store.transfer(1, "d2h", 0.7)
        if tier == "nvme":
            store.transfer(1, "nvme_write", 0.7)
        store.end_window()
        store.begin_window("b3")
        if tier == "nvme":
            store.transfer(1, "nvme_read", 0.4)
        if tier in ("dram", "nvme"):
            store.transfer(1, "h2d", 0.4)
        store.end_window()
        store.begin_window("b2")
        if tier == "nvme":
            store.transfer(1, "nvme_read", 0.6)
        if tier in ("dram", "nvme"):
            store.transfer(1, "h2d", 0.6)
        store.end_window()
        store.begin_window("b1")
        out = store.get(1)
        assert out.dtype == dtype and out.shape == reference.shape
        # Bit-exact: compare the raw bytes, not values.
        assert torch.equal(out.view(torch.uint8 if dtype == torch.bfloat16 else torch.int32),
                           reference.view(torch.uint8 if dtype == torch.bfloat16 else torch.int32))
        store.release(1)
        store.end_window()
        assert store.bytes_by_tier() == {"hbm": 0, "dram": 0, "dram_staging": 0, "nvme": 0}


def test_nvme_write_and_read_in_the_same_window_as_d2h_and_h2d_round_trip(tmp_path):
    # The contract allows a whole chain in one window (cumulative precedence, same window).
    tensor = boundary_tensor(torch.float32, seed=1)
    reference = tensor.clone()
    with make_store(tmp_path) as store:
        store.begin_window("f0")
        store.put(0, tensor, "nvme")
        for kind in ("d2h", "nvme_write", "nvme_read", "h2d"):
            store.transfer(0, kind, 0.5)
        store.end_window()
        store.begin_window("f1")
        for kind in ("d2h", "nvme_write", "nvme_read", "h2d"):
            store.transfer(0, kind, 0.5)
        store.end_window()
        assert torch.equal(store.get(0), reference)


def test_accounting_per_window_matches_hand_arithmetic_for_a_three_block_script(tmp_path):
    # L = 3 blocks; windows f0 f1 f2 turn b2 b1 b0 (ord 0..6). Every boundary is 1000 fp32
    # = 4000 B; an NVMe file / staging buffer is padded to 4096 B.
    # Tiers: boundary 0 dram, 1 recompute (segment (0, 2)), 2 nvme (segment (2, 3)), 3 hbm.
    a = 4000
    pad = 4096
    t = [torch.full((1000,), float(i)) for i in range(4)]
    expected = {
        # f0: b0 in HBM (4000) + its DRAM copy from the first d2h (4000).
        "f0": {"hbm": a, "dram": a, "dram_staging": 0, "nvme": 0},
        # f1: d2h of b0 completes; its HBM copy is released only at the window's end.
        "f1": {"hbm": a, "dram": a, "dram_staging": 0, "nvme": 0},
        # f2: b2 put (4000 HBM) + staging (4096) + file (4096); b0 still in DRAM.
        "f2": {"hbm": a, "dram": a, "dram_staging": pad, "nvme": pad},
        # turn: b3 (4000) + prefetched b2 (4000) + prefetched b0 (4000) = 12000 HBM;
        # staging re-acquired for the read (4096); b0's DRAM copy until the barrier.
        "turn": {"hbm": 3 * a, "dram": a, "dram_staging": pad, "nvme": pad},
        # b2: b2 + b0 device copies = 8000; the file lives until b2 is released.
        "b2": {"hbm": 2 * a, "dram": 0, "dram_staging": 0, "nvme": pad},
        # b1: b0 (4000) + recompute cache b1 (4000) = 8000.
        "b1": {"hbm": 2 * a, "dram": 0, "dram_staging": 0, "nvme": 0},
        # b0: b0 only.
        "b0": {"hbm": a, "dram": 0, "dram_staging": 0, "nvme": 0},
    }
    limits = {w: p["hbm"] for w, p in expected.items()}
    with make_store(tmp_path, hbm_limits=limits) as store:
        store.begin_window("f0")
        store.put(0, t[0], "dram")
        store.transfer(0, "d2h", 0.5)
        store.end_window()
        store.begin_window("f1")
        store.transfer(0, "d2h", 0.5)
        store.end_window()
        store.begin_window("f2")
        store.put(2, t[2], "nvme")
        store.transfer(2, "d2h", 1.0)
        store.transfer(2, "nvme_write", 1.0)
        store.end_window()
        store.begin_window("turn")
        store.put(3, t[3], "hbm")
        store.transfer(2, "nvme_read", 1.0)
        store.transfer(2, "h2d", 1.0)
        store.transfer(0, "h2d", 1.0)
        assert torch.equal(store.get(3), t[3])
        store.release(3)
        store.end_window()
        store.begin_window("b2")
        assert torch.equal(store.get(2), t[2])
        store.release(2)
        store.end_window()
        store.begin_window("b1")
        assert torch.equal(store.get(0), t[0])
        store.put(1, t[1], "recompute")
        assert torch.equal(store.get(1), t[1])
        store.release(1)
        store.end_window()
        store.begin_window("b0")
        assert torch.equal(store.get(0), t[0])
        store.release(0)
        store.end_window()
        assert store.peak_by_window() == expected
        assert store.bytes_by_tier() == {"hbm": 0, "dram": 0, "dram_staging": 0, "nvme": 0}
        # Moved bytes: d2h 2000 + 2000 of b0, 4000 of b2; nvme kinds move the padded 4096.
        moved = store.bytes_moved_by_window()
        assert moved["f0"]["d2h"] == 2000 and moved["f1"]["d2h"] == 2000
        assert moved["f2"] == {"d2h": a, "nvme_write": pad, "nvme_read": 0, "h2d": 0}
        assert moved["turn"] == {"d2h": 0, "nvme_write": 0, "nvme_read": pad, "h2d": 2 * a}


def test_put_over_the_window_hbm_limit_raises_naming_window_bytes_and_limit(tmp_path):
    with make_store(tmp_path, hbm_limits={"f0": 3999}) as store:
        store.begin_window("f0")
        with pytest.raises(HbmBudgetExceeded, match="window f0.*4000 HBM bytes.*3999") as info:
            store.put(0, torch.zeros(1000), "hbm")
        assert (info.value.window, info.value.held_bytes, info.value.limit_bytes) == ("f0", 4000, 3999)


def test_first_h2d_fraction_counts_the_whole_device_buffer_against_the_limit(tmp_path):
    # b0 is drained in f0; in b1 (limit 3000) the first h2d allocates all 4000 B at once.
    with make_store(tmp_path, hbm_limits={"f0": 4000, "b1": 3000}) as store:
        store.begin_window("f0")
        store.put(0, torch.zeros(1000), "dram")
        store.transfer(0, "d2h", 1.0)
        store.end_window()
        store.begin_window("b1")
        with pytest.raises(HbmBudgetExceeded, match="window b1"):
            store.transfer(0, "h2d", 0.1)


def test_bytes_carried_into_a_window_over_its_limit_raise_at_window_start(tmp_path):
    with make_store(tmp_path, hbm_limits={"f1": 100}) as store:
        store.put(1, torch.zeros(1000), "hbm")
        with pytest.raises(HbmBudgetExceeded, match="at window start"):
            store.begin_window("f1")


@pytest.mark.parametrize("h2d_fraction", [None, 0.5], ids=["no_prefetch", "half_prefetch"])
@pytest.mark.parametrize("tier", ["dram", "nvme"])
def test_get_before_the_prefetch_completes_raises_instead_of_partial_data(tmp_path, tier, h2d_fraction):
    with make_store(tmp_path) as store:
        store.begin_window("f4")
        store.put(4, torch.ones(1000), tier)
        store.transfer(4, "d2h", 1.0)
        if tier == "nvme":
            store.transfer(4, "nvme_write", 1.0)
        store.end_window()
        store.begin_window("b5")
        if tier == "nvme":
            store.transfer(4, "nvme_read", 1.0)
        if h2d_fraction is not None:
            store.transfer(4, "h2d", h2d_fraction)
        store.end_window()
        store.begin_window("b4")
        with pytest.raises(CheckpointNotResidentError, match="boundary 4 .* not resident") as info:
            store.get(4)
        assert info.value.boundary == 4


def test_last_nvme_write_fraction_before_the_d2h_completed_is_refused(tmp_path):
    with make_store(tmp_path) as store:
        store.begin_window("f2")
        store.put(2, torch.ones(1000), "nvme")
        store.transfer(2, "d2h", 0.5)
        with pytest.raises(TransferOrderError, match="boundary 2 .*before d2h completed"):
            store.transfer(2, "nvme_write", 1.0)


def test_h2d_while_the_hbm_copy_is_still_held_adopts_it_and_counts_it_once(tmp_path):
    # Short segment near the turn: d2h and h2d of boundary 2 both in window f2 (legal). The
    # execution model holds it once over [2, 2L-2]; a second device buffer would double it.
    tensor = torch.arange(1000, dtype=torch.float32)
    reference = tensor.clone()
    with make_store(tmp_path, hbm_limits={"f2": 4000, "turn": 4000}) as store:
        store.begin_window("f2")
        store.put(2, tensor, "dram")
        store.transfer(2, "d2h", 1.0)
        store.transfer(2, "h2d", 1.0)
        store.end_window()
        store.begin_window("turn")
        assert store.bytes_by_tier() == {"hbm": 4000, "dram": 0, "dram_staging": 0, "nvme": 0}
        assert torch.equal(store.get(2), reference)
        store.end_window()
        assert store.bytes_moved_by_window()["f2"] == {"d2h": 4000, "nvme_write": 0, "nvme_read": 0, "h2d": 0}


def test_transfer_kind_not_valid_for_the_tier_is_refused(tmp_path):
    with make_store(tmp_path) as store:
        store.begin_window("f0")
        store.put(0, torch.ones(10), "dram")
        with pytest.raises(ValueError, match="nvme_write.*not valid for tier 'dram'"):
            store.transfer(0, "nvme_write", 1.0)
        store.put(1, torch.ones(10), "hbm")
        with pytest.raises(ValueError, match="not valid for tier 'hbm'"):
            store.transfer(1, "d2h", 1.0)


def test_fractions_summing_past_one_are_refused(tmp_path):
    with make_store(tmp_path) as store:
        store.begin_window("f0")
        store.put(0, torch.ones(10), "dram")
        store.transfer(0, "d2h", 0.6)
        with pytest.raises(ValueError, match="sum to 1.2"):
            store.transfer(0, "d2h", 0.6)


def test_peaks_are_kept_per_window_across_micro_batches_and_reset_on_request(tmp_path):
    with make_store(tmp_path) as store:
        for micro_batch, numel in ((0, 1000), (1, 500)):
            store.begin_window("f0")
            store.put(0, torch.zeros(numel), "hbm", micro_batch=micro_batch)
            store.end_window()
            store.release(0, micro_batch=micro_batch)
        # Window f0 entered twice: the peak is the larger micro-batch (1000 fp32 = 4000 B).
        assert store.peak_by_window()["f0"]["hbm"] == 4000
        store.reset_peaks()
        assert store.peak_by_window() == {}


# ---- cross-check with the planner's accounting of the execution model ------------------------

PLAN_TIERS = {
    # L = 4; boundary 4 is always hbm.
    "all_dram": ("dram", "dram", "dram", "dram", "hbm"),
    "all_nvme": ("nvme", "nvme", "nvme", "nvme", "hbm"),
    "mixed": ("recompute", "nvme", "recompute", "dram", "hbm"),
    "segments_of_2": ("hbm", "recompute", "dram", "recompute", "hbm"),
}


def tiny_problem():
    from lazytrain.planner.problem import PlanningProblem

    L = 4
    return PlanningProblem(
        fwd_ms=(1.0,) * L, fwd_grad_ms=(1.2,) * L, bwd_ms=(2.0,) * L,
        weight_bytes=(10**6,) * L, grad_bytes=(10**6,) * L, internal_bytes=(10**5,) * L,
        # Distinct, not 4 KiB multiples: 1000*(i+1) fp32 elements.
        boundary_bytes=tuple(4000 * (i + 1) for i in range(L + 1)), params_per_block=(10**5,) * L,
        h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, duplex_bytes_per_s=1.5e9,
        nvme_read_bytes_per_s=5e8, nvme_write_bytes_per_s=5e8,
        hbm_bytes=10**9, dram_bytes=10**10, nvme_bytes=10**10,
        drain_windows=2, prefetch_windows=2, nvme_lead_windows=1,
    )


def run_plan_protocol(store: ActivationStore, plan, tensors: list[torch.Tensor]) -> None:
    """The execution model's call protocol for one micro-batch (what the engine does)."""
    from lazytrain.runtime.activations import TRANSFER_ORDER

    L = plan.num_blocks

    def issue(window: str) -> None:
        for t in sorted(plan.transfers_in(window), key=lambda t: TRANSFER_ORDER.index(t.kind)):
            store.transfer(t.boundary, t.kind, t.fraction)

    for j in range(L):
        store.begin_window(f"f{j}")
        if plan.is_materialized(j):
            store.put(j, tensors[j], plan.tiers[j])
        issue(f"f{j}")
        store.end_window()
    store.begin_window("turn")
    store.put(L, tensors[L], "hbm")
    issue("turn")
    assert torch.equal(store.get(L), tensors[L])
    store.release(L)
    store.end_window()
    for s, e in plan.segments_backward():
        for j in range(e - 1, s - 1, -1):
            store.begin_window(f"b{j}")
            issue(f"b{j}")
            if j == e - 1:
                if s == 0 and plan.tiers[0] == "recompute":
                    store.put(0, tensors[0].clone(), "recompute")
                assert torch.equal(store.get(s), tensors[s])
                for k in range(s, e - 1):
                    store.put(k + 1, tensors[k + 1].clone(), "recompute")
            assert torch.equal(store.get(j), tensors[j])
            store.release(j)
            store.end_window()


@pytest.mark.parametrize("name", list(PLAN_TIERS))
def test_store_hbm_peaks_equal_the_plans_hbm_checkpoint_bytes_in_every_window(tmp_path, name):
    from lazytrain.planner.evaluate import build_plan, decisions_from_tiers
    from lazytrain.planner.plan import SolveRecord

    problem = tiny_problem()
    plan = build_plan(problem, decisions_from_tiers(problem, PLAN_TIERS[name]),
                      solver=SolveRecord(backend="manual"))
    tensors = [torch.arange(1000 * (i + 1), dtype=torch.float32) + i for i in range(5)]
    limits = {w.name: int(w.hbm_checkpoint_bytes) for w in plan.windows}
    with make_store(tmp_path, hbm_limits=limits) as store:
        run_plan_protocol(store, plan, [t.clone() for t in tensors])
        peaks = {w: p["hbm"] for w, p in store.peak_by_window().items()}
        assert store.bytes_by_tier() == {"hbm": 0, "dram": 0, "dram_staging": 0, "nvme": 0}
    assert peaks == limits


def test_host_pool_reuses_released_buffers_and_refuses_past_its_cap():
    from lazytrain.runtime.host_pool import HostBufferPool

    from lazytrain.runtime.device import Device

    pool = HostBufferPool(device=Device(), capacity_bytes=3 * 4096)
    a = pool.acquire(2 * 4096)
    pool.release(a)
    assert pool.acquire(2 * 4096).data_ptr() == a.data_ptr()  # recycled, not reallocated
    with pytest.raises(MemoryError, match="cap of 12288 bytes"):
        pool.acquire(2 * 4096)  # 8192 in use + 8192 > 12288


def test_transfer_outside_a_window_is_refused(tmp_path):
    with make_store(tmp_path) as store:
        store.put(0, torch.ones(10), "dram")
        with pytest.raises(TransferOrderError, match="boundary 0 .*outside a window"):
            store.transfer(0, "d2h", 1.0)


class _CopiesStillRunning(Device):
    """The cpu device API, but every copy event reports 'not yet complete' and host waits are
    counted: what a CUDA host sees while the device lags a window behind."""

    def __init__(self) -> None:
        super().__init__()
        self.host_waits = 0

    def _host_wait(self, event) -> None:
        self.host_waits += 1

    def query(self, event) -> bool:
        return False


def test_window_barrier_and_release_never_block_the_host_on_copies(tmp_path):
    dev = _CopiesStillRunning()
    tensor = boundary_tensor(torch.float32)
    with ActivationStore(device=dev, nvme_dir=tmp_path / "nvme") as store:
        for step in range(2):
            store.begin_window("f1")
            store.put(1, tensor.clone(), "dram")
            store.transfer(1, "d2h", 1.0)
            store.end_window()
            store.begin_window("b2")
            store.transfer(1, "h2d", 1.0)
            store.end_window()
            store.begin_window("b1")
            assert torch.equal(store.get(1), tensor)
            store.release(1)
            store.end_window()
            if step == 0:  # no window end or release waited for a copy on the host
                assert dev.host_waits == 0
                assert store.bytes_by_tier()["dram"] == 0  # accounted as released
        # step 2's d2h found no free buffer, only step 1's pending one: it waited for that
        # buffer's two copy events instead of allocating a second buffer
        assert dev.host_waits == 2
        assert store._pool.allocated_bytes == tensor.numel() * 4


class _LoggedWaits(Device):
    """The cpu device API, logging every (stream name, event) the store makes a stream wait for."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[tuple[str, object]] = []

    def _wait_event(self, stream, event) -> None:
        self.waits.append((stream.name, event))


@pytest.mark.parametrize("prefetched_before_release", [False, True],
                         ids=["hbm_copy_held", "hbm_copy_adopted_by_h2d"])
def test_release_frees_the_hbm_copy_only_after_compute_waited_for_its_d2h(
        tmp_path, prefetched_before_release):
    # The d2h stream still reads the put tensor; the caching allocator hands freed memory to
    # the compute stream, so compute must wait for the d2h before the tensor is dropped, also
    # when an h2d in the same window adopted the HBM copy as the prefetched one.
    dev = _LoggedWaits()
    with ActivationStore(device=dev, nvme_dir=tmp_path / "nvme") as store:
        store.begin_window("b1")
        store.put(1, boundary_tensor(torch.float32), "dram")
        store.transfer(1, "d2h", 1.0)
        if prefetched_before_release:
            store.transfer(1, "h2d", 1.0)
        d2h_event = store._entries[(1, 0)].d2h_event
        store.release(1)
        assert ("compute", d2h_event) in dev.waits  # before the window's barrier
        store.end_window()


def test_a_boundary_drained_in_the_open_window_keeps_its_hbm_copy_until_the_barrier(tmp_path):
    # Boundary 1 (nvme, 60060 B) drains half in f1 (its first nvme_write covers 28672 B, the
    # 4 KiB pages available) and the rest in f2; boundary 2 (bf16, 30030 B) is a new size, so
    # its first d2h in f2 finds no pooled buffer and waits for boundary 1's earlier write
    # first. Boundary 1's HBM copy is still read by its d2h of f2, which compute has not
    # waited for yet: it must stay held (and counted) until f2's barrier.
    dev = _LoggedWaits()
    a, b = boundary_tensor(torch.float32), boundary_tensor(torch.bfloat16, seed=1)
    with ActivationStore(device=dev, nvme_dir=tmp_path / "nvme") as store:
        store.begin_window("f1")
        store.put(1, a, "nvme")
        store.transfer(1, "d2h", 0.5)
        store.transfer(1, "nvme_write", 0.5)
        store.end_window()
        store.begin_window("f2")
        store.put(2, b, "nvme")
        store.transfer(1, "d2h", 0.5)
        final_d2h = store._entries[(1, 0)].d2h_event
        store.transfer(2, "d2h", 1.0)
        assert store.bytes_by_tier()["hbm"] == 60060 + 30030
        assert store._entries[(1, 0)].src is not None or ("compute", final_d2h) in dev.waits
        store.transfer(1, "nvme_write", 0.5)
        store.transfer(2, "nvme_write", 1.0)
        store.end_window()
        assert store.bytes_by_tier()["hbm"] == 0  # both drained at the barrier
