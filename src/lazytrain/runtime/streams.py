"""Device-agnostic streams and events, double-buffered block weights, and gradient drain.

Owns the ordering of copies against compute. On CUDA there are three streams: compute (the
current stream), H2D and D2H, ordered by events. On CPU the same API runs every copy
synchronously, so the ordering holds trivially and the code paths are the same. The device
path is chosen once, at construction.

Ordering rules enforced here (the race classes of offloading systems):
- a weight slot is overwritten by a load only after the event recorded when its previous
  consumer released it has completed (`DeviceWeights.load`);
- a staging (H2D source) buffer is reused only after its copy's event completed
  (`params.StagingPool.acquire`);
- a gradient D2H buffer is read and reused only after its copy's event completed
  (`GradDrain`).

Knows nothing about plans or tiers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from lazytrain.runtime.params import HostParams, ParamGroup, StagingPool


class CpuEvent:
    """A completed event (CPU copies are synchronous)."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class Streams:
    """Compute / H2D / D2H ordering for one device.

    Args:
        device: torch.device("cpu") or a CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda:
            self.compute = torch.cuda.current_stream(self.device)
            self.h2d_stream = torch.cuda.Stream(self.device)
            self.d2h_stream = torch.cuda.Stream(self.device)

    def record_compute(self):
        """An event marking the work queued on the compute stream so far."""
        if not self.is_cuda:
            return CpuEvent()
        ev = torch.cuda.Event()
        ev.record(self.compute)
        return ev

    def compute_wait(self, event) -> None:
        """Make later compute wait for `event` (no host sync)."""
        if self.is_cuda and event is not None:
            self.compute.wait_event(event)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, *, after=None):
        """Copy host `src` into device `dst` on the H2D stream after `after`; returns its event.

        The caller keeps `src` alive and unmodified until the event completes.
        """
        if not self.is_cuda:
            dst.copy_(src)
            return CpuEvent()
        with torch.cuda.stream(self.h2d_stream):
            if after is not None:
                self.h2d_stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.h2d_stream)
        return ev

    def d2h(self, dst: torch.Tensor, src: torch.Tensor):
        """Copy device `src` (produced on the compute stream) into host `dst`; returns its event.

        `src` is recorded on the D2H stream so its memory is not reused before the copy ends.
        """
        if not self.is_cuda:
            dst.copy_(src)
            return CpuEvent()
        self.d2h_stream.wait_stream(self.compute)  # src is complete on compute
        with torch.cuda.stream(self.d2h_stream):
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.d2h_stream)
            ev = torch.cuda.Event()
            ev.record(self.d2h_stream)
        return ev


@dataclass(slots=True)
class WeightHandle:
    """Block j's weights on the device: a flat compute-dtype buffer and its load event."""

    block: int
    flat: torch.Tensor
    event: object
    slot: int | None
    """Double-buffer slot index, or None for a resident (kept) buffer."""


class DeviceWeights:
    """Block weights on the device: a small ring of slots plus separate resident buffers.

    Args:
        params: the host store (source of every load).
        streams: the device's streams.
        compute_dtype: dtype of the device copy.
        num_slots: ring size: 2 for double buffering (block j runs, the next block loads) + 2
            so the segment recompute loads are double-buffered too (block k+1 loads while k
            recomputes).
    """

    def __init__(self, params: HostParams, streams: Streams, compute_dtype: torch.dtype, *,
                 num_slots: int = 4) -> None:
        self.params = params
        self.streams = streams
        self.dtype = compute_dtype
        n = params.max_block_numel()
        self.slots = [torch.empty(n, dtype=compute_dtype, device=streams.device)
                      for _ in range(num_slots)]
        self.free_events: list[object | None] = [None] * num_slots
        self.free = deque(range(num_slots))
        self.staging = (StagingPool(n, compute_dtype, count=num_slots, pin=True)
                        if streams.is_cuda else None)

    def load(self, group: ParamGroup, block: int, *, resident: bool = False) -> WeightHandle:
        """Start copying `group`'s master weights to the device; returns the handle at once.

        Ordering: the H2D waits for the event recorded when the slot's previous consumer
        released it, so a prefetched buffer is never overwritten before its consumer is done.
        A resident buffer is a fresh allocation that no other block ever shares (a graph kept
        across windows references it).

        Raises:
            RuntimeError: no free slot (an engine bug: more than `num_slots` loads outstanding).
        """
        if resident:
            slot, dst, after = None, torch.empty(group.numel, dtype=self.dtype,
                                                 device=self.streams.device), None
        else:
            if not self.free:
                raise RuntimeError(f"no free weight slot for block {block}")
            slot = self.free.popleft()
            dst, after = self.slots[slot][:group.numel], self.free_events[slot]
        if self.staging is None:
            event = self.streams.h2d(dst, group.master, after=after)
        else:
            k, buf = self.staging.acquire()
            buf[:group.numel].copy_(group.master)  # master -> compute dtype on the host
            event = self.streams.h2d(dst, buf[:group.numel], after=after)
            self.staging.mark_in_flight(k, event)
        return WeightHandle(block=block, flat=dst, event=event, slot=slot)

    def ready(self, handle: WeightHandle) -> torch.Tensor:
        """The device buffer, after making compute wait for its load (no host sync)."""
        self.streams.compute_wait(handle.event)
        return handle.flat

    def release(self, handle: WeightHandle) -> None:
        """Return the slot; its next load waits for the compute queued so far."""
        if handle.slot is None:
            return
        self.free_events[handle.slot] = self.streams.record_compute()
        self.free.append(handle.slot)


