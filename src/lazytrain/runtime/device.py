"""The device API: every stream, event, copy, wait and allocation the runtime makes.

Owns the ordering vocabulary of the runtime, so that one object decides how it is carried out
(`runtime.device`):

| backend        | what runs                                                                      |
|----------------|--------------------------------------------------------------------------------|
| `cuda`         | real CUDA streams and events, pinned host memory, the caching allocator        |
|                | (`runtime/cuda_device.py`)                                                     |
| `cpu`          | every copy synchronous on the calling thread; events are complete at once      |
| `cpu-checked`  | `cpu`'s numerics bit for bit, plus a happens-before checker over every access   |
|                | (`runtime/hb_checker.py`): the first unordered access raises `OrderingViolation`|
| `cpu-threaded` | copy streams as worker threads with seeded random delays, real events, and     |
|                | pool buffers poisoned when released (`runtime/threaded_device.py`)              |

Vocabulary (CUDA semantics, torch 2.11+):
- a `Stream` is a queue of device work; `compute` is the stream the engine's kernels run on,
  fixed at construction (the stream current then); copy streams come from `stream(name)`;
- `record(stream)` returns an `Event` marking the work queued on it so far; `wait_event` makes
  later work of a stream wait for an event (no host block); `wait_stream` waits for all work
  queued on another stream so far; `host_wait` blocks the calling host thread until the event
  completed (a sync point);
- `copy(dst, src, stream=...)` queues an asynchronous copy on a stream and returns its event;
  the caller keeps `src` and `dst` alive and unmodified until the event completed;
- `record_stream(t, stream)` tells the caching allocator that `t` is used on `stream`, so its
  memory is not reused before that stream's queued work completes;
- `empty(...)` allocates device memory on the compute stream (the caching allocator may hand
  out memory that the compute stream's queued work still uses: another stream's first use of
  it must wait for the compute stream); `pinned_empty(nbytes)` allocates page-locked host
  memory;
- `recycle(t)` declares that a pool takes back a buffer for reuse (checked / poisoned by the
  CPU checkers); `host_access(t, write=...)` declares a host read or write that is not a torch
  op (e.g. `os.pwrite` from an NVMe thread);
- `submit(executor, fn, ...)` runs host work on a worker thread (NVMe I/O, the optimizer); the
  job happens after everything the submitting thread did, and `wait_futures` makes the waiter
  happen after the job (the CUDA backend also sets the worker's current device);
- `timing_event` / `elapsed_ms` measure a stream's time (CUDA events with timing; wall clock
  on the CPU backends);
- `ledger` (`runtime/ledger.py`) books every allocation made here to its owner (reserved
  before the memory is requested, so a budget overflow is an error naming the owner, not an
  allocator OOM) and every copy's bytes to its channel; on the CPU backends `compute_scope`
  also books the compute ops' fresh outputs (block workspace, kept graphs, head logits).

This module holds the API and the `cpu` backend; the other backends subclass `Device` in their
own modules, and `runtime/backends.py` (`make_device`, `as_device`) builds one by name. Nothing
outside these modules calls `torch.cuda`'s stream, event or copy functions;
`tests/runtime/test_device_api.py` enforces it.

Knows nothing about plans, tiers, blocks or files.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from lazytrain.runtime.ledger import ComputeAllocations, Ledger

HOST_WORKER_SHARES = {"adamw": 0.5, "convert": 0.25, "accum": 0.25, "nvme": 0.0}
"""Share of the host's cores (less the engine thread's one) each host worker's torch ops use
on CUDA (`Device.host_threads`): the AdamW update is the host's largest job, the conversion and
the gradient accumulation run beside it; NVMe threads make system calls (one thread each).
A heuristic split (the workers are busy at once in steady state), not a measured optimum."""

PAGE_BYTES = 4096
"""Alignment of host buffers handed out by `pinned_empty` (bytes): the page size, which is
what `cudaHostAlloc` returns, and what O_DIRECT needs for NVMe I/O."""


class Stream:
    """A logical stream: `name` ("compute", "h2d", "d2h", ...) and the backend's handle."""

    __slots__ = ("name", "raw")

    def __init__(self, name: str, raw=None) -> None:
        self.name, self.raw = name, raw

    def __repr__(self) -> str:
        return f"Stream({self.name})"


