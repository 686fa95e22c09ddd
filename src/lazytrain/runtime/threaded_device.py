"""`runtime.device: cpu-threaded`: copy streams as delayed worker threads, real events, poison.

The compute stream is the calling thread (kernels run at once, as on the `cpu` backend). Every
other stream is one worker thread that runs its queued copies in order, each after a random
delay drawn from a seeded generator (`MIN_DELAY_S` to `MAX_DELAY_S`), so copies really overlap
compute and finish late: later than the next windows' kernels, unless someone waits. Events are
real: waiting for one (`host_wait`, the compute stream's `wait_event`, which blocks the calling
thread since its kernels run as soon as they are issued, or another stream's `wait_event`)
cuts the delay of that copy and of every copy queued before it on its stream. Correct code
therefore runs at nearly full speed, and code that reads a copy's destination without waiting
reads it long before the copy ran.

Host worker jobs (`submit`: NVMe reads and writes, the weight conversion, the gradient
accumulation, the optimizer) start after a random delay too (`JOB_DELAY_S`), cut short when
someone waits for the job or a later one of its pool (`wait_futures`, or
`concurrent.futures.wait` on it): a reader that misses the wait for an NVMe read or an update
reads the bytes before the job wrote them.

Buffers handed back to a pool (`recycle`) are poisoned: NaN for floating dtypes, 0xFF bytes
otherwise. A missing wait then shows up as corrupted gradients, not as a lucky pass: a copy
that reads a buffer after its pool took it back reads poison, and a consumer that reads a
prefetched buffer before its copy ran reads the previous contents.

A boundary's device copy that the activation store drops (`discard`) is poisoned too, when
nothing but the store and the copies still queued held it: on a GPU its memory goes back to the
allocator there, so a copy still reading it, or a later buffer handed the same memory and read
before its copy landed, reads poison rather than the old values.

Numerics are those of `cpu` when the ordering is right (every copy is the same `copy_`).

What it can show: missing consumer-side waits (compute reading a copy's destination, the host
reading a D2H destination, before the copy ran). What it cannot: a missing producer-side or
host-side wait where an earlier compute wait already synced the host (compute runs on the host
thread here, so every compute wait blocks it, which a GPU's does not); `cpu-checked` orders
those by clocks, not by timing.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from concurrent.futures import Executor, Future
from typing import Callable, Sequence

import torch

from lazytrain.runtime.device import Device, Event, Stream, channel_of

MIN_DELAY_S, MAX_DELAY_S = 0.1, 0.2
"""Range of the random delay before each queued copy that nobody waits for (s): longer than a
tiny model's whole window even on a loaded machine, so an unwaited copy lands after the kernels
that should have waited for it. A wait cuts the delay short, so the test matrix does not pay
it."""


JOB_DELAY_S = (0.02, 0.05)
"""Range of the random delay before a host worker job starts (s) that nobody waits for yet:
longer than a tiny model's block, short enough that a job waited for only by a timed
`concurrent.futures.wait` (NVMe) costs the test matrix little."""

POLL_S = 0.002
"""How often a delayed job looks for a `concurrent.futures.wait` on its future (s)."""


class _Job:
    """One queued copy (or wait): its delay, a flag that cuts the delay, its completion."""

    __slots__ = ("fn", "pause", "hurry", "done")

    def __init__(self, fn: Callable[[], None], pause: float) -> None:
        self.fn, self.pause = fn, pause
        self.hurry, self.done = threading.Event(), threading.Event()


class _Worker:
    """One stream's thread: runs queued jobs in order."""

    def __init__(self, name: str, rng: random.Random) -> None:
        self.rng = rng
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: list[_Job] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"stream-{name}", daemon=True)
        self.thread.start()

    def put(self, job: _Job | None) -> None:
        if job is not None:
            with self.lock:
                self.pending.append(job)
        self.jobs.put(job)

    def hurry_until(self, job: _Job) -> None:
        """Cut the delay of `job` and of every job queued before it (FIFO stream order)."""
        with self.lock:
            for queued in self.pending:
                queued.hurry.set()
                if queued is job:
                    break

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.pause:
                job.hurry.wait(job.pause)
            try:
                job.fn()
            finally:
                job.fn = None  # drop the copy's tensors: the buffers' lifetime is the caller's
                with self.lock:
                    self.pending.remove(job)
                job.done.set()


