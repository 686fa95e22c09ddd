"""Double-buffered block weights on the device, and the gradient drain to the host.

Owns the ordering of weight loads and gradient drains against compute, through the device API
(`runtime/device.py`): weights move on the "h2d" stream, gradients on the "d2h" stream, and
compute waits for them by events. Every backend runs the same path (staging buffer, copy,
event); on `cpu` the copies are synchronous, on `cpu-checked` every access is checked, on
`cpu-threaded` the copies really run late.

Ordering rules enforced here (the race classes of offloading systems):
- a weight slot or a resident buffer is written by a load only after the compute stream's work
  queued before its allocation or its last release (`DeviceWeights.load` waits for the event
  recorded then; a fresh buffer may be memory the compute stream still uses);
- a staging (H2D source) buffer is rewritten on the host only after its previous copy's event
  completed (`StagingPool.acquire`);
- a gradient D2H destination is read on the host and reused only after its copy's event
  completed, and the device gradient is kept alive (record_stream) until the copy ran
  (`GradDrain`).

Knows nothing about plans or tiers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from lazytrain.contract import (
    DEVICE_WEIGHT_SLOTS, GPU_CAST_LANDING_SLOTS, GRAD_DRAIN_BUFFERS, WEIGHT_STAGING_BUFFERS,
)
from lazytrain.models.host_params import HostParams, ParamGroup
from lazytrain.runtime.device import Device, Event


@dataclass(slots=True)
class WeightHandle:
    """Block j's weights on the device: a flat compute-dtype buffer and its load event."""

    block: int
    flat: torch.Tensor
    event: Event | None
    """The H2D's event, once the conversion job queued it (`DeviceWeights.event_of`)."""
    slot: int | None
    """Double-buffer slot index, or None for a resident (kept) buffer."""
    job: object = None
    """The conversion worker's future (staging, conversion, the H2D), None once collected."""
    landing: int | None = None
    """gpu_cast: the landing buffer the master lands in, cast into `flat` by `ready`."""


class StagingPool:
    """A bounded ring of compute-dtype host buffers used as H2D sources.

    One buffer per weight slot, each the size of the largest block: the masters are converted to
    the compute dtype into these buffers, never into a pinned copy of the whole model.
    The buffers come from the device API's `pinned_empty` (page-locked on CUDA, so the copy is
    asynchronous); a buffer is handed out again only after the event recorded for its last copy
    has completed (a source buffer is never rewritten on the host before its copy read it).

    Args:
        numel: elements per buffer (the largest group).
        dtype: compute dtype.
        count: number of buffers (2-4: double buffering plus the recompute loads; the
            planner counts `lazytrain.contract.WEIGHT_STAGING_BUFFERS`).
        device: the device API (`runtime/device.py`).
    """

    def __init__(self, numel: int, dtype: torch.dtype, *, count: int = WEIGHT_STAGING_BUFFERS,
                 device) -> None:
        size = torch.empty((), dtype=dtype).element_size()
        self.device = device
        self.buffers = [device.pinned_empty(numel * size, name=f"weight staging buffer {k}")
                        .view(dtype) for k in range(count)]
        self.events: list[object | None] = [None] * count
        self._next = 0

    def acquire(self) -> tuple[int, torch.Tensor]:
        """Next buffer in the ring, after waiting for its previous copy (sync point)."""
        k = self._next
        self._next = (k + 1) % len(self.buffers)
        if self.events[k] is not None:
            self.device.host_wait(self.events[k])  # the previous H2D from this buffer is done
            self.events[k] = None
        return k, self.buffers[k]

    def mark_in_flight(self, k: int, event) -> None:
        """Record the event of the copy reading buffer k."""
        self.events[k] = event