class Event:
    """A point in one stream's queue. `synchronize()` blocks the host until it completed;
    `query()` says whether it has (never blocks)."""

    __slots__ = ("device", "stream", "raw", "__weakref__")

    def __init__(self, device: "Device", stream: Stream, raw=None) -> None:
        self.device, self.stream, self.raw = device, stream, raw

    def synchronize(self) -> None:
        self.device.host_wait(self)

    def query(self) -> bool:
        return self.device.query(self)


class Device:
    """The synchronous CPU backend (`runtime.device: cpu`), and the interface of all four.

    Every copy runs at once on the calling thread, so every event is complete when recorded
    and every ordering rule holds trivially. The subclasses keep these numerics and change only
    how ordering is carried out or checked.

    Args:
        seed: seeds the delays of `cpu-threaded` (ignored elsewhere).
    """

    kind = "cpu"
    is_cuda = False

    def __init__(self, *, seed: int = 0) -> None:
        self.torch_device = torch.device("cpu")
        self.compute = Stream("compute")
        self._streams: dict[str, Stream] = {"compute": self.compute}
        self.ledger = Ledger()
        self._scope = threading.local()

    # --- streams and events ------------------------------------------------------------------

    def stream(self, name: str) -> Stream:
        """The copy stream called `name` (created on first use; one per name per device)."""
        if name not in self._streams:
            self._streams[name] = self._new_stream(name)
        return self._streams[name]

    def _new_stream(self, name: str) -> Stream:
        return Stream(name)

    def record(self, stream: Stream) -> Event:
        """An event marking the work queued on `stream` so far."""
        return Event(self, stream)

    def wait_event(self, stream: Stream, event: Event | None) -> None:
        """Later work on `stream` waits for `event` (no host block). None: nothing to wait for.

        The compute stream's waits are reported to the observer on the event's channel."""
        if event is None:
            return
        if stream is self.compute and self._observing():
            self._observed_compute_wait(stream, event)
        else:
            self._wait_event(stream, event)

    def _wait_event(self, stream: Stream, event: Event) -> None:
        """Backend: make `stream` wait for `event`."""

    def _observed_compute_wait(self, stream: Stream, event: Event) -> None:
        """The compute stream's wait, timed on the host (the CPU backends run compute there)."""
        self.observer.on_block()
        t0 = time.perf_counter()
        self._wait_event(stream, event)
        self.observer.on_wait(channel_of(event.stream), time.perf_counter() - t0)

    def wait_stream(self, stream: Stream, other: Stream) -> None:
        """Later work on `stream` waits for all work queued on `other` so far."""

    def host_wait(self, event: Event | None) -> None:
        """Block the calling thread until `event` completed (sync point); the observer gets the
        blocked time on the event's channel."""
        if event is None:
            return
        t0 = self._block_begins()
        self._host_wait(event)
        if t0 is not None:
            self.observer.on_wait(channel_of(event.stream), time.perf_counter() - t0)

    def _host_wait(self, event: Event) -> None:
        """Backend: block until `event` completed."""

    # --- observation (runtime/instrument.py) --------------------------------------------------

    observer = None
    """Gets `on_wait(channel, s)` (the engine's thread blocked), `on_stream_wait(channel, a, b)`
    (CUDA: the compute stream waited, timing events), `on_busy(channel, s)` /
    `on_busy_events(channel, a, b)` (a channel moved bytes) and `on_host(s)` (host work); set
    by `set_observer`, an explicit interface: nothing of the runtime is patched. Before the
    engine's thread blocks (each wait that ends in `on_wait`, its host work that ends in
    `on_host`) it gets `on_block()`, so that compute is timed only between blocks."""

    def set_observer(self, observer) -> None:
        """Report waits, channel busy time and host work to `observer` (None: stop); waits are
        those of the calling thread (the engine's)."""
        self.observer = observer
        self._observer_thread = threading.current_thread()

    def _observing(self) -> bool:
        return (self.observer is not None
                and threading.current_thread() is getattr(self, "_observer_thread", None))

    def _block_begins(self) -> float | None:
        """On the observed thread: `on_block()` and the wall clock (s) of the block's start;
        elsewhere None (nothing is reported)."""
        if not self._observing():
            return None
        self.observer.on_block()
        return time.perf_counter()

    @contextlib.contextmanager
    def waiting(self, channel: str):
        """Time a host block on `channel` that is not one of this API's waits (e.g. a
        `concurrent.futures.wait` with a timeout) for the observer."""
        t0 = self._block_begins()
        try:
            yield
        finally:
            if t0 is not None:
                self.observer.on_wait(channel, time.perf_counter() - t0)

    @contextlib.contextmanager
    def host_work(self):
        """Time host work (weight conversion, gradient accumulation) for the observer, on any
        thread."""
        self._block_begins()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.observer is not None:
                self.observer.on_host(time.perf_counter() - t0)

    def query(self, event: Event) -> bool:
        return True

    def synchronize(self) -> None:
        """Block the calling thread until every stream's queued work completed."""

    # --- copies and memory -------------------------------------------------------------------

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, stream: Stream) -> Event:
        """Queue `dst.copy_(src)` on `stream` (after the stream's waits); returns its event.

        dtype conversion happens in the copy (fp32 host -> bf16 device, bf16 -> fp32). The
        caller keeps both tensors alive and unmodified until the event completed.
        """
        self._book_copy(dst, stream)
        if not self._observing() or self.copies_async:
            return self._copy(dst, src, stream)
        t0 = self._block_begins()  # a synchronous copy: busy, and compute waits for it
        event = self._copy(dst, src, stream)
        seconds = time.perf_counter() - t0
        self.observer.on_busy(channel_of(stream), seconds)
        self.observer.on_wait(channel_of(stream), seconds)
        return event

    copies_async = False
    """True where copies run beside the calling thread (cuda, cpu-threaded)."""

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        """Backend: queue the copy; its event."""
        dst.copy_(src)
        return self.record(stream)

    def _book_copy(self, dst: torch.Tensor, stream: Stream) -> None:
        """The copy's bytes (the destination's) on the channel of its stream."""
        channel = "h2d" if stream.name.endswith("h2d") else "d2h"
        self.ledger.moved(channel, dst.numel() * dst.element_size())

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """The caching allocator must not reuse `tensor`'s memory before `stream`'s work queued
        until the tensor is freed has completed (torch.Tensor.record_stream)."""

    def empty(self, shape, dtype: torch.dtype, *, name: str | None = None) -> torch.Tensor:
        """Device memory [shape] of `dtype`, allocated on the compute stream (contents
        undefined). `name` is its ledger owner and labels it in checker messages.

        Raises:
            HbmBudgetExceeded: the ledger's budget for the current window would be passed
                (raised before the memory is requested).
        """
        numel = shape if isinstance(shape, int) else int(torch.Size(shape).numel())
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        owner = name or "device buffer"
        self.ledger.reserve("hbm", owner, nbytes)
        with self.ledger.quiet():
            t = self._alloc_device(shape, dtype)
        self.ledger.track(t, "hbm", owner, reserved=nbytes)
        return t

    def _alloc_device(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def pinned_empty(self, nbytes: int, *, name: str | None = None) -> torch.Tensor:
        """Host ``uint8`` [nbytes], page-locked on CUDA, PAGE_BYTES-aligned (contents undefined).

        Aligned by over-allocating one page and slicing (the slice keeps the allocation
        alive); on CUDA those exact pages are then page-locked with `cudaHostRegister`
        (`CudaDevice._alloc_pinned`). The ledger books `nbytes` to `name`.

        Raises:
            HostBudgetExceeded: the ledger's pinned budget would be passed.
        """
        owner = name or "pinned host buffer"
        self.ledger.reserve("pinned", owner, nbytes)
        with self.ledger.quiet():
            t = self._alloc_pinned(nbytes)
        self.ledger.track(t, "pinned", owner, reserved=nbytes)
        return t

    def _alloc_pinned(self, nbytes: int) -> torch.Tensor:
        raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
        shift = (-raw.data_ptr()) % PAGE_BYTES
        return raw[shift:shift + nbytes]

    def host_tensor(self, tensor: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
        """Declare `tensor` host (DRAM) memory that the runtime keeps, e.g. a master buffer;
        returns it. The checker then logs its accesses as host work."""
        return tensor

    def batch_to_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A host batch tensor (input ids, labels, mask, positions: [B, S], a few KB) on the
        device, queued on the current stream (the compute stream inside `compute_scope`).
        CPU backends: the tensor itself (already there). None stays None."""
        if t is None or t.device == self.torch_device:
            return t
        return t.to(self.torch_device)

    def pin_in_place(self, tensor: torch.Tensor, *, name: str | None = None) -> None:
        """Page-lock a host tensor the runtime already holds (a master buffer loaded directly
        by the pinned_copy or gpu_cast weight paths), so its H2D runs asynchronously. Not
        booked in the ledger: its bytes are host states, already in the DRAM budget. CPU
        backends: nothing to lock."""

    def recycle(self, tensor: torch.Tensor) -> None:
        """A pool takes `tensor` back for reuse: every copy and kernel that touched it must have
        completed (host) or be ordered before its next user (device)."""

    def discard(self, tensor: torch.Tensor) -> None:
        """The caller drops its device tensor (a boundary's HBM or prefetched copy): its memory
        goes back to the allocator once nothing else holds it (`cpu-threaded` poisons it then,
        so a copy or kernel still using it reads poison)."""

    def host_access(self, tensor: torch.Tensor, *, write: bool, what: str) -> None:
        """Declare a host read or write of `tensor` that is not a torch op (`what` names it)."""

    def begin_async(self, *, reads=(), writes=(), what: str):
        """Declare host work another library runs on its own thread from now on (a gloo
        `async_op` collective reading and writing host tensors); returns a token for
        `end_async`, which the caller calls once it waited for that work. The checker logs the
        accesses on an actor of their own, ordered after the calling thread."""
        return None

    def end_async(self, token) -> None:
        """The caller waited for the work of `begin_async`'s `token`: it is ordered after it."""

    # --- host threads ------------------------------------------------------------------------

    def host_threads(self, role: str) -> int:
        """Intra-op torch threads of host worker `role` (`HOST_WORKER_SHARES`' keys).

        CPU backends: 1. The engine thread's compute owns every core (`runtime.threads`); the
        workers' ops (conversion, accumulation, AdamW: memory-bound loops) run beside it, and
        torch's default of one thread per core in each of them oversubscribes the cores (on 2
        cores the engine step took 1.45x instead of 2.05x HF's once the workers ran one thread
        each: benchmarks/engine_cpu.py). CUDA: the device computes, the engine thread only
        launches, so the workers share the rank's other cores by `HOST_WORKER_SHARES`.

        The rank's cores: the process's CPU affinity set divided among the node's ranks
        (`local_ranks`), since every rank of a node sees the same set; sized from the whole
        set, N ranks would run N times as many worker threads as there are cores. A launcher
        that binds each rank to its own cores (numactl per rank) gets 1/N of them: say so
        with LOCAL_WORLD_SIZE=1 per rank.

        Raises:
            KeyError: unknown role.
            ValueError: LOCAL_WORLD_SIZE is not an integer >= 1.
        """
        share = HOST_WORKER_SHARES[role]
        if not self.is_cuda:
            return 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        rank_cores = max(1, cores // local_ranks())
        return max(1, int((rank_cores - 1) * share))

    def host_workers(self, role: str, *, max_workers: int = 1) -> ThreadPoolExecutor:
        """A pool of `max_workers` host worker threads named `lazytrain-<role>`, each running
        torch ops on `host_threads(role)` threads. Jobs go through `submit`.

        Torch's thread count is per thread, but a thread gets it at its first parallel op from
        the count last set by any thread. So the caller's count is fixed first, every worker is
        started here and fixes its own (`_set_worker_threads`), and then the caller's count is
        set again: the engine thread keeps its count, and threads started later (a loader,
        another engine) get it too, not the workers'.

        Raises:
            KeyError: unknown role.
        """
        own = torch.get_num_threads()  # initialises the caller's count before a worker runs
        pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"lazytrain-{role}",
                                  initializer=_set_worker_threads,
                                  initargs=(self.host_threads(role),))
        # one job per thread, so each must start; the timeout (s) ends the wait if one cannot
        # (its initializer failed: the others would wait forever)
        started = threading.Barrier(max_workers, timeout=60.0)
        for job in [pool.submit(started.wait) for _ in range(max_workers)]:
            job.result()
        torch.set_num_threads(own)  # what threads started from now on inherit
        return pool

    def submit(self, executor: Executor, fn: Callable, *args, channel: str = "host",
               **kwargs) -> Future:
        """Run `fn(*args, **kwargs)` on `executor`'s worker thread, after everything the calling
        thread did; `wait_futures` orders the waiter after it. `channel` names what a wait for
        the job is a wait for ("nvme_read", "nvme_write", "optimizer", "d2h", "host")."""
        future = self._submit(executor, fn, *args, **kwargs)
        future.lazytrain_channel = channel  # type: ignore[attr-defined]
        return future

    def _submit(self, executor: Executor, fn: Callable, *args, **kwargs) -> Future:
        return executor.submit(fn, *args, **kwargs)

    def wait_futures(self, futures: Sequence[Future]) -> list[BaseException | None]:
        """Wait for every future; returns their exceptions (None for success), in order. The
        observer gets each wait on its future's channel."""
        observing = self._observing()
        errors = []
        for f in futures:
            # a finished job blocks nobody and is not reported (on CUDA: two timing events
            # fewer per NVMe chunk already read or written by a window's barrier)
            t0 = self._block_begins() if observing and not f.done() else None
            errors.append(f.exception())
            if t0 is not None:
                self.observer.on_wait(getattr(f, "lazytrain_channel", "host"),
                                      time.perf_counter() - t0)
        self._joined(futures)
        return errors

    def _joined(self, futures: Sequence[Future]) -> None:
        """Backend: the caller is now ordered after the futures' jobs (the checker's clocks)."""

    # --- scopes and timing -------------------------------------------------------------------

    def compute_scope(self, *, allocations: bool = True):
        """Context for the engine's compute: with `allocations` the ledger books fresh op
        outputs to the current compute owner (CPU backends: a dispatch mode, a few tens of us
        per op), and the checker logs every torch op inside it."""
        if getattr(self._scope, "active", False) or not allocations:
            return contextlib.nullcontext()
        return _Scope(self._scope, ComputeAllocations(self.ledger))

    def host_scope(self, *, allocations: bool = True):
        """Context for torch ops that are host work of the calling thread, not compute-stream
        work (`StreamedLM`'s `host` weight mode: a cpu backend runs the blocks on the host
        masters); used outside the engine's windows. The ledger books fresh op outputs as in
        `compute_scope`; `cpu-checked` logs every op inside as this thread's host work."""
        return self.compute_scope(allocations=allocations)

    def sync_audit(self, phase: str):
        """Context on the engine's thread: the implicit host-device syncs made inside it (a
        device tensor's `item`, `float`, `bool`, `tolist`, `.cpu()`) are counted under `phase`
        ("micro_batch", "step_end") where the backend audits them (`cpu-checked`:
        `runtime/sync_audit.py`); elsewhere it does nothing."""
        return contextlib.nullcontext()

    def timing_event(self, stream: Stream | None = None):
        """A timestamp on `stream` (default compute): a CUDA timing event, or wall-clock s."""
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        """Time between two `timing_event`s, ms (resolves CUDA events: sync point)."""
        return (end - start) * 1e3

    def close(self) -> None:
        """Stop worker threads (cpu-threaded); idempotent."""


class _Scope:
    """Enters the ledger's compute-allocation mode on this thread (nested scopes: no-ops)."""

    def __init__(self, flag: threading.local, mode) -> None:
        self.flag, self.mode = flag, mode

    def __enter__(self):
        self.flag.active = True
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.flag.active = False
        return self.mode.__exit__(*exc)


def local_ranks() -> int:
    """Ranks of this job on this node: torchrun's LOCAL_WORLD_SIZE, 1 without it.

    Raises:
        ValueError: LOCAL_WORLD_SIZE is set but not an integer >= 1.
    """
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r}: must be an integer >= 1 (the ranks on "
                         f"this node, as torchrun sets it); unset it for one rank")
    return int(raw)


def _set_worker_threads(count: int) -> None:
    """A host worker's initializer: its torch thread count is `count` for good. The query first
    gives the thread its count (torch does that at a thread's first parallel op, from the count
    last set by any thread); set before that, it would be replaced then."""
    torch.get_num_threads()
    torch.set_num_threads(count)


def channel_of(stream: Stream) -> str:
    """The byte channel of a copy stream: "h2d" (h2d, ckpt_h2d) or "d2h" (d2h, ckpt_d2h)."""
    return "h2d" if stream.name.endswith("h2d") else "d2h"
