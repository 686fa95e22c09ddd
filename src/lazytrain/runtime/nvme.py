"""Asynchronous file I/O for the NVMe tier of the activation store.

Owns: one file per (boundary, micro-batch) under a directory, written and read in aligned chunks
by a small thread pool, with ``O_DIRECT`` where the filesystem allows it (probed once per
directory) and buffered ``os.pwrite``/``os.preadv`` otherwise; 4 KiB-aligned host buffers; the
mapping of every failure (ENOSPC, short read/write, missing file) to ``NvmeIOError`` naming
the boundary and the path; a fault-injection hook for tests (the tmpfs warning comes
from ``runtime/filesystem.py``).

Knows nothing about tiers, plans, windows or devices: it moves bytes between 4 KiB-aligned CPU
``uint8`` tensors and files. ``runtime/activations.py`` decides what moves when.

Why O_DIRECT: checkpoint files are written once and read once; going through the page cache
would double the DRAM they use (the very resource the NVMe tier relieves) and make throughput
measure memory bandwidth instead of the drive. O_DIRECT requires the buffer address, the file
offset and the length to be multiples of the logical block size; 4 KiB covers every current NVMe
drive. The torch CPU allocator aligns to 64 B only, hence ``aligned_empty``.

Durability: the files are scratch that lives for one training step and is read back by the same
process, so nothing is fsync'ed (a crash loses the step anyway; see ``ActivationStore`` for the
cleanup of files on exit).

Integrity: every write request (an extent of at most ``chunk_bytes``) gets one xxh3-64 digest
(kept in memory: about 100 B of Python objects per extent), and every read is checked against
the digests of the extents it covers, so a flipped bit or a file changed by someone else is a
``NvmeIOError`` naming the damaged extent's byte range, not silently wrong gradients. Reads
are cut at the written extents' boundaries, so an extent a read covers whole is checked from
the bytes just read in one call; one a read covers in part (a fractional read ending inside
it) is read again whole into scratch memory and checked (at most two per read call; those
extra bytes are not booked as moved). Cost: ``benchmarks/nvme_digest.py`` (per 4 MiB) and
``benchmarks/nvme_io.py`` (the round trip).

Stuck drives: ``wait`` gives up after ``timeout_s`` (``runtime.nvme_timeout_s``) with
``NvmeTimeoutError`` naming the boundary and the file, instead of hanging the step forever.
"""

from __future__ import annotations

import concurrent.futures
import errno as errno_mod
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from lazytrain.atomic import open_nofollow
from lazytrain.contract import ALIGN_BYTES
from lazytrain.runtime.device import Device
from lazytrain.runtime.errors import NvmeIOError, boundary_label
from lazytrain.runtime.nvme_digest import ExtentSums, damaged_extent
from lazytrain.runtime.filesystem import warn_if_ram_filesystem

# ALIGN_BYTES (`lazytrain.contract`): the alignment of O_DIRECT buffers, offsets and lengths,
# 4 KiB; lengths are padded with the contract's `align_up`, as the planner pads the NVMe tier's
# staging bytes.

CHUNK_BYTES = 4 * 1024 * 1024
"""Size of one I/O request (bytes). 4 MiB is large enough to reach sequential NVMe throughput
and small enough that a few threads keep several requests in flight."""

Key = tuple[int, int]
"""(boundary, micro_batch) identifying one checkpoint file."""

DEFAULT_TIMEOUT_S = 300.0
"""Default limit of one wait for NVMe requests (s): far above any window's transfers (GBs at
GB/s), far below "forever"; `runtime.nvme_timeout_s` sets it."""


class NvmeTimeoutError(NvmeIOError):
    """NVMe requests did not finish within `timeout_s` (a stuck or failing drive)."""