class DeviceWeights:
    """Block weights on the device: a small ring of slots plus separate resident buffers.

    Args:
        params: the host store (source of every load).
        device: the device API.
        compute_dtype: dtype of the device copy.
        num_slots: ring size: 2 for double buffering (block j runs, the next block loads) + 2
            so the segment recompute loads are double-buffered too (block k+1 loads while k
            recomputes); the planner counts `lazytrain.contract.DEVICE_WEIGHT_SLOTS` of them
            and as many staging buffers (`WEIGHT_STAGING_BUFFERS`, one per slot).
    """

    def __init__(self, params: HostParams, device: Device, compute_dtype: torch.dtype, *,
                 num_slots: int = DEVICE_WEIGHT_SLOTS) -> None:
        self.params = params
        self.device = device
        self.dtype = compute_dtype
        self.h2d = device.stream("h2d")
        n = params.max_block_numel()
        self.slots = [device.empty(n, compute_dtype, name=f"weight slot {k}")
                      for k in range(num_slots)]
        # A slot's first load waits for the compute queued before its allocation.
        allocated = device.record(device.compute)
        self.free_events: list[Event | None] = [allocated] * num_slots
        self.free = deque(range(num_slots))
        self.staging = StagingPool(n, compute_dtype, count=num_slots, device=device)
        # the master -> compute dtype conversion runs here, ahead of the window that needs the
        # weights, off the engine thread (the only user of the staging ring)
        self.worker = device.host_workers("convert")
        self.paths: dict[int, str] = {}
        """Block -> its weight path (`set_paths`); host_convert where absent."""
        self.sources: dict[int, torch.Tensor] = {}
        """pinned_copy / gpu_cast: block -> the pinned host tensor its H2D reads."""
        self.landing: list[torch.Tensor] = []
        self.landing_free: list[Event | None] = []
        self.landing_open: deque = deque()
        self._pinned_masters: set[str] = set()
        self._copies: dict[int, torch.Tensor] = {}

    def set_paths(self, paths, optimizer=None) -> None:
        """Load block j by weight path `paths[j]` from now on (the plan's `weight_paths`;
        empty: every block host_convert). Call between steps.

        pinned_copy: with masters in the compute dtype, the masters are page-locked in place
        (`Device.pin_in_place`) and loaded directly; otherwise a pinned compute-dtype copy is
        allocated (booked as pinned), filled now and refreshed by `optimizer` in the job of
        each update (`BlockOptimizer.refresh`); an optimizer without that hook (the sharded
        one) keeps host_convert for those blocks. gpu_cast: the master is page-locked in place
        and lands in one of `GPU_CAST_LANDING_SLOTS` device buffers of the master dtype, cast
        into the weight slot on the compute stream by `ready`.
        """
        refresh = getattr(optimizer, "refresh", None)
        self.paths, self.sources = {}, {}
        for j, g in enumerate(self.params.blocks):
            path = paths[j] if paths else "host_convert"
            same = g.master.dtype == self.dtype
            if path == "pinned_copy" and not same:
                if refresh is None:
                    path = "host_convert"
                else:
                    optimizer.wait(g)  # its update wrote the master the copy is filled from
                    copy = self._copies.get(j)
                    if copy is None:  # kept across plans: a re-plan allocates nothing
                        copy = self._copies[j] = self.device.pinned_empty(
                            g.numel * self.slots[0].element_size(),
                            name=f"pinned compute-dtype copy of block {j}").view(self.dtype)
                    with self.device.host_work():
                        copy.copy_(g.master)
                    refresh[g.name] = copy
                    self.sources[j] = copy
            if path in ("gpu_cast", "pinned_copy") and j not in self.sources:
                self._pin_master(g)
                self.sources[j] = g.master
            if refresh is not None and path != "pinned_copy":
                refresh.pop(g.name, None)
            if path != "pinned_copy":
                self._copies.pop(j, None)  # freed (and unbooked) with its last reference
            self.paths[j] = path
        cast = [g.numel for j, g in enumerate(self.params.blocks)
                if self.paths[j] == "gpu_cast"]
        if cast and (not self.landing or self.landing[0].numel() < max(cast)):
            dtype = self.params.blocks[0].master.dtype
            self.landing = [self.device.empty(max(cast), dtype, name=f"weight landing slot {k}")
                            for k in range(GPU_CAST_LANDING_SLOTS)]
            self.landing_free = [self.device.record(self.device.compute)] * len(self.landing)
            self.landing_open = deque(range(len(self.landing)))

    def _pin_master(self, group: ParamGroup) -> None:
        if group.name not in self._pinned_masters:
            self.device.pin_in_place(group.master, name=f"{group.name} master")
            self._pinned_masters.add(group.name)

    def load(self, group: ParamGroup, block: int, *, resident: bool = False) -> WeightHandle:
        """Start copying `group`'s master weights to the device; returns the handle at once.

        The conversion worker takes a staging buffer, converts the master into it and queues
        the H2D; `ready` waits for that job (a wait on the "host" channel when it is late).
        Ordering: the H2D waits for the event recorded when the slot's previous consumer
        released it, so a prefetched buffer is never overwritten before its consumer is done. A
        resident buffer is a fresh allocation that no other block shares (a graph kept across
        windows references it); its H2D waits for the compute queued before the allocation,
        since the caching allocator may hand out memory that compute still uses.

        Raises:
            RuntimeError: no free slot (an engine bug: more than `num_slots` loads outstanding).
        """
        if resident:
            slot = None
            dst = self.device.empty(group.numel, self.dtype,
                                    name=f"resident weights of block {block}")
            after = self.device.record(self.device.compute)
        else:
            if not self.free:
                raise RuntimeError(f"no free weight slot for block {block}")
            slot = self.free.popleft()
            dst, after = self.slots[slot][:group.numel], self.free_events[slot]
        if self.paths.get(block, "host_convert") != "host_convert":
            return self._load_direct(group, block, dst, after, slot)
        job = self.device.submit(self.worker, self._stage_and_copy, dst, group.master, after,
                                 self.device.ledger.window, channel="host")
        return WeightHandle(block=block, flat=dst, event=None, slot=slot, job=job)

    def _load_direct(self, group: ParamGroup, block: int, dst: torch.Tensor, after,
                     slot: int | None) -> WeightHandle:
        """pinned_copy / gpu_cast: the H2D queued on the calling thread at once, from the
        pinned source, with no host work (the engine waited for the block's update, the
        source's last writer). gpu_cast lands the master in a landing buffer whose previous
        cast finished on the compute stream; `ready` casts it into `dst`."""
        self.device.wait_event(self.h2d, after)
        src, landing = self.sources[block], None
        if self.paths[block] == "gpu_cast":
            if not self.landing_open:
                raise RuntimeError(f"no free weight landing slot for block {block}")
            landing = self.landing_open.popleft()
            self.device.wait_event(self.h2d, self.landing_free[landing])
            event = self.device.copy(self.landing[landing][:group.numel], src, stream=self.h2d)
        else:
            event = self.device.copy(dst, src, stream=self.h2d)
        return WeightHandle(block=block, flat=dst, event=event, slot=slot, landing=landing)

    def _stage_and_copy(self, dst: torch.Tensor, master: torch.Tensor, after,
                        window: str) -> Event:
        """Worker: staging buffer, conversion, then the H2D after `after`; its event. Its bytes
        are booked to `window`, the window that asked for the load."""
        k, buf = self.staging.acquire()
        self.convert(buf[:master.numel()], master)
        self.device.wait_event(self.h2d, after)
        with self.device.ledger.booked_to(window):
            event = self.device.copy(dst, buf[:master.numel()], stream=self.h2d)
        self.staging.mark_in_flight(k, event)
        return event

    def event_of(self, handle: WeightHandle) -> Event:
        """The handle's H2D event, after its conversion job (sync point with the worker)."""
        if handle.job is not None:
            job, handle.job = handle.job, None
            self.device.wait_futures([job])
            handle.event = job.result()  # re-raises the worker's error (once)
        return handle.event

    def load_flat(self, dst: torch.Tensor, master: torch.Tensor) -> Event:
        """Copy a host master of any size (the ends) into device buffer `dst` through the
        staging ring, one staging buffer at a time: converted to the compute dtype on the host,
        so the device never holds an fp32 copy and nothing is copied from pageable memory.
        Returns the last copy's event (the copies run in order on the h2d stream).

        Ordering: the first copy waits for the compute queued before `dst`'s allocation. Runs
        on the conversion worker (the staging ring's one user); returns once it is queued."""
        self.device.wait_stream(self.h2d, self.device.compute)  # fresh memory compute may use
        job = self.device.submit(self.worker, self._stage_flat, dst, master,
                                 self.device.ledger.window, channel="host")
        self.device.wait_futures([job])
        return job.result()

    def _stage_flat(self, dst: torch.Tensor, master: torch.Tensor, window: str) -> Event:
        with self.device.ledger.booked_to(window):
            return self._stage_flat_chunks(dst, master)

    def _stage_flat_chunks(self, dst: torch.Tensor, master: torch.Tensor) -> Event:
        step = self.staging.buffers[0].numel()
        event = None
        for start in range(0, master.numel(), step):
            end = min(master.numel(), start + step)
            k, buf = self.staging.acquire()
            self.convert(buf[:end - start], master[start:end])
            event = self.device.copy(dst[start:end], buf[:end - start], stream=self.h2d)
            self.staging.mark_in_flight(k, event)
        return event

    def convert(self, staging: torch.Tensor, master: torch.Tensor) -> None:
        """Master -> compute dtype into a pinned staging buffer: host work (the observer's
        host channel)."""
        with self.device.host_work():
            staging.copy_(master)

    def ready(self, handle: WeightHandle) -> torch.Tensor:
        """The device buffer, after making compute wait for its load (no host sync beyond the
        conversion job's)."""
        self.device.wait_event(self.device.compute, self.event_of(handle))
        if handle.landing is not None:  # gpu_cast: the cast, on the compute stream
            k, handle.landing = handle.landing, None
            with self.device.compute_scope(allocations=False):
                handle.flat.copy_(self.landing[k][:handle.flat.numel()])
            self.landing_free[k] = self.device.record(self.device.compute)
            self.landing_open.append(k)
        return handle.flat

    def release(self, handle: WeightHandle) -> None:
        """Return the slot; its next load waits for the compute queued so far (also when the
        handle's conversion job failed: the slot is free again, the error propagates).

        A resident buffer is freed when the caller drops the handle, which a failed step does
        before compute waited for its H2D: the allocator keeps its memory until the h2d stream's
        queued work ran (`record_stream`; no wait)."""
        try:
            self.event_of(handle)  # its job has queued the copy before the slot is reused
        finally:
            if handle.landing is not None:  # never cast (a failed step): free after its copy
                k, handle.landing = handle.landing, None
                self.device.wait_event(self.device.compute, handle.event)
                self.landing_free[k] = self.device.record(self.device.compute)
                self.landing_open.append(k)
            if handle.slot is not None:
                self._free_slot(handle.slot)
            elif handle.event is not None:
                self.device.record_stream(handle.flat, self.h2d)

    def _free_slot(self, slot: int) -> None:
        self.free_events[slot] = self.device.record(self.device.compute)
        self.free.append(slot)

    def close(self) -> None:
        """Stop the conversion worker (after its queued jobs)."""
        self.worker.shutdown(wait=True)


