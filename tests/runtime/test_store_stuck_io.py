"""ActivationStore with a stuck NVMe drive: since the window barrier no longer waits for NVMe
writes, a write that never finishes must still surface as NvmeTimeoutError before its bytes or
its staging buffer are used, and release / close must return instead of hanging on it.

The stuck drive is a fault hook that blocks every chunk write on a gate the test opens only at
the end; the hook also gives up by itself after GATE_S, so a hanging store shows up as
`gate.gave_up` (a failed assertion), not as a hung test run. No wall-clock assertion."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch

from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.backends import make_device
from lazytrain.runtime.nvme import NvmeTimeoutError

TIMEOUT_S = 0.2  # runtime.nvme_timeout_s of these stores
GATE_S = 10.0  # 50x TIMEOUT_S: the stuck write gives up by itself after this long


@pytest.fixture(params=["cpu", "cpu-checked", "cpu-threaded"])
def device(request):
    """Each backend: the failure paths must free nothing under a running copy (`cpu-checked`
    records no violation) and hold with late copies and jobs (`cpu-threaded`)."""
    dev = make_device(request.param, seed=6)
    yield dev
    dev.close()
    assert not getattr(dev, "violations", None), dev.violations[:1]


class StuckWrites:
    """Fault hook: every chunk write blocks until `open()` (or GATE_S passed: `gave_up`)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gave_up = False
        self.blocked = threading.Event()  # set once a write is blocked

    def __call__(self, event) -> None:
        if event.op == "write":
            self.blocked.set()
            if not self.gate.wait(GATE_S):
                self.gave_up = True

    def open(self) -> None:
        self.gate.set()


def make_store(tmp_path, hook, device) -> ActivationStore:
    store = ActivationStore(device=device, nvme_dir=tmp_path / "nvme",
                            direct=False, chunk_bytes=8192, fault_hook=hook)
    store.io.timeout_s = TIMEOUT_S
    return store


@contextmanager
def stuck_store(tmp_path, device):
    """(store, hook) on a drive whose writes hang; afterwards the drive is released, the store
    closed, and no file may be left behind."""
    hook = StuckWrites()
    store = make_store(tmp_path, hook, device)
    try:
        yield store, hook
    finally:
        hook.open()
        store.close()
    assert list((tmp_path / "nvme").iterdir()) == []


def offload(store: ActivationStore, boundary: int) -> None:
    """Window f{boundary}: a 20004-byte fp32 boundary (5 pages padded) to nvme."""
    store.begin_window(f"f{boundary}")
    store.put(boundary, torch.arange(5001, dtype=torch.float32), "nvme")
    store.transfer(boundary, "d2h", 1.0)
    store.transfer(boundary, "nvme_write", 1.0)
    store.end_window()


def test_the_read_back_of_a_stuck_write_is_a_timeout_error_naming_the_boundary(tmp_path, device):
    with stuck_store(tmp_path, device) as (store, hook):
        offload(store, 3)  # the barrier does not wait for the write: no error yet
        assert hook.blocked.wait(GATE_S)
        store.begin_window("b4")
        with pytest.raises(NvmeTimeoutError) as info:
            store.transfer(3, "nvme_read", 1.0)  # before any byte of the file is used
        assert info.value.boundary == 3
        assert info.value.path == tmp_path / "nvme" / "ckpt_b3_m0.bin"
        store.close()
        assert not hook.gave_up, "close() waited for the stuck write"


def test_release_and_close_return_while_a_write_is_stuck(tmp_path, device):
    with stuck_store(tmp_path, device) as (store, hook):
        offload(store, 3)
        assert hook.blocked.wait(GATE_S)
        store.release(3)  # no window end found the writes finished: nothing reported them yet
        assert not hook.gave_up, "release() waited for the stuck write"
        store.close()
        assert not hook.gave_up, "close() waited for the stuck write"
        assert store.bytes_by_tier() == {"hbm": 0, "dram": 0, "dram_staging": 0, "nvme": 0}


def test_the_next_boundary_s_staging_waits_for_an_overdue_stuck_write_and_raises(tmp_path, device):
    with stuck_store(tmp_path, device) as (store, hook):
        offload(store, 3)
        assert hook.blocked.wait(GATE_S)
        with pytest.raises(NvmeTimeoutError) as info:
            offload(store, 5)  # before the pool grows past the plan's pinned bytes
        assert info.value.boundary == 3
        store.close()
        assert not hook.gave_up, "close() waited for the stuck write"


def test_a_staging_buffer_held_by_a_stuck_write_is_never_handed_out_again(tmp_path, device):
    with stuck_store(tmp_path, device) as (store, hook):
        offload(store, 3)
        assert hook.blocked.wait(GATE_S)
        store.release(3)  # its staging buffer goes back to the pool, pending on the write
        store.begin_window("f4")
        store.put(4, torch.arange(5001, dtype=torch.float32), "nvme")
        with pytest.raises(NvmeTimeoutError):
            store.transfer(4, "d2h", 1.0)  # the only buffer of its size is the stuck one
        assert not hook.gave_up, "the pool waited for the stuck write"
        assert store._pool.has(5 * 4096) is False  # abandoned, not recycled


def test_a_timeout_on_a_removed_files_requests_still_names_its_boundary_and_file(tmp_path):
    from lazytrain.runtime.nvme import NvmeIO, aligned_empty

    hook = StuckWrites()
    io = NvmeIO(tmp_path, chunk_bytes=8192, direct=False, fault_hook=hook, timeout_s=TIMEOUT_S)
    try:
        futures = io.write((6, 1), aligned_empty(8192), 0)
        assert hook.blocked.wait(GATE_S)
        io.remove((6, 1))  # the pool may still hold the futures of a released boundary
        with pytest.raises(NvmeTimeoutError) as info:
            io.wait(futures)
        assert (info.value.boundary, info.value.micro_batch) == (6, 1)
        assert info.value.path == tmp_path / "ckpt_b6_m1.bin"
        assert not hook.gave_up
    finally:
        hook.open()
        io.close()