def align_down(nbytes: int) -> int:
    """Largest multiple of ALIGN_BYTES <= nbytes."""
    return nbytes // ALIGN_BYTES * ALIGN_BYTES


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A pageable CPU ``uint8`` tensor of ``nbytes`` whose first byte is ALIGN_BYTES-aligned.

    torch's CPU allocator aligns to 64 B only, so this allocates ALIGN_BYTES extra bytes and
    slices from the first aligned address (the slice keeps the whole allocation alive). The
    runtime's pinned buffers come from the device API (`Device.pinned_empty`) instead.

    Args:
        nbytes: length of the returned tensor (bytes).

    Returns:
        ``uint8`` tensor [nbytes], contiguous, ``data_ptr() % ALIGN_BYTES == 0``.
    """
    raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % ALIGN_BYTES
    return raw[shift : shift + nbytes]


@functools.lru_cache(maxsize=None)
def _probe_o_direct(real_dir: str) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(real_dir, f".lazytrain-odirect-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        return os.pwrite(fd, aligned_empty(ALIGN_BYTES).numpy(), 0) == ALIGN_BYTES
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


def supports_o_direct(directory: Path | str) -> bool:
    """Whether files in ``directory`` accept aligned O_DIRECT writes (probed once per directory).

    The probe creates, writes 4 KiB to and removes one hidden file.
    """
    return _probe_o_direct(os.path.realpath(directory))


@dataclass(frozen=True, kw_only=True, slots=True)
class IoEvent:
    """What NvmeIO is about to do; passed to the fault hook before every open and chunk.

    Attributes:
        op: "open_write", "open_read", "write" or "read".
        boundary: boundary index.
        micro_batch: micro-batch index.
        path: the checkpoint file.
        offset: file offset of the chunk (bytes; 0 for opens).
        nbytes: chunk length (bytes; 0 for opens).
    """

    op: str
    boundary: int
    micro_batch: int
    path: Path
    offset: int = 0
    nbytes: int = 0


class FaultInjector:
    """Scripted NVMe faults for tests: pass one as ``fault_hook`` to NvmeIO / ActivationStore.

    Each ``*_next_*`` fault fires once, on the first matching event (optionally only for one
    boundary); the faults are real where possible (the file is really truncated or deleted, so
    the store's own detection is what raises), and simulated where not (ENOSPC is raised as the
    OSError ``os.pwrite`` would raise).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._once: list[tuple[str, int | None, Callable[[IoEvent], None]]] = []
        self._read_delay_ms: dict[int | None, float] = {}

    def fail_next_write(self, *, boundary: int | None = None, errno_code: int = errno_mod.ENOSPC) -> None:
        """The next chunk write fails with ``OSError(errno_code)`` (default ENOSPC)."""

        def fail(event: IoEvent) -> None:
            raise OSError(errno_code, os.strerror(errno_code), str(event.path))

        self._add("write", boundary, fail)

    def truncate_next_read(self, *, boundary: int | None = None) -> None:
        """Before the next chunk read, truncate the file to the middle of that chunk."""

        def truncate(event: IoEvent) -> None:
            os.truncate(event.path, event.offset + event.nbytes // 2)

        self._add("read", boundary, truncate)

    def delete_before_next_read(self, *, boundary: int | None = None) -> None:
        """Delete the file just before it is next opened for reading."""
        self._add("open_read", boundary, lambda event: os.unlink(event.path))

    def delay_reads(self, ms: float, *, boundary: int | None = None) -> None:
        """Sleep ``ms`` milliseconds before every chunk read (of ``boundary``, or of all)."""
        with self._lock:
            self._read_delay_ms[boundary] = ms

    def _add(self, op: str, boundary: int | None, action: Callable[[IoEvent], None]) -> None:
        with self._lock:
            self._once.append((op, boundary, action))

    def __call__(self, event: IoEvent) -> None:
        with self._lock:
            delay_ms = self._read_delay_ms.get(event.boundary, self._read_delay_ms.get(None, 0.0))
            action = None
            for n, (op, boundary, act) in enumerate(self._once):
                if op == event.op and boundary in (None, event.boundary):
                    action = act
                    del self._once[n]
                    break
        if event.op == "read" and delay_ms > 0:
            threading.Event().wait(delay_ms / 1000.0)
        if action is not None:
            action(event)


class NvmeIO:
    """Chunked asynchronous reads and writes of checkpoint files, one per (boundary, micro-batch).

    Buffers are CPU ``uint8`` tensors; with O_DIRECT, their address, length and file offset must be
    multiples of ALIGN_BYTES (use ``aligned_empty`` and pad lengths with ``align_up``). Every
    failure surfaces as ``NvmeIOError`` from the returned futures (or from the call itself
    when opening the file fails).

    Args:
        directory: where the files go; created if missing. Warns when it is on tmpfs/ramfs.
        io_threads: worker threads (requests in flight).
        chunk_bytes: size of one request (bytes, multiple of ALIGN_BYTES).
        direct: True forces O_DIRECT (ValueError if the filesystem refuses it), False forces
            buffered I/O, None (default) probes the directory once.
        fault_hook: called with an ``IoEvent`` before every open and chunk (tests); may raise
            OSError or act on the file.
        device: the device API: worker jobs are submitted and waited for through it, and each
            chunk declares its host read (write) or write (read) of the buffer, so
            ``cpu-checked`` sees the NVMe threads (default: the synchronous CPU backend).
    """

    def __init__(
        self,
        directory: Path | str,
        *,
        io_threads: int = 2,
        chunk_bytes: int = CHUNK_BYTES,
        direct: bool | None = None,
        fault_hook: Callable[[IoEvent], None] | None = None,
        device: Device | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.device = device or Device()
        self.timeout_s = timeout_s or None  # 0 / None: wait forever
        if io_threads < 1:
            raise ValueError(f"runtime.io_threads must be >= 1; got {io_threads}")
        if chunk_bytes <= 0 or chunk_bytes % ALIGN_BYTES:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN_BYTES}; got {chunk_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        warn_if_ram_filesystem(self.directory)
        probed = supports_o_direct(self.directory)
        if direct and not probed:
            raise ValueError(
                f"O_DIRECT was requested but {self.directory} does not support it; "
                "pass direct=None to fall back to buffered I/O"
            )
        self.direct = probed if direct is None else direct
        self.chunk_bytes = chunk_bytes
        self._hook = fault_hook
        self._pool = self.device.host_workers("nvme", max_workers=io_threads)
        self._write_fds: dict[Key, int] = {}
        self._read_fds: dict[Key, int] = {}
        self._files: dict[Key, Path] = {}
        self._pending: dict[Key, list[Future]] = {}
        self._sums: dict[Key, ExtentSums] = {}  # integrity digests of each file's extents
        self._stuck = False  # a wait timed out: cleanup no longer waits for the drive
        self._closed = False

    def path_for(self, key: Key) -> Path:
        """The file of (boundary, micro_batch): ``directory/ckpt_b{boundary}_m{micro_batch}.bin``."""
        boundary, micro_batch = key
        return self.directory / f"ckpt_b{boundary}_m{micro_batch}.bin"

    def write(
        self,
        key: Key,
        buffer: torch.Tensor,
        offset: int,
        *,
        wait_for: Callable[[], None] | None = None,
    ) -> list[Future]:
        """Write ``buffer`` to the key's file at ``offset``, asynchronously, in chunks.

        The first write of a key creates (truncates) its file. ``wait_for`` runs in the worker
        before each chunk (e.g. a CUDA event's ``synchronize``): the source bytes must be final
        before they are read from the buffer. The caller keeps ``buffer`` alive and unmodified
        until every returned future is done.

        Args:
            key: (boundary, micro_batch).
            buffer: CPU ``uint8`` tensor [n]; n and offset multiples of ALIGN_BYTES under O_DIRECT.
            offset: file offset (bytes).
            wait_for: optional callable run before each chunk.

        Returns:
            One future per chunk; each raises NvmeIOError on failure.

        Raises:
            NvmeIOError: the file cannot be created.
        """
        fd = self._write_fds.get(key)
        if fd is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.direct else 0)
            fd = self._open(key, "open_write", flags)
            self._write_fds[key] = fd
            self._sums[key] = ExtentSums()  # a new file: forget the old one's digests
        return self._submit(key, "write", fd, buffer, offset, wait_for)

    def read(self, key: Key, buffer: torch.Tensor, offset: int) -> list[Future]:
        """Read ``buffer.numel()`` bytes of the key's file at ``offset`` into ``buffer``.

        Same alignment rules and future semantics as ``write``. A file shorter than the request
        gives a NvmeIOError ("short read") from the chunk's future.

        Raises:
            NvmeIOError: the file is missing or cannot be opened.
        """
        fd = self._read_fds.get(key)
        if fd is None:
            fd = self._open(key, "open_read", os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
            self._read_fds[key] = fd
        return self._submit(key, "read", fd, buffer, offset, None)

    def finish_write(self, key: Key) -> None:
        """Close the key's write descriptor after its writes completed (the file stays)."""
        self.wait(self._pending.pop(key, []))
        fd = self._write_fds.pop(key, None)
        if fd is not None:
            os.close(fd)

    def finish_read(self, key: Key) -> None:
        """Close the key's read descriptor after its reads completed (the file stays)."""
        self.wait(self._pending.pop(key, []))
        fd = self._read_fds.pop(key, None)
        if fd is not None:
            os.close(fd)

    def remove(self, key: Key) -> None:
        """Wait for the key's pending requests (errors ignored), close its fds, delete its file.

        Waits at most `timeout_s` (none once a wait timed out): a request still running then
        marks the drive stuck, and the key's descriptors stay open (a stuck request may still
        use its descriptor; closing it would let a later `open` reuse the number) while the
        file is unlinked.
        """
        pending = self._pending.pop(key, [])
        if not self._stuck and pending:  # timeout_s None: wait as long as it takes
            if concurrent.futures.wait(pending, timeout=self.timeout_s)[1]:
                self._stuck = True  # do not hang on a drive that stopped answering
        running = [f for f in pending if not f.done()]
        self.device.wait_futures([f for f in pending if f.done()])
        self._sums.pop(key, None)
        for fds in (self._write_fds, self._read_fds):
            fd = fds.pop(key, None)
            if fd is not None and not running:
                os.close(fd)
        path = self._files.pop(key, None)
        if path is not None:
            path.unlink(missing_ok=True)

    @property
    def stuck(self) -> bool:
        """Whether a wait for this instance's requests timed out (the drive stopped answering)."""
        return self._stuck

    def files(self) -> list[Path]:
        """Files this instance created and has not removed yet."""
        return list(self._files.values())

    def wait(self, futures: Sequence[Future]) -> None:
        """Wait for every future, then raise the first failure (so no request still runs).

        Raises:
            NvmeTimeoutError: some request was still running after `timeout_s` (names the
                boundary and the file of one of them).
            NvmeIOError: a request failed.
        """
        if self.timeout_s is not None and futures:
            late = set()
            for kind in ("nvme_write", "nvme_read"):  # writes first: a barrier waits for both
                group = [f for f in futures if getattr(f, "lazytrain_channel", None) == kind]
                if group:
                    with self.device.waiting(kind):  # the observer's wait on this channel
                        late |= concurrent.futures.wait(group, timeout=self.timeout_s)[1]
            if late:
                self._stuck = True
                key = min(f.lazytrain_key for f in late)  # also for a removed key's requests
                raise NvmeTimeoutError(
                    f"{boundary_label(*key)}: NVMe requests on {self.path_for(key)} did not "
                    f"finish within runtime.nvme_timeout_s={self.timeout_s:g} s ({len(late)} "
                    f"still running): the drive is stuck or failing; check it (dmesg, "
                    f"nvme smart-log) or raise runtime.nvme_timeout_s",
                    boundary=key[0], micro_batch=key[1], path=self.path_for(key))
        errors = self.device.wait_futures(futures)
        for err in errors:
            if err is not None:
                raise err

    def close(self) -> None:
        """Wait for pending requests, delete every file, stop the workers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for key in list(self._files) + list(self._pending):
            self.remove(key)
        self._pool.shutdown(wait=not self._stuck, cancel_futures=self._stuck)

    def _open(self, key: Key, op: str, flags: int) -> int:
        path = self.path_for(key)
        try:
            self._call_hook(IoEvent(op=op, boundary=key[0], micro_batch=key[1], path=path))
            fd = open_nofollow(path, flags, 0o600)  # a planted symlink: refused, not followed
        except OSError as exc:
            verb = "create" if op == "open_write" else "open"
            raise self._error(key, f"{verb} {path}", exc.strerror or str(exc), exc.errno) from exc
        self._files[key] = path
        return fd

    def _submit(
        self,
        key: Key,
        op: str,
        fd: int,
        buffer: torch.Tensor,
        offset: int,
        wait_for: Callable[[], None] | None,
    ) -> list[Future]:
        if self._closed:
            raise RuntimeError("NvmeIO is closed")
        if buffer.dtype != torch.uint8 or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise TypeError("NVMe buffers must be contiguous CPU uint8 tensors")
        nbytes = buffer.numel()
        if self.direct and (offset % ALIGN_BYTES or nbytes % ALIGN_BYTES or buffer.data_ptr() % ALIGN_BYTES):
            raise ValueError(
                f"O_DIRECT needs {ALIGN_BYTES}-aligned offset, length and address; got offset "
                f"{offset}, length {nbytes}, address {buffer.data_ptr():#x}"
            )
        self.device.ledger.moved(f"nvme_{op}", nbytes)  # booked to the issuing window
        view = buffer.numpy()  # shares memory; os.pwrite/preadv use the buffer without a copy
        job = self._write_chunk if op == "write" else self._read_chunk
        sums = self._sums.get(key) if op == "read" else None
        pieces = (sums.split(offset, offset + nbytes, self.chunk_bytes) if sums is not None
                  else [(offset + a, offset + min(a + self.chunk_bytes, nbytes))
                        for a in range(0, nbytes, self.chunk_bytes)])
        futures = []
        for a, b in pieces:  # file offsets; reads cut at the written extents' boundaries
            chunk = memoryview(view[a - offset : b - offset])
            part = buffer[a - offset : b - offset]
            future = self.device.submit(self._pool, job, key, fd, chunk, part, a,
                                        wait_for, channel=f"nvme_{op}")
            future.lazytrain_key = key  # type: ignore[attr-defined]  # named by a timeout
            futures.append(future)
        self._pending.setdefault(key, []).extend(futures)
        return futures

    def _write_chunk(self, key: Key, fd: int, chunk: memoryview, part: torch.Tensor, offset: int,
                     wait_for) -> None:
        path = self.path_for(key)
        try:
            if wait_for is not None:
                wait_for()
            self.device.host_access(part, write=False, what=f"NVMe write of {path.name}")
            t0 = time.perf_counter()
            self._call_hook(IoEvent(op="write", boundary=key[0], micro_batch=key[1], path=path,
                                    offset=offset, nbytes=len(chunk)))
            done = os.pwrite(fd, chunk, offset)
            self._busy("nvme_write", t0)
        except OSError as exc:
            raise self._error(key, f"write to {path}", exc.strerror or str(exc), exc.errno) from exc
        if done != len(chunk):
            raise self._error(key, f"write to {path}", f"short write: {done} of {len(chunk)} bytes at offset {offset}")
        sums = self._sums.get(key)
        if sums is not None:  # None: the file was removed while this request was stuck
            sums.record(chunk, offset)

    def _read_chunk(self, key: Key, fd: int, chunk: memoryview, part: torch.Tensor, offset: int,
                    wait_for) -> None:
        path = self.path_for(key)
        self.device.host_access(part, write=True, what=f"NVMe read of {path.name}")
        try:
            self._call_hook(IoEvent(op="read", boundary=key[0], micro_batch=key[1], path=path,
                                    offset=offset, nbytes=len(chunk)))
            t0 = time.perf_counter()
            done = os.preadv(fd, [chunk], offset)
            self._busy("nvme_read", t0)
        except OSError as exc:
            raise self._error(key, f"read from {path}", exc.strerror or str(exc), exc.errno) from exc
        if done != len(chunk):
            # A regular file returns fewer bytes than asked only at end of file: it was truncated.
            raise self._error(key, f"read from {path}", f"short read: {done} of {len(chunk)} bytes at offset {offset}")
        sums = self._sums.get(key)
        if sums is not None:
            self._check(key, fd, chunk, offset, sums)

    def _check(self, key: Key, fd: int, chunk: memoryview, offset: int,
               sums: ExtentSums) -> None:
        """Check `chunk`, just read at file `offset`, against the file's extent digests
        (`runtime.nvme_digest.damaged_extent`).

        Raises:
            NvmeIOError: an extent's bytes differ from the ones written, naming the extent's
                byte range [start, end) and the file.
        """
        bad = damaged_extent(sums, chunk, offset, lambda a, b: self._read_extent(fd, a, b))
        if bad is not None:
            a, b = bad
            raise self._error(key, f"read from {self.path_for(key)}",
                              f"checksum mismatch (xxh3-64) of bytes [{a}, {b}) (the "
                              f"{b - a}-byte extent written at offset {a}): the bytes read "
                              f"are not the bytes written (a flipped bit on the drive, or "
                              f"another process wrote the file)")

    def _read_extent(self, fd: int, start: int, end: int) -> memoryview | None:
        """Bytes [start, end) of the file into a fresh aligned buffer (O_DIRECT-safe: extents
        of an O_DIRECT file are aligned); None when the file ends before `end`."""
        view = memoryview(aligned_empty(end - start).numpy())
        try:
            return view if os.preadv(fd, [view], start) == end - start else None
        except OSError:
            return None

    def _busy(self, channel: str, t0: float) -> None:
        """The drive's busy time of one chunk, for the device's observer (runtime/instrument)."""
        if self.device.observer is not None:
            self.device.observer.on_busy(channel, time.perf_counter() - t0)

    def _call_hook(self, event: IoEvent) -> None:
        if self._hook is not None:
            self._hook(event)

    def _error(self, key: Key, what: str, reason: str, errno_code: int | None = None) -> NvmeIOError:
        boundary, micro_batch = key
        return NvmeIOError(
            f"{boundary_label(boundary, micro_batch)}: NVMe {what} failed: {reason}",
            boundary=boundary,
            micro_batch=micro_batch,
            path=self.path_for(key),
            errno_code=errno_code,
        )