class GradDrain:
    """Device gradients -> host accumulators, in order, through a bounded buffer pool.

    On CPU the accumulation happens at once. On CUDA each drain copies into a pinned fp32
    buffer on the D2H stream; the host adds it into the accumulator only after the copy's
    event completed, and the buffer is reused only then. The accumulator has the master
    dtype: a bf16 one rounds each fp32 contribution once (`ParamGroup.accumulate_grad`).

    Args:
        streams: the device's streams.
        numel: largest group, elements.
        count: pinned buffers in flight (CUDA).
    """

    def __init__(self, streams: Streams, numel: int, *, count: int = 2) -> None:
        self.streams = streams
        self.pending: deque = deque()
        self.buffers = ([torch.empty(numel, dtype=torch.float32, pin_memory=True)
                         for _ in range(count)] if streams.is_cuda else [])
        self.free = deque(range(len(self.buffers)))

    def drain(self, group: ParamGroup, grad: torch.Tensor | None, *, first: bool,
              on_done: Callable[[], None] | None = None) -> None:
        """Queue one gradient; `on_done` runs once it is in the host accumulator."""
        if not self.streams.is_cuda or grad is None:
            group.accumulate_grad(None if grad is None else grad.float(), first=first)
            if on_done is not None:
                on_done()
            return
        if not self.free:
            self._finish_oldest()
        k = self.free.popleft()
        buf = self.buffers[k][:group.numel]
        event = self.streams.d2h(buf, grad.float())
        self.pending.append((event, k, buf, group, first, on_done))

    def _finish_oldest(self) -> None:
        event, k, buf, group, first, on_done = self.pending.popleft()
        event.synchronize()  # sync point: the copy into buf is complete
        group.accumulate_grad(buf, first=first)
        self.free.append(k)
        if on_done is not None:
            on_done()

    def flush(self) -> None:
        """Finish every queued drain."""
        while self.pending:
            self._finish_oldest()


class WindowMeter:
    """Per-window wall time: CUDA events on the compute stream, or `time.perf_counter` on CPU.

    Use `with meter.window("f3"):`; `times_ms()` resolves the events (sync point, call once per
    step) and returns window name -> ms summed over micro-batches.
    """

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self.records: list[tuple[str, object, object]] = []

    def window(self, name: str):
        return _MeterWindow(self, name)

    def reset(self) -> None:
        self.records.clear()

    def times_ms(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, start, end in self.records:
            if self.streams.is_cuda:
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                ms = (end - start) * 1e3
            out[name] = out.get(name, 0.0) + ms
        return out


class _MeterWindow:
    def __init__(self, meter: WindowMeter, name: str) -> None:
        self.meter, self.name = meter, name

    def _stamp(self):
        if self.meter.streams.is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.meter.streams.compute)
            return ev
        import time
        return time.perf_counter()

    def __enter__(self):
        self.start = self._stamp()
        return self

    def __exit__(self, *exc) -> None:
        self.meter.records.append((self.name, self.start, self._stamp()))
