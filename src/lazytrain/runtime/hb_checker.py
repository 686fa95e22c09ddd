"""`runtime.device: cpu-checked`: a happens-before checker for the runtime's stream ordering.

The numerics are the synchronous CPU backend's, bit for bit: every copy still runs at once.
What changes is bookkeeping. Each logical actor (the streams "compute", "h2d", "d2h", ... and
every host thread, "host:<thread name>") carries a vector clock. Every operation is logged with
its actor, its clock and the storage byte ranges it reads and writes:
- copies and allocations through the device API;
- compute ops, through a `TorchDispatchMode` (`compute_scope`): an op touching a host buffer
  (declared with `host_tensor` / `pinned_empty`) is host work of the calling thread (the fp32
  to compute-dtype conversion into staging, gradient accumulation, the optimizer on its worker);
  any other op is compute-stream work;
- host accesses that are not torch ops (`host_access`: the NVMe threads' pwrite/preadv).

Clocks join only where CUDA orders work: `wait_event` / `wait_stream` (a stream joins the
event's / other stream's clock), `host_wait` / `synchronize` (the host thread joins), work
queued on a stream (the stream joins the queueing thread's clock: the GPU cannot run work before
it is queued), and `submit` / `wait_futures` (a worker joins its submitter, a waiter its job).

Rules (a violation raises `OrderingViolation` at once, naming both operations, their streams
and the buffer):
1. conflicting accesses (one a write) to overlapping bytes from two actors must be ordered: the
   later actor's clock covers the earlier access. This covers "a host write to a pinned buffer
   happens after every device read of it" and "a host read of a D2H destination happens after
   that copy", and a device buffer overwritten while another stream still reads it;
2. the caching allocator, modelled conservatively: a block allocated on stream S may be memory
   that S's queued work still uses, so its first use on another actor X must be ordered after
   S's clock at the allocation (nothing relies on the CPU allocator reusing an address);
3. a device buffer is freed (its last reference dropped, seen through a storage finalizer) only
   when every access from another stream is ordered before its allocating stream's next work,
   unless `record_stream` named that stream; a pool buffer is `recycle`d only when every access
   of other actors is ordered before the recycling thread.
   A pinned buffer (its pages unregistered and freed on CUDA, under any copy still running)
   is freed only when every copy of a stream is ordered before the freeing thread (a host
   wait or synchronize); host threads' accesses are not checked at free (a job that reads or
   writes a buffer holds a reference to it, so it is not freed under them), nor are other
   host buffers.

Out of scope (documented limits): cross-process ordering of node-shared master weights (the
owner updates in place while peers copy; the data-parallel protocol orders it with collectives)
and ordering inside torch ops (one op is one access).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lazytrain.errors import JobFailure
from lazytrain.runtime.device import Device, Event, Stream
from lazytrain.runtime.queue_audit import QueueFirstAudit
from lazytrain.runtime.sync_audit import SyncAudit

PRUNE_AT = 48
"""Accesses kept per buffer before ordered-for-everyone ones are dropped (bookkeeping only)."""


class OrderingViolation(JobFailure, RuntimeError):
    """Two operations on one buffer are not ordered by any event, wait or synchronize.

    Attributes:
        buffer: the buffer's label.
        first, second: "op on stream" of the earlier and the later access.
        rule: which rule of the checker they break.
    """

    def __init__(self, message: str, *, buffer: str, first: str, second: str, rule: str) -> None:
        super().__init__(message)
        self.buffer, self.first, self.second, self.rule = buffer, first, second, rule


VectorClock = dict[str, int]


def _joined(a: VectorClock, b: VectorClock) -> VectorClock:
    out = dict(a)
    for k, v in b.items():
        if out.get(k, 0) < v:
            out[k] = v
    return out


@dataclass(slots=True)
class _Access:
    actor: str
    epoch: int
    start: int
    end: int
    write: bool
    op: str


@dataclass(slots=True)
class _Buffer:
    label: str
    host: bool
    pinned: bool
    alloc_actor: str
    alloc_epoch: int
    alloc_clock: dict = field(default_factory=dict)
    """The allocating actor's whole vector clock at the allocation: what the freed memory's
    earlier users may still be doing (a first user on another stream must dominate it)."""
    accesses: list = field(default_factory=list)
    first_used_by: set = field(default_factory=set)
    recorded_streams: set = field(default_factory=set)


class CheckedDevice(Device):
    """The CPU backend with a happens-before checker; see the module docstring."""

    kind = "cpu-checked"

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self._lock = threading.RLock()
        self._clocks: dict[str, VectorClock] = {}
        self._buffers: dict[int, _Buffer] = {}  # storage data_ptr -> live buffer
        self._local = threading.local()
        self._pending: OrderingViolation | None = None
        self.violations: list[OrderingViolation] = []
        self.ops_logged = 0
        self.implicit_syncs: dict[str, list[str]] = {}
        """Phase -> implicit syncs on device tensors seen there (`sync_audit`)."""
        self.queue_audit = QueueFirstAudit(lambda: self.ledger.window)
        """Host waits of the engine's thread before a window's first compute op
        (`runtime/queue_audit.py`; `queue_audit.early_waits`)."""

    # --- clocks ------------------------------------------------------------------------------

    @staticmethod
    def _thread_actor() -> str:
        """A host thread's actor: its name (for messages) and its identity (two pools' workers
        with one name prefix are two actors)."""
        t = threading.current_thread()
        return f"host:{t.name}#{t.ident}"

    def _clock(self, actor: str) -> VectorClock:
        return self._clocks.setdefault(actor, {actor: 0})

    def _tick(self, actor: str) -> int:
        clock = self._clock(actor)
        clock[actor] = clock.get(actor, 0) + 1
        return clock[actor]

    def _join(self, actor: str, other: VectorClock) -> None:
        self._clocks[actor] = _joined(self._clock(actor), other)

    def _queue_on(self, stream: Stream) -> int:
        """Work queued on `stream` by this thread: the stream joins the thread, then ticks."""
        self._join(stream.name, self._clock(self._thread_actor()))
        return self._tick(stream.name)

    def _ordered(self, actor: str, access: _Access) -> bool:
        return access.actor == actor or self._clock(actor).get(access.actor, 0) >= access.epoch

    # --- buffers -----------------------------------------------------------------------------

    def _buffer(self, t: torch.Tensor, *, actor: str, epoch: int, label: str | None = None,
                host: bool | None = None, pinned: bool = False) -> _Buffer | None:
        """The live buffer of `t`'s storage, registered on first sight."""
        if t.device.type != "cpu" or t.numel() == 0:
            return None
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0:
            return None
        buf = self._buffers.get(ptr)
        if buf is None or label is not None:
            # first seen by a host pass's op (`host_scope`: a module buffer such as the rotary
            # inverse frequencies): not declared host, the compute stream reads it later too
            is_host = (actor.startswith("host:") and not getattr(self._local, "host_pass", False)
                       ) if host is None else host
            clock = {**self._clock(actor), actor: epoch}
            buf = _Buffer(label=label or f"tensor {tuple(t.shape)} {t.dtype}", host=is_host,
                          pinned=pinned, alloc_actor=actor, alloc_epoch=epoch,
                          alloc_clock=clock)
            self._buffers[ptr] = buf
            weakref.finalize(storage, self._freed, ptr, buf)
        return buf

    @staticmethod
    def _span(t: torch.Tensor) -> tuple[int, int]:
        size = t.element_size()
        start = t.storage_offset() * size
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
        return start, start + extent * size

    def _access(self, t: torch.Tensor, *, actor: str, epoch: int, write: bool, op: str) -> None:
        buf = self._buffer(t, actor=actor, epoch=epoch - 1 if write else epoch)
        if buf is None:
            return
        start, end = self._span(t)
        if (not buf.host and buf.alloc_actor != actor and actor not in buf.first_used_by):
            buf.first_used_by.add(actor)
            mine = self._clock(actor)
            if any(mine.get(k, 0) < v for k, v in buf.alloc_clock.items() if k != actor):
                self._violate(
                    buf, f"allocation on stream {buf.alloc_actor}", f"{op} on {actor}",
                    "first use on another stream of a block allocated on stream "
                    f"{buf.alloc_actor} must wait for that stream's work queued before the "
                    "allocation (the caching allocator may hand out memory it still uses)")
        for prev in buf.accesses:
            if (prev.end > start and prev.start < end and (prev.write or write)
                    and not self._ordered(actor, prev)):
                kind = "write" if write else "read"
                self._violate(
                    buf, f"{prev.op} on {prev.actor} ({'write' if prev.write else 'read'} "
                    f"bytes {prev.start}-{prev.end})", f"{op} on {actor} ({kind} bytes "
                    f"{start}-{end})", "conflicting accesses from two streams are not ordered "
                    "by an event wait, a stream wait or a host synchronize")
        new = _Access(actor, epoch, start, end, write, op)
        buf.accesses = [a for a in buf.accesses if not self._subsumed(a, new)] + [new]
        if len(buf.accesses) > PRUNE_AT:
            buf.accesses = [a for a in buf.accesses if not self._ordered_for_all(a)]

    @staticmethod
    def _subsumed(old: _Access, new: _Access) -> bool:
        """`old` can never race where `new` does not: same actor, covered, and new writes or
        both read."""
        return (old.actor == new.actor and new.start <= old.start and old.end <= new.end
                and (new.write or not old.write))

    def _ordered_for_all(self, a: _Access) -> bool:
        return all(c.get(a.actor, 0) >= a.epoch for c in self._clocks.values())

    def _freed(self, ptr: int, buf: _Buffer) -> None:
        """Storage finalizer: the last reference is gone (any thread)."""
        with self._lock:
            if self._buffers.get(ptr) is buf:
                del self._buffers[ptr]
            if buf.pinned:
                self._check_unused(buf, 0, 1 << 62, "free of the last reference of a pinned "
                                   "buffer", "a pinned buffer is freed only after every copy "
                                   "of a stream completed (host wait or synchronize)",
                                   now=False, streams_only=True)
            if buf.host:
                return
            freer = _joined(self._clock(buf.alloc_actor), self._clock(self._thread_actor()))
            for a in buf.accesses:
                if (a.actor != buf.alloc_actor and a.actor not in buf.recorded_streams
                        and freer.get(a.actor, 0) < a.epoch):
                    self._violate(buf, f"{a.op} on {a.actor}", "free of the last reference "
                                  f"(memory returns to stream {buf.alloc_actor})",
                                  "a device buffer is freed only after every access from "
                                  "another stream is ordered before its allocating stream, or "
                                  "record_stream named that stream", now=False)
                    return

    def _violate(self, buf: _Buffer, first: str, second: str, rule: str, *,
                 now: bool = True) -> None:
        exc = OrderingViolation(f"ordering violation on {buf.label}: {second} is not ordered "
                                f"after {first}; rule: {rule}",
                                buffer=buf.label, first=first, second=second, rule=rule)
        self.violations.append(exc)
        if now:
            raise exc
        if self._pending is None:
            self._pending = exc

    def _raise_pending(self) -> None:
        if self._pending is not None and getattr(self._local, "compute", False):
            exc, self._pending = self._pending, None
            raise exc

    # --- the device API ----------------------------------------------------------------------

    def record(self, stream: Stream) -> Event:
        with self._lock:
            self._raise_pending()
            event = Event(self, stream)
            event.raw = dict(self._clock(stream.name))
            return event

    def _wait_event(self, stream: Stream, event: Event) -> None:
        with self._lock:
            self._join(stream.name, event.raw)

    def wait_stream(self, stream: Stream, other: Stream) -> None:
        with self._lock:
            self._join(stream.name, self._clock(other.name))

    def _host_wait(self, event: Event) -> None:
        with self._lock:
            self._audit_wait(f"host wait for an event of {event.stream.name}")
            self._join(self._thread_actor(), event.raw)

    def _audit_wait(self, what: str) -> None:
        """A host wait: the queue-first audit's when the engine's (compute) thread makes it."""
        if getattr(self._local, "compute", False):
            self.queue_audit.host_wait(what)

    def synchronize(self) -> None:
        with self._lock:
            self._audit_wait("synchronize")
            actor = self._thread_actor()
            for name in list(self._streams):
                self._join(actor, self._clock(name))

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        with self._lock:
            self._raise_pending()
            epoch = self._queue_on(stream)
            op = f"copy on {stream.name}"
            self._access(src, actor=stream.name, epoch=epoch, write=False, op=op)
            self._access(dst, actor=stream.name, epoch=epoch, write=True, op=op)
        with self._suspended():
            dst.copy_(src)
        return self.record(stream)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        with self._lock:
            buf = self._buffer(tensor, actor=self.compute.name, epoch=0)
            if buf is not None:
                buf.recorded_streams.add(stream.name)

    def empty(self, shape, dtype: torch.dtype, *, name: str | None = None) -> torch.Tensor:
        with self._suspended():
            t = super().empty(shape, dtype, name=name)
        with self._lock:
            epoch = self._clock(self.compute.name).get(self.compute.name, 0)
            self._buffer(t, actor=self.compute.name, epoch=epoch, host=False,
                         label=name or f"device buffer {tuple(t.shape)} {dtype}")
        return t

    def pinned_empty(self, nbytes: int, *, name: str | None = None) -> torch.Tensor:
        with self._suspended():
            t = super().pinned_empty(nbytes, name=name)
        with self._lock:
            self._buffer(t, actor=self._thread_actor(), epoch=0, host=True, pinned=True,
                         label=name or f"pinned host buffer of {nbytes} bytes")
        return t

    def host_tensor(self, tensor: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
        with self._lock:
            self._buffer(tensor, actor=self._thread_actor(), epoch=0, host=True,
                         label=name or f"host buffer {tuple(tensor.shape)} {tensor.dtype}")
        return tensor

    def recycle(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self._raise_pending()
            buf = self._buffer(tensor, actor=self._thread_actor(), epoch=0)
            if buf is None:
                return
            start, end = self._span(tensor)
            self._check_unused(buf, start, end, f"return to its pool on {self._thread_actor()}",
                               "a buffer goes back to a pool only after every access from "
                               "other streams completed (host synchronize)")

    def _check_unused(self, buf: _Buffer, start: int, end: int, what: str, rule: str, *,
                      now: bool = True, streams_only: bool = False) -> None:
        """Every access of bytes [start, end) of `buf` by another actor (`streams_only`: by a
        stream) is ordered before the calling thread, or a violation (`what` names the
        release)."""
        actor = self._thread_actor()
        for a in buf.accesses:
            if streams_only and a.actor.startswith(("host:", "async:")):
                continue
            if a.end > start and a.start < end and not self._ordered(actor, a):
                self._violate(buf, f"{a.op} on {a.actor}", what, rule, now=now)
                return

    def host_access(self, tensor: torch.Tensor, *, write: bool, what: str) -> None:
        with self._lock:
            actor = self._thread_actor()
            self._access(tensor, actor=actor, epoch=self._tick(actor), write=write, op=what)

    def begin_async(self, *, reads=(), writes=(), what: str):
        with self._lock:
            self._raise_pending()
            self._async_count = getattr(self, "_async_count", 0) + 1
            actor = f"async:{what}#{self._async_count}"
            self._join(actor, self._clock(self._thread_actor()))
            epoch = self._tick(actor)
            for t in reads:
                self._access(t, actor=actor, epoch=epoch, write=False, op=what)
            for t in writes:
                self._access(t, actor=actor, epoch=epoch, write=True, op=what)
            return actor

    def end_async(self, token) -> None:
        if token is not None:
            with self._lock:
                self._join(self._thread_actor(), self._clock(token))

    def _submit(self, executor: Executor, fn: Callable, *args, **kwargs) -> Future:
        with self._lock:
            parent = dict(self._clock(self._thread_actor()))

        def job():
            with self._lock:
                self._join(self._thread_actor(), parent)
            try:
                # the checker's logging only: a worker's allocations are host memory, not the
                # ledger's compute (HBM) allocations
                with _ScopeGuard(self) if getattr(self._local, "mode", None) is None \
                        else contextlib.nullcontext():
                    return fn(*args, **kwargs)
            finally:
                with self._lock:
                    future_clock[0] = dict(self._clock(self._thread_actor()))

        future_clock: list[VectorClock] = [{}]
        future = executor.submit(job)
        future.lazytrain_clock = future_clock  # type: ignore[attr-defined]
        return future

    def _joined(self, futures: Sequence[Future]) -> None:
        with self._lock:
            if futures:
                self._audit_wait("wait for jobs on " + ", ".join(sorted(
                    {getattr(f, "lazytrain_channel", "host") for f in futures})))
            actor = self._thread_actor()
            for f in futures:
                clock = getattr(f, "lazytrain_clock", None)
                if clock is not None:
                    self._join(actor, clock[0])

    # --- compute ops -------------------------------------------------------------------------

    def compute_scope(self, *, allocations: bool = True):
        if getattr(self._local, "mode", None) is not None:
            return contextlib.nullcontext()
        # the thread entering it runs the compute stream (the engine's thread)
        return _Nested(super().compute_scope(allocations=allocations),
                       _ScopeGuard(self, compute=True))

    def host_scope(self, *, allocations: bool = True):
        if getattr(self._local, "mode", None) is not None:
            return contextlib.nullcontext()
        # every op inside is host work of the entering thread, as a submitted job's
        return _Nested(super().compute_scope(allocations=allocations),
                       _ScopeGuard(self, host_pass=True))

    def sync_audit(self, phase: str):
        """Count the implicit syncs on device tensors (not declared host buffers) made inside
        into `implicit_syncs[phase]` (`runtime/sync_audit.py`)."""
        return SyncAudit(lambda t: not self._is_host(t), phase=phase, record=self.implicit_syncs)

    @contextlib.contextmanager
    def _suspended(self):
        prev = getattr(self._local, "suspended", False)
        self._local.suspended = True
        try:
            yield
        finally:
            self._local.suspended = prev

    def log_op(self, func, args, kwargs, out) -> None:
        """Log one torch op: reads of its inputs, writes of mutated inputs and fresh outputs."""
        if getattr(self._local, "suspended", False):
            return
        schema = func._schema
        written, read = [], []
        for arg, value in zip(schema.arguments, args):
            target = written if (arg.alias_info is not None and arg.alias_info.is_write) else read
            target.extend(x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor))
        for name, value in (kwargs or {}).items():
            arg = next((a for a in schema.arguments if a.name == name), None)
            is_write = arg is not None and arg.alias_info is not None and arg.alias_info.is_write
            (written if is_write else read).extend(
                x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor))
        views = any(r.alias_info is not None and not r.alias_info.is_write
                    for r in schema.returns)
        if views and not written:
            return  # a view: metadata only, no bytes touched
        fresh = [] if views else [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        with self._lock:
            self._raise_pending()
            on_host = not getattr(self._local, "compute", False) or any(
                self._is_host(t) for t in (*read, *written))
            actor = self._thread_actor() if on_host else self.compute.name
            if on_host:
                epoch = self._tick(actor)
            else:
                epoch = self._queue_on(self.compute)
                self.queue_audit.compute_queued()
            op = f"{func.__name__}"
            self.ops_logged += 1
            for t in read:
                self._access(t, actor=actor, epoch=epoch, write=False, op=op)
            for t in written:
                self._access(t, actor=actor, epoch=epoch, write=True, op=op)
            for t in fresh:
                if self._buffers.get(_ptr(t)) is None:
                    self._buffer(t, actor=actor, epoch=epoch - 1, host=on_host,
                                 label=f"output of {op} {tuple(t.shape)} {t.dtype} on {actor}")
                self._access(t, actor=actor, epoch=epoch, write=True, op=op)

    def _is_host(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu" or t.numel() == 0:
            return False
        buf = self._buffers.get(_ptr(t))
        return buf is not None and buf.host


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _LoggingMode(TorchDispatchMode):
    def __init__(self, device: CheckedDevice) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.device.log_op(func, args, kwargs, out)
        return out


class _ScopeGuard:
    """Enters the logging mode on this thread (re-entrant: nested scopes are no-ops)."""

    def __init__(self, device: CheckedDevice, *, compute: bool = False,
                 host_pass: bool = False) -> None:
        self.device = device
        self.mode = _LoggingMode(device)
        self.compute, self.host_pass = compute, host_pass

    def __enter__(self):
        local = self.device._local
        local.mode, local.compute, local.host_pass = self.mode, self.compute, self.host_pass
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        local = self.device._local
        local.mode, local.compute, local.host_pass = None, False, False
        return self.mode.__exit__(*exc)


class _Nested:
    """Two scopes entered in order and left in reverse (the ledger's, then the checker's)."""

    def __init__(self, outer, inner) -> None:
        self.outer, self.inner = outer, inner

    def __enter__(self):
        self.outer.__enter__()
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self.inner.__exit__(*exc)
        finally:
            self.outer.__exit__(*exc)
        return False