class ThreadedDevice(Device):
    """Copy streams on delayed worker threads; see the module docstring.

    Args:
        seed: seeds the delays (same seed, same delays per stream).
    """

    kind = "cpu-threaded"

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self._seed = seed
        self._workers: dict[str, _Worker] = {}
        self._last: dict[str, threading.Event] = {}
        self._closed = False
        self.errors: list[BaseException] = []
        self._job_rng = random.Random(f"{seed}:jobs")
        self._job_lock = threading.Lock()
        self._queued: dict[int, list[tuple[Future, threading.Event]]] = {}
        self._copy_refs: dict[int, int] = {}
        """Storage data_ptr -> tensors that queued copies not yet run hold on it."""
        """id(executor) -> its delayed jobs not yet hurried, in submission order."""

    def _worker(self, stream: Stream) -> _Worker:
        w = self._workers.get(stream.name)
        if w is None:
            rng = random.Random(f"{self._seed}:{stream.name}")
            w = self._workers[stream.name] = _Worker(stream.name, rng)
        return w

    def _enqueue(self, stream: Stream, fn: Callable[[], None], *, delay: bool) -> _Job:
        if self._closed:
            raise RuntimeError("cpu-threaded device is closed: its stream threads have stopped")
        worker = self._worker(stream)
        pause = worker.rng.uniform(MIN_DELAY_S, MAX_DELAY_S) if delay else 0.0

        def run():
            try:
                fn()
            except BaseException as exc:  # surfaced at the next host_wait / synchronize
                self.errors.append(exc)
        job = _Job(run, pause)
        worker.put(job)
        self._last[stream.name] = (worker, job)
        return job

    def record(self, stream: Stream) -> Event:
        if stream is self.compute:
            return Event(self, stream, None)  # compute ran already
        return Event(self, stream, self._last.get(stream.name))

    def _wait(self, raw) -> None:
        worker, job = raw
        worker.hurry_until(job)
        job.done.wait()

    copies_async = True

    def _wait_event(self, stream: Stream, event: Event) -> None:
        if event.raw is None:
            return
        if stream is self.compute:
            self._wait(event.raw)  # kernels run when issued: the host must wait here
            self._raise_errors()
            return
        raw = event.raw
        self._enqueue(stream, lambda: self._wait(raw), delay=False)

    def wait_stream(self, stream: Stream, other: Stream) -> None:
        self.wait_event(stream, self.record(other))

    def _host_wait(self, event: Event) -> None:
        if event.raw is not None:
            self._wait(event.raw)
        self._raise_errors()

    def query(self, event: Event) -> bool:
        return event.raw is None or event.raw[1].done.is_set()

    def synchronize(self) -> None:
        for raw in list(self._last.values()):
            self._wait(raw)
        self._raise_errors()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        if stream is self.compute:
            dst.copy_(src)
            return self.record(stream)

        # the job holds one tensor per storage (no chain of view bases), so `discard` knows
        # how many of a storage's holders are queued copies
        dst, src = _bare(dst), _bare(src)
        ptrs = [t.untyped_storage().data_ptr() for t in (dst, src)]

        def run():  # on the stream's thread: its busy time goes to the observer
            t0 = time.perf_counter()
            try:
                dst.copy_(src)
            finally:
                self._count_copy_refs(ptrs, -1)
            if self.observer is not None:
                self.observer.on_busy(channel_of(stream), time.perf_counter() - t0)
        self._count_copy_refs(ptrs, 1)
        job = self._enqueue(stream, run, delay=True)
        return Event(self, stream, (self._workers[stream.name], job))

    def recycle(self, tensor: torch.Tensor) -> None:
        poison(tensor)

    def _count_copy_refs(self, ptrs: list[int], delta: int) -> None:
        with self._job_lock:
            for ptr in ptrs:
                count = self._copy_refs.get(ptr, 0) + delta
                if count:
                    self._copy_refs[ptr] = count
                else:
                    del self._copy_refs[ptr]

    def discard(self, tensor: torch.Tensor) -> None:
        """Poison `tensor` when only the caller and queued copies hold its storage (a kept graph
        or a view the engine still uses keeps it intact)."""
        storage = tensor.untyped_storage()
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if use_count is None or storage.data_ptr() == 0:
            return
        with self._job_lock:
            queued = self._copy_refs.get(storage.data_ptr(), 0)
        # holders: the tensor, this function's storage object and one per queued copy
        if use_count(storage._cdata) - queued <= 2:
            poison(tensor)

    def _submit(self, executor: Executor, fn: Callable, *args, **kwargs) -> Future:
        hurry, holder = threading.Event(), []
        with self._job_lock:
            pause = self._job_rng.uniform(*JOB_DELAY_S)

        def job():
            deadline = time.monotonic() + pause
            while not hurry.is_set() and time.monotonic() < deadline:
                if holder and holder[0]._waiters:  # a concurrent.futures.wait on it
                    break
                hurry.wait(min(POLL_S, max(0.0, deadline - time.monotonic())))
            return fn(*args, **kwargs)
        future = executor.submit(job)
        holder.append(future)
        with self._job_lock:
            queued = self._queued.setdefault(id(executor), [])
            queued[:] = [q for q in queued if not q[0].done()] + [(future, hurry)]
        future.lazytrain_pool = id(executor)  # type: ignore[attr-defined]
        return future

    def wait_futures(self, futures: Sequence[Future]) -> list[BaseException | None]:
        """As `Device.wait_futures`, after cutting the delay of each future's job and of the jobs
        queued before it on its pool (they run first)."""
        with self._job_lock:
            for f in futures:
                queued = self._queued.get(getattr(f, "lazytrain_pool", None), [])
                for k, (queued_future, hurry) in enumerate(queued):
                    hurry.set()
                    if queued_future is f:
                        del queued[:k + 1]
                        break
        return super().wait_futures(futures)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers.values():
            w.put(None)
        for w in self._workers.values():
            w.thread.join(timeout=5)

    def _raise_errors(self) -> None:
        if self.errors:
            raise self.errors.pop(0)


def _bare(t: torch.Tensor) -> torch.Tensor:
    """A tensor on `t`'s bytes that holds only their storage (not `t` or its view bases)."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                              t.stride())


def poison(tensor: torch.Tensor) -> None:
    """Fill `tensor` with NaN (floating dtypes) or 0xFF bytes (others), in place."""
    if tensor.is_floating_point():
        tensor.fill_(float("nan"))
    else:
        tensor.view(torch.uint8).fill_(0xFF) if tensor.dtype != torch.uint8 else tensor.fill_(0xFF)
