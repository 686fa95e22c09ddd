"""Honest compute timing: a window's `compute_ms` is the compute stream's busy time between
the engine thread's blocks, and the stream's idle while that thread was blocked is
`host_blocked_ms`, on CUDA (timing events) and on the CPU backends (wall clock) alike.

The devices here are fakes whose timing events report chosen times (ms), so every figure is
computed by hand below; no GPU is needed. Also: events the host waits on are blocking-sync
CUDA events (no spinning core), and host worker threads are sized per rank.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from lazytrain.runtime import device as device_mod
from lazytrain.runtime.cuda_device import CudaDevice
from lazytrain.runtime.device import Device, Event, Stream
from lazytrain.runtime.instrument import CHANNELS, Instrument


class _Plan:
    def digest(self) -> str:
        return "0" * 16


class _Store:
    def peak_by_window(self) -> dict:
        return {}

    def bytes_by_tier(self) -> dict:
        return {}


class _Clock:
    """Timing events that report chosen times, in the order they are recorded (ms)."""

    def __init__(self, times) -> None:
        self.times = list(times)

    def timing_event(self, stream=None):
        return self.times.pop(0)

    def elapsed_ms(self, start, end) -> float:
        return end - start


class FakeGpu(_Clock, CudaDevice):
    """The CUDA backend's observation paths (stream waits timed by compute-stream events,
    asynchronous copies) with nothing on a GPU: events report the chosen times."""

    def __init__(self, times) -> None:
        Device.__init__(self)
        _Clock.__init__(self, times)

    def record(self, stream: Stream) -> Event:
        return Event(self, stream)

    def _wait_event(self, stream, event) -> None:
        pass

    def _host_wait(self, event) -> None:
        pass


class FakeCpu(_Clock, Device):
    """The CPU backend (synchronous copies, compute on the engine's thread) with chosen times."""

    def __init__(self, times) -> None:
        Device.__init__(self)
        _Clock.__init__(self, times)


def one_window(device, body) -> dict:
    inst = Instrument(device=device, store=_Store(), plan=_Plan())
    inst.begin_step()
    inst.begin_micro_batch(0)
    with inst.window("f0"):
        body(device)
    [record] = inst.take_records()
    [window] = record["windows"]
    assert not device.times, "every chosen time was used"
    return window


def test_cuda_compute_excludes_the_stream_idle_while_the_host_waited_and_copy_waits():
    # GPU times of the events in the order they are recorded:
    #   0 window start; 10 before the host wait (the kernels queued so far end at 10);
    #   25 after it (the host resumed at 25: the stream idled 10..25);
    #   30 / 34 around the compute stream's wait for an h2d (a 4 ms copy stall); 50 the end.
    # compute = (10 - 0) + (30 - 25) + (50 - 34) = 31; host blocked = 25 - 10 = 15;
    # wall 50 = 31 + 15 + 4. (Before: compute = wall - copy waits = 46.)
    h2d = Stream("h2d")

    def body(dev):
        dev.host_wait(Event(dev, h2d))  # e.g. the AdamW of the next block, before queueing
        dev.wait_event(dev.compute, Event(dev, h2d))

    w = one_window(FakeGpu([0.0, 10.0, 25.0, 30.0, 34.0, 50.0]), body)
    assert w["wall_ms"] == 50.0
    assert w["compute_ms"] == 31.0
    assert w["host_blocked_ms"] == 15.0
    assert w["exposed_ms"] == 19.0
    assert w["host_blocked_on_ms"] == dict.fromkeys(CHANNELS, 0.0) | {"h2d": 15.0}
    assert 4.0 <= w["wait_ms"]["h2d"] < 4.5  # the stall, and the host wait's wall clock (~0)


def test_cuda_kernels_queued_before_a_host_wait_that_outlast_it_stay_compute():
    # the event before the wait resolves at 40 (kernels queued earlier run until then) and
    # the one after it at 40 too (the host was back long before): no idle, all compute
    def body(dev):
        dev.host_wait(Event(dev, Stream("d2h")))

    w = one_window(FakeGpu([0.0, 40.0, 40.0, 60.0]), body)
    assert (w["compute_ms"], w["host_blocked_ms"], w["exposed_ms"]) == (60.0, 0.0, 0.0)


def test_cuda_nested_blocks_and_engine_host_work_count_once_as_blocked():
    # a future wait inside `waiting` (nested: one block), then host work on the engine thread
    # 0 start; 5 block; 12 unblock; 20 host work begins; 26 ends; 30 end of window
    # compute = 5 + 8 + 4 = 17; blocked = 7 + 6 = 13
    def body(dev):
        done = Future()
        done.set_result(None)
        with dev.waiting("nvme_read"):
            dev.wait_futures([done])
        with dev.host_work():
            pass

    w = one_window(FakeGpu([0.0, 5.0, 12.0, 20.0, 26.0, 30.0]), body)
    assert (w["compute_ms"], w["host_blocked_ms"]) == (17.0, 13.0)
    # the outer wait names the block; the host work is "host"
    assert w["host_blocked_on_ms"] == dict.fromkeys(CHANNELS, 0.0) | {"nvme_read": 7.0,
                                                                      "host": 6.0}


def test_waiting_for_finished_jobs_is_no_block_and_records_no_events():
    # only the window's own two events: a finished NVMe chunk's future blocks nobody
    done = Future()
    done.set_result(None)
    w = one_window(FakeGpu([0.0, 10.0]), lambda dev: dev.wait_futures([done] * 50))
    assert (w["compute_ms"], w["host_blocked_ms"]) == (10.0, 0.0)


def test_cpu_backend_gives_the_same_fields_compute_is_the_wall_of_the_compute():
    # CPU: a synchronous copy and a wait are blocks of the engine's thread (which computes)
    # 0 start; 3 copy begins; 7 ends; 9 host wait begins; 14 ends; 20 end
    # compute = 3 + 2 + 6 = 11; blocked = 4 + 5 = 9 = wall - compute
    def body(dev):
        dev.copy(torch.zeros(4), torch.ones(4), stream=dev.stream("h2d"))
        dev.host_wait(Event(dev, dev.stream("d2h")))

    w = one_window(FakeCpu([0.0, 3.0, 7.0, 9.0, 14.0, 20.0]), body)
    assert (w["wall_ms"], w["compute_ms"], w["host_blocked_ms"]) == (20.0, 11.0, 9.0)


class _EventSpy:
    made: list[dict] = []

    def __init__(self, **kwargs) -> None:
        _EventSpy.made.append(kwargs)

    def record(self, stream) -> None:
        pass


def test_events_the_host_waits_on_are_blocking_sync(monkeypatch):
    # torch.cuda.Event(blocking=True): cudaEventBlockingSync, the waiting thread sleeps
    monkeypatch.setattr(torch.cuda, "Event", _EventSpy)
    _EventSpy.made.clear()
    dev = FakeGpu([])
    CudaDevice.record(dev, Stream("h2d"))
    CudaDevice.timing_event(dev, Stream("compute"))
    assert [e.get("blocking") for e in _EventSpy.made] == [True, True]


class _CudaHost(Device):
    is_cuda = True


@pytest.mark.parametrize("cores, ranks, adamw", [(64, 1, 31), (64, 8, 3), (16, 8, 1),
                                                 (9, 1, 4), (128, 4, 15)])
def test_host_worker_threads_are_sized_from_this_rank_s_share_of_the_cores(
        monkeypatch, cores, ranks, adamw):
    # a rank's cores: affinity / LOCAL_WORLD_SIZE; its workers share them less the engine
    # thread's one: adamw 0.5, convert and accum 0.25 each (at least 1 thread)
    monkeypatch.setattr(device_mod.os, "sched_getaffinity", lambda pid: set(range(cores)),
                        raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    dev = _CudaHost()
    share = max(1, cores // ranks)
    assert dev.host_threads("adamw") == adamw == max(1, int((share - 1) * 0.5))
    assert dev.host_threads("accum") == max(1, int((share - 1) * 0.25))
    total = sum(dev.host_threads(r) for r in ("adamw", "convert", "accum"))
    assert ranks * (total + 1) <= max(cores, 4 * ranks)  # the node's cores, not a multiple


def test_a_bad_local_world_size_is_a_one_line_error_naming_it(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "zero")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        _CudaHost().host_threads("adamw")
