"""The allocation and transfer ledger (runtime/ledger.py) and its budgets.

References are hand-computed byte counts: the ledger must book exactly what was allocated,
refuse a reservation past a budget before the memory is requested, naming owner and window, and
release a tensor's bytes when its storage is freed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import BATCH
from engine_helpers import HIDDEN, SEQ, micro_batches, model_pair, tiny_config
from ledger_helpers import real_plan
from lazytrain.runtime.device import Device
from lazytrain.planner.budgets import plan_budgets
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.errors import HbmBudgetExceeded, HostBudgetExceeded
from lazytrain.runtime.ledger import Ledger

R, H, D, N = "recompute", "hbm", "dram", "nvme"
A = BATCH * SEQ * HIDDEN * 4  # one fp32 boundary, bytes


def test_ledger_books_owners_peaks_and_releases_on_free():
    dev = Device()
    dev.ledger.begin_window("f0")
    a = dev.empty(1000, torch.float32, name="weight slot 0")  # 4000 B
    b = dev.pinned_empty(8192, name="staging")
    assert dev.ledger.held_by_owner("hbm") == {"weight slot 0": 4000}
    assert dev.ledger.held_bytes("pinned") == 8192
    view = a[10:20]
    del a  # the view keeps the storage: still booked
    assert dev.ledger.held_bytes("hbm") == 4000
    del view
    assert dev.ledger.held_bytes("hbm") == 0
    assert dev.ledger.peak_by_window("hbm")["f0"] == 4000
    del b
    assert dev.ledger.held_bytes("pinned") == 0


def test_a_reservation_past_the_budget_raises_before_the_memory_is_requested(monkeypatch):
    dev = Device()
    dev.ledger.set_limits(hbm_limits={"*": 10_000}, pinned_limit_bytes=4096)
    dev.ledger.begin_window("b3")
    keep = dev.empty(2000, torch.float32, name="kept graph of block 3")  # 8000 B
    asked = []
    monkeypatch.setattr(Device, "_alloc_device", lambda self, shape, dtype: asked.append(1))
    with pytest.raises(HbmBudgetExceeded) as info:
        dev.empty(1000, torch.float32, name="prefetched copy of boundary 2")  # +4000 > 10000
    assert asked == []  # refused before the allocator was asked
    err = info.value
    assert err.owner == "prefetched copy of boundary 2" and err.window == "b3"
    assert (err.held_bytes, err.limit_bytes) == (12_000, 10_000)
    assert "kept graph of block 3 8000" in str(err)
    assert dev.ledger.held_bytes("hbm") == 8000  # nothing booked for the refused request
    with pytest.raises(HostBudgetExceeded, match="window b3: pinning host memory for staging"):
        dev.pinned_empty(8192, name="staging")
    del keep


def test_copies_and_nvme_io_are_booked_to_their_window_and_channel(tmp_path):
    from lazytrain.runtime.nvme import NvmeIO

    dev = Device()
    dev.ledger.begin_window("f2")
    host = dev.pinned_empty(8192)
    on_device = dev.empty(8192, torch.uint8)
    dev.copy(on_device, host, stream=dev.stream("ckpt_h2d"))
    dev.copy(host[:4096], on_device[:4096], stream=dev.stream("d2h"))
    io = NvmeIO(tmp_path, device=dev, direct=False)
    io.wait(io.write((1, 0), host, 0))
    io.close()
    assert dev.ledger.moved_by_window()["f2"] == {"h2d": 8192, "d2h": 4096, "nvme_read": 0,
                                                  "nvme_write": 8192}


def _engine(adapter, plan, tmp_path, **kw):
    return make_engine(adapter, plan, device="cpu", nvme_dir=tmp_path / "nvme", grad_accum=2,
                       instrument=True, model_config_sha256=plan.provenance["model_config_sha256"],
                       **kw)


def test_an_hbm_budget_one_boundary_short_of_the_need_is_a_named_ledger_error(tmp_path):
    _, adapter = model_pair(tiny_config("llama"))
    plan = real_plan(adapter, [N, R, R, D, H], (2, 3))
    engine = _engine(adapter, plan, tmp_path)
    try:
        need = max(r["ledger_peak"]["hbm_bytes"] for r in engine.step(micro_batches(2)).windows)
    finally:
        engine.close()
    memory = dict(plan.provenance["memory"], hbm_budget_bytes=need - A)
    short = dataclasses.replace(plan, provenance={**plan.provenance, "memory": memory})
    assert plan_budgets(short)[0] == need - A
    _, adapter = model_pair(tiny_config("llama"))
    engine = _engine(adapter, short, tmp_path, budgets=True)
    try:
        with pytest.raises(HbmBudgetExceeded) as info:
            engine.step(micro_batches(2))
    finally:
        engine.close()
    err = info.value
    assert err.owner and err.window in {w.name for w in plan.windows} | {"pre", "post"}
    assert err.limit_bytes == need - A and err.held_bytes > need - A
    assert f"window {err.window}: reserving HBM for {err.owner}" in str(err)


def test_the_checkers_hold_the_same_hbm_as_the_cpu_backend(tmp_path):
    """Workers' host allocations (AdamW moments, accumulation) are not booked as HBM."""
    from lazytrain.runtime.backends import make_device

    peaks = {}
    for kind in ("cpu", "cpu-checked", "cpu-threaded"):
        _, adapter = model_pair(tiny_config("llama"))
        plan = real_plan(adapter, [N, R, R, D, H], (2, 3))
        dev = make_device(kind)
        engine = make_engine(adapter, plan, device=dev, nvme_dir=tmp_path / kind, grad_accum=2,
                             model_config_sha256=plan.provenance["model_config_sha256"])
        try:
            for s in range(2):
                engine.step(micro_batches(2, seed=s))
            engine.optimizer.wait_all()
            peaks[kind] = dev.ledger.peak_bytes("hbm")
        finally:
            engine.close()
            dev.close()
    assert peaks["cpu-checked"] == peaks["cpu"]
    assert peaks["cpu-threaded"] <= peaks["cpu"] * 1.25  # copies in flight hold their buffers
