"""Instrumentation: stalls are attributed to the channel and the window that caused them, and
windows.jsonl has one line per step and micro-batch with the documented schema.

Timing is asserted only as "the injected delay shows up where it was injected": a delayed NVMe
read must be waited for in the window whose plan transfer issued it (that window's barrier, or
an h2d of the same window, waits for it; runtime/instrument.py), nowhere else, on no other
channel.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from engine_helpers import BATCH, HIDDEN, SEQ, micro_batches, model_pair, plan_for, tiny_config
from lazytrain.planner.plan import Plan
from lazytrain.planner.windows import window_names
from lazytrain.report.tables import plan_id_of_dict
from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.build import make_engine
from lazytrain.runtime.instrument import (BYTE_CHANNELS, CHANNELS, PEAK_TIERS, Instrument,
                                          plan_id, write_windows_jsonl)
from lazytrain.runtime.nvme import FaultInjector

N, D, H, R = "nvme", "dram", "hbm", "recompute"
HORIZONS = dict(drain_windows=1, prefetch_windows=1, nvme_lead_windows=1)
DELAY_MS = 150.0
A_BYTES = BATCH * SEQ * HIDDEN * 4  # one fp32 boundary [2, 12, 64]: 6144 bytes
A_PADDED = 8192                     # rounded up to 4 KiB in the NVMe file


def _engine(tiers, tmp_path, *, fault_hook=None, grad_accum=1, instrument=True):
    _, adapter = model_pair(tiny_config("llama"))
    plan = plan_for(adapter, tiers, grad_accum=grad_accum, **HORIZONS)
    store = ActivationStore(device=torch.device("cpu"), nvme_dir=tmp_path / "nvme",
                            fault_hook=fault_hook)
    engine = make_engine(adapter, plan, device="cpu", store=store, grad_accum=grad_accum,
                         instrument=instrument)
    return engine, plan


def test_delayed_nvme_reads_stall_exactly_the_windows_that_issue_them(tmp_path):
    faults = FaultInjector()
    faults.delay_reads(DELAY_MS)
    engine, plan = _engine([N, N, N, N, H], tmp_path, fault_hook=faults)
    try:
        stats = engine.step(micro_batches(1))
    finally:
        engine.close()
    read_windows = {t.window for t in plan.transfers if t.kind == "nvme_read"}
    # HORIZONS put the reads of boundaries 3, 2, 1, 0 in turn, turn, b3, b2: a window before
    # each h2d (no same-window chain, docs/execution_model.md), boundary 3 beside its h2d in
    # turn (no earlier legal window)
    assert read_windows == {"turn", "b3", "b2"}
    (record,) = stats.windows
    for w in record["windows"]:
        waits = w["wait_ms"]
        if w["name"] in read_windows:
            assert waits["nvme_read"] >= 0.5 * DELAY_MS, w
            others = sum(v for c, v in waits.items() if c != "nvme_read")
            assert others < waits["nvme_read"], w
        else:  # at most an h2d waiting on reads completed in an earlier window: not the delay
            assert waits["nvme_read"] < 0.05 * DELAY_MS, w


def test_nvme_write_waits_never_carry_the_read_delay(tmp_path):
    faults = FaultInjector()
    faults.delay_reads(DELAY_MS)
    engine, _ = _engine([N, N, N, N, H], tmp_path, fault_hook=faults)
    try:
        (record,) = engine.step(micro_batches(1)).windows
    finally:
        engine.close()
    total_write = sum(w["wait_ms"]["nvme_write"] for w in record["windows"])
    total_read = sum(w["wait_ms"]["nvme_read"] for w in record["windows"])
    assert total_read >= 4 * 0.5 * DELAY_MS  # four delayed reads
    assert total_write < total_read / 4


def test_window_bytes_equal_the_plan_transfers_and_weight_loads(tmp_path):
    engine, plan = _engine([N, N, N, N, H], tmp_path)
    try:
        (record,) = engine.step(micro_batches(1)).windows
        P = engine.params.blocks[0].numel * 4  # fp32 block weights, bytes
    finally:
        engine.close()
    by_name = {w["name"]: w for w in record["windows"]}
    for j in range(4):
        f = by_name[f"f{j}"]["bytes"]
        # f{j}: boundary j's d2h (A bytes) and boundary j-1's padded NVMe write (a write runs
        # in the window after its d2h); block j+1's weights
        assert f["d2h"] == A_BYTES and f["nvme_read"] == 0
        assert f["nvme_write"] == (A_PADDED if j >= 1 else 0)
        assert f["h2d"] == (P if j + 1 < 4 else 0)
    assert by_name["turn"]["bytes"]["nvme_write"] == A_PADDED  # boundary 3's
    b2 = by_name["b2"]["bytes"]
    # b2: boundary 0 read back (padded; a read runs in the window before its h2d), boundary 1
    # sent (A); block 1's weights (H2D); block 3's gradient drained (D2H: block j+1's drain is
    # issued in b{j}, while block j computes, as the plan counts G[j+1]); P = G in fp32
    assert b2["nvme_read"] == A_PADDED and b2["h2d"] == A_BYTES + P and b2["d2h"] == P
    assert by_name["b0"]["bytes"]["h2d"] == 0  # nothing left to load
    assert by_name["f3"]["peak_bytes"]["nvme"] == 3 * A_PADDED  # boundary 3's file: in turn
    assert by_name["turn"]["peak_bytes"]["nvme"] == 4 * A_PADDED  # all four files exist


def test_windows_jsonl_has_one_line_per_step_and_micro_batch_with_the_schema(tmp_path):
    engine, plan = _engine([R, D, H, N, H], tmp_path, grad_accum=2)
    path = tmp_path / "windows.jsonl"
    try:
        for step in (1, 2):
            stats = engine.step(micro_batches(2, seed=step))
            write_windows_jsonl(path, step=step, records=list(stats.windows))
    finally:
        engine.close()
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [(r["step"], r["micro_batch"]) for r in lines] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    names = ["pre"] + window_names(4) + ["post"]
    for r in lines:
        assert set(r) == {"step", "micro_batch", "plan_id", "ledger_peak", "windows"}
        assert set(r["ledger_peak"]) == {"window", "hbm_bytes", "owners", "pinned_bytes"}
        assert r["plan_id"] == plan_id(plan)
        assert [w["name"] for w in r["windows"]] == names
        for w in r["windows"]:
            assert set(w) == {"name", "wall_ms", "compute_ms", "exposed_ms", "wait_ms",
                              "busy_ms", "host_ms", "bytes", "peak_bytes", "ledger",
                              "host_blocked_ms", "host_blocked_on_ms", "saved_d2h_bytes",
                              "saved_h2d_bytes"}
            assert set(w["host_blocked_on_ms"]) == set(CHANNELS)
            assert sum(w["host_blocked_on_ms"].values()) == pytest.approx(
                w["host_blocked_ms"], abs=1e-3)
            assert set(w["busy_ms"]) == set(BYTE_CHANNELS)
            assert w["exposed_ms"] == pytest.approx(w["wall_ms"] - w["compute_ms"], abs=1e-3)
            assert set(w["ledger"]["moved"]) == set(BYTE_CHANNELS)
            assert set(w["wait_ms"]) == set(CHANNELS)
            assert set(w["bytes"]) == set(BYTE_CHANNELS)
            assert set(w["peak_bytes"]) == set(PEAK_TIERS)
            assert 0 <= w["compute_ms"] <= w["wall_ms"] + 1e-3
            # CPU: compute runs on the engine's thread, so whatever is not compute is blocked
            assert w["compute_ms"] + w["host_blocked_ms"] == pytest.approx(w["wall_ms"],
                                                                           abs=2e-3)


def test_plan_id_is_the_same_from_the_plan_and_from_its_saved_json(tmp_path):
    _, adapter = model_pair(tiny_config("llama"))
    plan = plan_for(adapter, [R, D, H, N, H])
    path = plan.save(tmp_path / "plan.json")
    assert plan_id(plan) == plan_id_of_dict(json.loads(path.read_text()))
    assert plan_id(Plan.load(path)) == plan_id(plan)


def test_instrumented_engine_computes_the_same_gradients(tmp_path):
    grads = []
    for on in (False, True):
        engine, _ = _engine([N, D, H, R, H], tmp_path / str(on), instrument=on)
        try:
            stats = engine.step(micro_batches(1))
            assert bool(stats.windows) == on
            grads.append({k: v.clone() for k, v in engine.gradients().items()})
        finally:
            engine.close()
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]), k


def test_a_slowed_host_conversion_is_attributed_to_the_host_not_to_compute_or_h2d(tmp_path,
                                                                                 monkeypatch):
    from lazytrain.runtime.streams import DeviceWeights

    sleep_ms = 40.0
    convert = DeviceWeights.convert

    def slow_convert(self, staging, master):  # the host converts 40 ms slower per block
        with self.device.host_work():
            time.sleep(sleep_ms / 1e3)
        convert(self, staging, master)

    monkeypatch.setattr(DeviceWeights, "convert", slow_convert)
    engine, _ = _engine([H, H, H, H, H], tmp_path)
    try:
        (record,) = engine.step(micro_batches(1)).windows
    finally:
        engine.close()
    by_name = {w["name"]: w for w in record["windows"]}
    for j in range(3):  # f{j} converts block j+1's weights
        w = by_name[f"f{j}"]
        assert w["host_ms"] >= 0.9 * sleep_ms, w
        assert w["compute_ms"] < w["host_ms"] / 2, w  # not compute
        assert w["wait_ms"]["h2d"] < w["host_ms"] / 2, w  # not the link


def test_an_engine_stepped_on_another_thread_still_attributes_its_waits(tmp_path, monkeypatch):
    import threading

    from lazytrain.runtime.streams import DeviceWeights

    convert = DeviceWeights.convert

    def slow_convert(self, staging, master):
        time.sleep(0.03)
        convert(self, staging, master)

    monkeypatch.setattr(DeviceWeights, "convert", slow_convert)
    engine, _ = _engine([H, H, H, H, H], tmp_path)  # built on this thread
    out = {}
    try:
        worker = threading.Thread(target=lambda: out.update(r=engine.step(micro_batches(1))))
        worker.start()
        worker.join()
    finally:
        engine.close()
    (record,) = out["r"].windows
    waits = sum(w["wait_ms"]["host"] for w in record["windows"])
    assert waits >= 30.0  # the engine's thread waited for the slow conversions: not compute


@pytest.mark.parametrize("backend", ["cpu", "cpu-checked"])
def test_compute_never_exceeds_the_window_wall_over_a_real_step(backend, tmp_path):
    """Over real steps (two, grad_accum 2, a plan with every tier): each window's compute is at
    most its wall time, and on the CPU backends (compute on the engine's thread) compute and
    host-blocked time split the wall exactly: no stretch counted twice."""
    _, adapter = model_pair(tiny_config("llama"))
    plan = plan_for(adapter, [R, D, H, N, H], grad_accum=2, **HORIZONS)
    engine = make_engine(adapter, plan, device=backend, nvme_dir=tmp_path / "nvme",
                         grad_accum=2, instrument=True)
    try:
        records = [r for step in (1, 2) for r in engine.step(micro_batches(2, seed=step)).windows]
    finally:
        engine.close()
    assert len(records) == 4
    for r in records:
        for w in r["windows"]:
            assert 0 <= w["compute_ms"] <= w["wall_ms"], w
            assert w["compute_ms"] + w["host_blocked_ms"] == pytest.approx(w["wall_ms"],
                                                                           abs=2e-3), w


class _ClockDevice:
    """A device whose timing events are the times (ms) of a script, one per call."""

    ledger = None

    def __init__(self, times) -> None:
        self.times = iter(times)
        self.observer = None

    def set_observer(self, observer) -> None:
        self.observer = observer

    def timing_event(self, stream=None):
        return next(self.times)

    def elapsed_ms(self, start, end) -> float:
        return end - start


def test_compute_and_blocked_time_of_a_hand_timed_window():
    """One window, by hand: opens at 0 ms; compute to 3; the engine's thread blocks 3-7 on
    an h2d (a nested wait for an NVMe read inside, which must not end the block); compute to
    8; host work 8-9.5; compute to 12, the window's end. Compute 3 + 1 + 2.5 = 6.5 ms,
    blocked 4 ms on h2d and 1.5 ms on host, wall 12 ms: compute <= wall and the three add up."""
    device = _ClockDevice([0.0, 3.0, 7.0, 8.0, 9.5, 12.0])
    store = SimpleNamespace(bytes_by_tier=dict)
    inst = Instrument(device=device, store=store, plan=SimpleNamespace(digest=lambda: "p"))
    with inst.window("f0"):                   # 0
        inst.on_block()                       # 3: the h2d wait begins
        inst.on_block()                       # the nested NVMe wait: no event
        inst.on_wait("nvme_read", 0.002)
        inst.on_wait("h2d", 0.004)            # 7: the outermost wait ends
        inst.on_block()                       # 8: host work on the engine's thread
        inst.on_host(0.0015)                  # 9.5
    (w,) = inst._mb_windows                   # closed at 12
    out = inst._resolve(w)
    assert out["wall_ms"] == 12.0
    assert out["compute_ms"] == pytest.approx(6.5)
    assert out["host_blocked_ms"] == pytest.approx(5.5)
    assert out["host_blocked_on_ms"]["h2d"] == pytest.approx(4.0)
    assert out["host_blocked_on_ms"]["host"] == pytest.approx(1.5)
    assert out["compute_ms"] <= out["wall_ms"]
    assert out["exposed_ms"] == pytest.approx(5.5)