class GradDrain:
    """Device gradients -> host accumulators, in order, through a bounded buffer pool.

    Gradients travel in the compute dtype (the plan's G bytes; MegaTrain drains bf16 too): each
    drain copies the flat gradient into a pinned buffer on the "d2h" stream (after the compute
    that produced it; the step's first gradient of a group whose accumulator has the gradient's
    dtype lands in the accumulator itself, `_land_in_accumulator`), and an accumulation worker thread (off the main thread's critical
    path) waits for the copy's event and adds the buffer into the host
    accumulator; the buffer is reused, and the drain's `on_done` runs on the calling thread,
    only once that job finished. The ends' fp32 gradient, larger than one buffer and
    accumulated on the device over the step, drains once per step through `drain_fp32`. The
    accumulator has the master dtype: a bf16 one rounds each contribution once
    (`ParamGroup.accumulate_grad`).

    Args:
        device: the device API.
        numel: elements per buffer (the largest block).
        dtype: the compute dtype (of the gradients on the link).
        count: pinned buffers in flight (the planner counts
            `lazytrain.contract.GRAD_DRAIN_BUFFERS`).
        land_all: one micro-batch per step: every block's gradient lands in its accumulator,
            cast on the device when the dtypes differ (`count` device buffers of the
            accumulator's dtype; the planner counts them, `planner/build.py`
            `grad_cast_bytes`).
    """

    def __init__(self, device: Device, numel: int, *, dtype: torch.dtype = torch.float32,
                 count: int = GRAD_DRAIN_BUFFERS, land_all: bool = False) -> None:
        self.device = device
        self.d2h = device.stream("d2h")
        self.pending: deque = deque()
        size = torch.empty((), dtype=dtype).element_size()
        self.numel = numel
        self.buffers = [device.pinned_empty(numel * size, name=f"gradient drain buffer {k}")
                        .view(dtype) for k in range(count)]
        self.free = deque(range(len(self.buffers)))
        self.worker = device.host_workers("accum")
        self._pinned: set[str] = set()
        self.land_all = land_all
        self.cast: list[torch.Tensor] = []
        """land_all: device buffers (the accumulator's dtype, the largest block) the first
        gradient of another dtype is cast into before its D2H; allocated at the first cast."""
        self.cast_events: list[Event | None] = [None] * count

    def drain(self, group: ParamGroup, grad: torch.Tensor | None, *, first: bool,
              on_done: Callable[[], None] | None = None) -> Event | None:
        """Queue one gradient ([group.numel] on the device, any float dtype); `on_done` runs once
        all of it is in the host accumulator. Returns the event of the last copy reading `grad`
        (the device buffer may be rewritten once compute waited for it), None without one."""
        if grad is None:
            group.accumulate_grad(None, first=first)
            if on_done is not None:
                on_done()
            return None
        self.device.wait_stream(self.d2h, self.device.compute)  # grad is complete on compute
        if first and (grad.dtype == group.grad.dtype
                      or (self.land_all and group.numel <= self.numel)):
            return self._land_in_accumulator(group, grad, on_done)
        starts = range(0, group.numel, self.numel)
        for start in starts:
            end = min(group.numel, start + self.numel)
            while not self.free or len(self.pending) >= len(self.buffers):
                self._finish_oldest()  # at most `count` drains in flight, landings included
            k = self.free.popleft()
            buf = self.buffers[k][:end - start]
            event = self.device.copy(buf, grad[start:end], stream=self.d2h)
            job = self.device.submit(self.worker, self._accumulate, event, buf, group,
                                     first=first, start=start, channel="d2h")
            last = start == starts[-1]
            self.pending.append((job, k, on_done if last else None))
        # the device gradient may be freed by compute before the copies ran
        self.device.record_stream(grad, self.d2h)
        return event

    def drain_fp32(self, group: ParamGroup, grad: torch.Tensor,
                   on_done: Callable[[], None] | None = None) -> Event:
        """Queue the step's one drain of an fp32 device gradient of any size (the ends',
        accumulated on the device over the step's micro-batches), overwriting the host
        accumulator; `on_done` runs once all of it is there. Returns the event of the last copy
        reading `grad`.

        Every D2H copies fp32 into fp32: into the accumulator itself when it is fp32
        (`_land_in_accumulator`), else chunk by chunk into the pinned drain buffers viewed as
        fp32 (half a block's compute-dtype elements per bf16 buffer), the accumulation worker
        rounding each chunk into the accumulator. No converting D2H, so no temporary that the
        copy would allocate on the device outside the ledger.
        """
        self.device.wait_stream(self.d2h, self.device.compute)  # grad is complete on compute
        if group.grad.dtype == grad.dtype:
            return self._land_in_accumulator(group, grad, on_done)
        step = self.buffers[0].numel() * self.buffers[0].element_size() // grad.element_size()
        starts = range(0, group.numel, step)
        for start in starts:
            end = min(group.numel, start + step)
            while not self.free or len(self.pending) >= len(self.buffers):
                self._finish_oldest()
            k = self.free.popleft()
            buf = self.buffers[k].view(torch.uint8)[:(end - start) * grad.element_size()]
            buf = buf.view(grad.dtype)
            event = self.device.copy(buf, grad[start:end], stream=self.d2h)
            job = self.device.submit(self.worker, self._accumulate, event, buf, group,
                                     first=True, start=start, channel="d2h")
            self.pending.append((job, k, on_done if start == starts[-1] else None))
        self.device.record_stream(grad, self.d2h)
        return event

    def _land_in_accumulator(self, group: ParamGroup, grad: torch.Tensor,
                             on_done: Callable[[], None] | None) -> Event:
        """The step's first gradient of `group` in the accumulator's dtype, or cast into it on
        the compute stream (`land_all`, one micro-batch per step): one D2H straight into the
        accumulator (page-locked in place), no landing buffer and no host add. The accumulator is free: the previous step's update of the group, its last
        reader and writer, finished before the group's weights loaded for this step. A
        worker job waits for the copy, so `on_done` runs after it as on the landing path."""
        if group.name not in self._pinned:
            self.device.pin_in_place(group.grad, name=f"{group.name} gradient accumulator")
            self._pinned.add(group.name)
        while len(self.pending) >= len(self.buffers):  # as many device gradients in flight as
            self._finish_oldest()                       # the landing path keeps (the plan's)
        src, k = grad, None
        if grad.dtype != group.grad.dtype:  # land_all: cast on the device first
            k = self.free.popleft()  # free: fewer than `count` drains hold an index
            src = self._cast_buffer(k, group.grad.dtype)[:group.numel]
            self.device.wait_event(self.device.compute, self.cast_events[k])  # last D2H read
            with self.device.compute_scope(allocations=False):
                src.copy_(grad)
            self.device.wait_stream(self.d2h, self.device.compute)
        event = self.device.copy(group.grad, src, stream=self.d2h)
        if k is not None:
            self.cast_events[k] = event
        job = self.device.submit(self.worker, self.device.host_wait, event, channel="d2h")
        self.pending.append((job, k, on_done))
        self.device.record_stream(grad, self.d2h)
        return event

    def _cast_buffer(self, k: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.cast:
            self.cast = [self.device.empty(self.numel, dtype, name=f"gradient cast buffer {i}")
                         for i in range(len(self.buffers))]
            after = self.device.record(self.device.compute)  # fresh memory compute may use
            self.cast_events = [after] * len(self.buffers)
        return self.cast[k]

    def _accumulate(self, event, buf: torch.Tensor, group: ParamGroup, *, first: bool,
                    start: int) -> None:
        """Worker: add one drained gradient (chunk) into the host accumulator."""
        self.device.host_wait(event)  # sync point: the copy into buf is complete
        with self.device.host_work():
            group.accumulate_grad(buf, first=first, start=start)

    def _finish_oldest(self) -> None:
        job, k, on_done = self.pending.popleft()
        self.device.wait_futures([job])  # ordered after the worker's read of the buffer
        job.result()  # re-raises the worker's error
        if k is not None:  # None: landed in the accumulator, no buffer
            self.free.append(k)
        if on_done is not None:
            on_done()

    def make_room(self) -> None:
        """Finish the oldest drains until a buffer is free and fewer than `count` drains are in
        flight, so the next `drain` of one buffer (or landing) does not block: the engine calls
        it after a window's compute is queued."""
        while self.pending and (not self.free or len(self.pending) >= len(self.buffers)):
            self._finish_oldest()  # as `drain` would: a free buffer, fewer drains in flight

    def flush(self) -> None:
        """Finish every queued drain."""
        while self.pending:
            self._finish_oldest()

    def close(self) -> None:
        """Finish every queued drain and stop the worker."""
        self.flush()
        self.worker.shutdown(wait=True)


class WindowMeter:
    """Per-window wall time: timing events on the compute stream (CUDA) or wall clock (CPU).

    Use `with meter.window("f3"):`; `times_ms()` resolves the events (sync point, call once per
    step) and returns window name -> ms summed over micro-batches.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.records: list[tuple[str, object, object]] = []

    def window(self, name: str):
        return _MeterWindow(self, name)

    def reset(self) -> None:
        self.records.clear()

    def times_ms(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, start, end in self.records:
            out[name] = out.get(name, 0.0) + self.device.elapsed_ms(start, end)
        return out


class _MeterWindow:
    def __init__(self, meter: WindowMeter, name: str) -> None:
        self.meter, self.name = meter, name

    def __enter__(self):
        self.start = self.meter.device.timing_event()
        return self

    def __exit__(self, *exc) -> None:
        self.meter.records.append((self.name, self.start, self.meter.device.timing_event()))
