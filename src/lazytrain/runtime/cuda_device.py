"""The CUDA backend of the device API (`runtime.device: cuda`): real CUDA streams and events,
pinned host memory, the caching allocator.

Implements `runtime.device.Device`'s vocabulary with CUDA semantics (torch 2.11+); the backend
registry (`runtime.backends`) builds it. Knows nothing about plans, tiers, blocks or files.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Executor, Future
from typing import Callable

import torch

from lazytrain.runtime.device import PAGE_BYTES, Device, Event, Stream, channel_of
from lazytrain.runtime.ledger import Ledger


class CudaDevice(Device):
    """Real CUDA streams and events on one GPU (`runtime.device: cuda`).

    Args:
        index: CUDA device index (the rank's local GPU); made current here.

    Raises:
        ValueError: torch sees no CUDA device.
    """

    kind = "cuda"
    is_cuda = True

    def __init__(self, *, index: int | None = None, seed: int = 0) -> None:
        if not torch.cuda.is_available():
            raise ValueError("runtime.device: cuda requested but torch sees no CUDA device; "
                             "use runtime.device=cpu")
        index = torch.cuda.current_device() if index is None else index
        torch.cuda.set_device(index)
        self.torch_device = torch.device("cuda", index)
        # The compute stream is fixed now; the engine runs all its kernels on it
        # (`compute_scope` makes it current), so no part asks for the current stream live.
        self.compute = Stream("compute", torch.cuda.current_stream(self.torch_device))
        self._streams = {"compute": self.compute}
        self.ledger = Ledger()

    def _new_stream(self, name: str) -> Stream:
        return Stream(name, torch.cuda.Stream(self.torch_device))

    def record(self, stream: Stream) -> Event:
        # blocking=True (cudaEventBlockingSync): a host thread that waits for the event sleeps
        # until it completes instead of spinning a core, which the host workers need (AdamW,
        # accumulation and NVMe threads wait for events beside the engine thread)
        raw = torch.cuda.Event(blocking=True)
        raw.record(stream.raw)
        return Event(self, stream, raw)

    def _wait_event(self, stream: Stream, event: Event) -> None:
        stream.raw.wait_event(event.raw)

    def _observed_compute_wait(self, stream: Stream, event: Event) -> None:
        """The compute stream's stall on the copy, from compute-stream timing events."""
        start = self.timing_event(self.compute)
        self._wait_event(stream, event)
        self.observer.on_stream_wait(channel_of(event.stream), start,
                                     self.timing_event(self.compute))

    def wait_stream(self, stream: Stream, other: Stream) -> None:
        stream.raw.wait_stream(other.raw)

    def _host_wait(self, event: Event) -> None:
        event.raw.synchronize()

    def query(self, event: Event) -> bool:
        return event.raw.query()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    copies_async = True

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        observed = self.observer is not None
        with torch.cuda.stream(stream.raw):
            start = self.timing_event(stream) if observed else None
            dst.copy_(src, non_blocking=True)
            event = self.record(stream)
        if observed:  # the copy engine's busy time, from the copy stream's own events
            self.observer.on_busy_events(channel_of(stream), start, self.timing_event(stream))
        return event

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        tensor.record_stream(stream.raw)

    def _alloc_device(self, shape, dtype: torch.dtype) -> torch.Tensor:
        with torch.cuda.stream(self.compute.raw):
            return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def batch_to_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """From page-locked memory without blocking the host (a pageable source would make
        the copy synchronous): the pinned staging copy is freed by the caching host allocator
        once the copy has run."""
        if t is None or t.device == self.torch_device:
            return t
        return t.pin_memory().to(self.torch_device, non_blocking=True)

    def pin_in_place(self, tensor: torch.Tensor, *, name: str | None = None) -> None:
        """`cudaHostRegister` on the tensor's bytes (unregistered when its storage is freed);
        memory already page-locked or refused by the driver stays as it is (its copies are
        then staged by the driver, correct but synchronous)."""
        cudart = torch.cuda.cudart()
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if nbytes and int(cudart.cudaHostRegister(ptr, nbytes, 0)) == 0:
            weakref.finalize(tensor.untyped_storage(), cudart.cudaHostUnregister, ptr)

    def _alloc_pinned(self, nbytes: int) -> torch.Tensor:
        """Exactly `nbytes` page-locked: page-aligned pageable memory registered with
        `cudaHostRegister` (torch's pinned allocator rounds every request up to a power of two,
        so a power-of-two boundary plus its 4 KiB pad would pin twice its size). The pages are
        unregistered when the storage is freed; the runtime frees pinned buffers only after
        synchronizing their copies (pools, `close`). Falls back to torch's pinned allocator
        where registration fails."""
        pages = -(-nbytes // PAGE_BYTES) * PAGE_BYTES  # whole pages: no page shared with
        t = super()._alloc_pinned(pages)               # another buffer's registration
        cudart = torch.cuda.cudart()
        ptr = t.data_ptr()
        if pages and int(cudart.cudaHostRegister(ptr, pages, 0)) == 0:
            weakref.finalize(t.untyped_storage(), cudart.cudaHostUnregister, ptr)
            return t[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _submit(self, executor: Executor, fn: Callable, *args, **kwargs) -> Future:
        index = self.torch_device.index

        def job():
            # A worker that synchronizes events must not create a context on GPU 0.
            torch.cuda.set_device(index)
            return fn(*args, **kwargs)
        return executor.submit(job)

    def compute_scope(self, *, allocations: bool = True):
        # the caching allocator's memory_stats cross-check the ledger here: no dispatch mode
        return torch.cuda.stream(self.compute.raw)

    def timing_event(self, stream: Stream | None = None):
        raw = torch.cuda.Event(enable_timing=True, blocking=True)  # resolved by a host wait
        raw.record((stream or self.compute).raw)
        return raw

    def elapsed_ms(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end)
