"""`runtime.device: cpu-threaded`: copy streams as delayed worker threads, real events, poison.

The compute stream is the calling thread (kernels run at once, as on the `cpu` backend). Every
other stream is one worker thread that runs its queued copies in order, each after a random
delay drawn from a seeded generator (0 to `MAX_DELAY_S`), so copies really overlap compute and
finish late. Events are real: `host_wait` blocks until the worker has run the copy, and a
stream's `wait_event` makes its worker block before the next queued copy. When the compute
stream waits for an event (`wait_event(compute, ...)`), the calling thread blocks, since its
kernels run as soon as they are issued.

Buffers handed back to a pool (`recycle`) are poisoned: NaN for floating dtypes, 0xFF bytes
otherwise. A missing wait then shows up as corrupted gradients, not as a lucky pass: a copy
that reads a buffer after its pool took it back reads poison, and a consumer that reads a
prefetched buffer before its copy ran reads the previous contents.

Numerics are those of `cpu` when the ordering is right (every copy is the same `copy_`).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from typing import Callable

import torch

from lazytrain.runtime.device import Device, Event, Stream

MAX_DELAY_S = 0.002
"""Largest random delay before each queued copy (s): long enough to reorder a copy behind the
compute the host issues next, short enough that the test matrix stays within its budget."""


class _Worker:
    """One stream's thread: runs queued jobs in order."""

    def __init__(self, name: str, rng: random.Random) -> None:
        self.rng = rng
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"stream-{name}", daemon=True)
        self.thread.start()

    def put(self, fn: Callable[[], None] | None) -> None:
        self.jobs.put(fn)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()


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

    def _worker(self, stream: Stream) -> _Worker:
        w = self._workers.get(stream.name)
        if w is None:
            rng = random.Random(f"{self._seed}:{stream.name}")
            w = self._workers[stream.name] = _Worker(stream.name, rng)
        return w

    def _enqueue(self, stream: Stream, fn: Callable[[], None], *, delay: bool) -> threading.Event:
        done = threading.Event()
        worker = self._worker(stream)
        pause = worker.rng.uniform(0.0, MAX_DELAY_S) if delay else 0.0

        def job():
            try:
                if pause:
                    time.sleep(pause)
                fn()
            except BaseException as exc:  # surfaced at the next host_wait / synchronize
                self.errors.append(exc)
            finally:
                done.set()
        worker.put(job)
        self._last[stream.name] = done
        return done

    def record(self, stream: Stream) -> Event:
        if stream is self.compute:
            return Event(self, stream, None)  # compute ran already
        done = self._last.get(stream.name)
        return Event(self, stream, done)

    def wait_event(self, stream: Stream, event: Event | None) -> None:
        if event is None or event.raw is None:
            return
        if stream is self.compute:
            event.raw.wait()  # kernels run when issued: the host must wait here
            self._raise_errors()
            return
        flag = event.raw
        self._enqueue(stream, flag.wait, delay=False)

    def wait_stream(self, stream: Stream, other: Stream) -> None:
        self.wait_event(stream, self.record(other))

    def host_wait(self, event: Event | None) -> None:
        if event is not None and event.raw is not None:
            event.raw.wait()
        self._raise_errors()

    def query(self, event: Event) -> bool:
        return event.raw is None or event.raw.is_set()

    def synchronize(self) -> None:
        for name in list(self._last):
            self._last[name].wait()
        self._raise_errors()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, stream: Stream) -> Event:
        if stream is self.compute:
            dst.copy_(src)
            return self.record(stream)
        done = self._enqueue(stream, lambda: dst.copy_(src), delay=True)
        return Event(self, stream, done)

    def recycle(self, tensor: torch.Tensor) -> None:
        poison(tensor)

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


def poison(tensor: torch.Tensor) -> None:
    """Fill `tensor` with NaN (floating dtypes) or 0xFF bytes (others), in place."""
    if tensor.is_floating_point():
        tensor.fill_(float("nan"))
    else:
        tensor.view(torch.uint8).fill_(0xFF) if tensor.dtype != torch.uint8 else tensor.fill_(0xFF)
