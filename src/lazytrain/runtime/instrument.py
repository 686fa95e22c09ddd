"""Per-window instrumentation of the engine: wall time, compute time, waits and bytes per channel.

Owns what one step of the engine measured, window by window, and its JSON form
(`RUN_DIR/windows.jsonl`). It decides nothing and changes no ordering: `Instrument.attach`
wraps the calls in which the engine (or its store) can wait for a channel, and each wrapper
knows its channel *by construction* (the call it wraps), never by guessing from timings:

| channel      | waits timed (CPU: `time.perf_counter` on the calling thread)                    |
|--------------|----------------------------------------------------------------------------------|
| `h2d`        | `DeviceWeights.load` (the weight copy; synchronous on CPU), `store.transfer(h2d)` |
| `d2h`        | `GradDrain.drain` / `flush` (gradient drain), `store.transfer(d2h)`                |
| `nvme_write` | `store.transfer(nvme_write)` (issuing), every `io.wait` on write futures          |
| `nvme_read`  | `store.transfer(nvme_read)` (issuing), every `io.wait` on read futures            |
| `optimizer`  | `BlockOptimizer.wait` (a block's pending AdamW update before its weight load)     |

NVMe futures are tagged with their kind when the store creates them (a thin proxy around
`store.io`), so the store's own waits (the window barrier `end_window`, an h2d waiting for its
nvme_read, an nvme_read waiting for its nvme_write) are attributed to the channel of the futures
waited for. Within one barrier, write futures are waited for before read futures; time where
both were outstanding goes to the first. Waits nest (an h2d transfer of an nvme boundary waits
for its reads): a wait's time excludes the waits nested inside it, so every millisecond is
counted once. On CPU a window's `compute_ms` is its wall time minus all its waits (everything
the main thread did that was not a channel wait: kernels, bookkeeping).

Which window gets an NVMe read stall: the window whose plan transfer issued the read. The read
is waited for either by an h2d of the same boundary later in that window (`TRANSFER_ORDER`
issues nvme_read before h2d) or by that window's barrier (`end_window` waits for every future
issued in the window), so the stall never leaks into a later window.

CUDA (written, untested here): window walls and the compute stream's waits for copies are
CUDA events on the compute stream (a pair around `weights.ready`, `store.get` and, at the window
barrier, around `compute.wait_stream` of the store's d2h and h2d streams); host-side waits
(NVMe futures, optimizer, event synchronize in the gradient drain) stay on `perf_counter`.
`compute_ms = max(0, wall_ms - sum(wait_ms))` there too. The weight H2D of block j+1 issued in
`f{j}` is waited for by the compute stream in `f{j+1}` (its consumer), not in `f{j}`.

windows.jsonl schema (one JSON object per line, one line per step and micro-batch; the
re-planning/refit code reads these key names):

    {"step": int,               # optimizer step, 1-based (as metrics.jsonl)
     "micro_batch": int,        # 0..grad_accum-1
     "plan_id": str,            # plan_id(plan): sha256 of the canonical plan JSON, 16 hex
     "windows": [               # execution order: pre, f0..f{L-1}, turn, b{L-1}..b0, post
        {"name": str,
         "wall_ms": float,      # window wall time, ms (includes its barrier)
         "compute_ms": float,   # wall_ms - sum(wait_ms), ms
         "wait_ms": {"h2d", "d2h", "nvme_read", "nvme_write", "optimizer": float ms},
         "bytes": {"h2d", "d2h", "nvme_read", "nvme_write": int},
                                # activation bytes moved by the store (NVMe kinds include 4 KiB
                                # padding) + weight bytes loaded (h2d) + gradient bytes drained (d2h)
         "peak_bytes": {"hbm", "dram", "nvme": int},
         "ledger": {"hbm_bytes": int,      # the allocation ledger (runtime/ledger.py): peak
                    "pinned_bytes": int,   # HBM / pinned bytes held by all owners, per window
                    "moved": {"h2d", "d2h", "nvme_read", "nvme_write": int}}}],
                                # bytes the device API copied / NVMe I/O issued in the window
     "ledger_peak": {"window": str, "hbm_bytes": int, "pinned_bytes": int,
                     "owners": {owner: bytes}}}   # the step's HBM peak so far, largest owners
                                # store accounting: checkpoint bytes in HBM, host bytes
                                # (dram + dram_staging), NVMe file bytes. Peaks are the store's
                                # per-window-name peaks since the step started, so for
                                # micro_batch k they are the max over micro-batches 0..k.

`pre` and `post` are not store windows: their `bytes` are weights/gradients only and their
`peak_bytes` are the store's bytes at the window's end.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

CHANNELS = ("h2d", "d2h", "nvme_read", "nvme_write", "optimizer")
"""Channels the compute can wait for (`wait_ms` keys)."""
BYTE_CHANNELS = ("h2d", "d2h", "nvme_read", "nvme_write")
"""Channels that move bytes (`bytes` keys)."""
PEAK_TIERS = ("hbm", "dram", "nvme")
"""`peak_bytes` keys."""
_STORE_TIER_KEYS = {"hbm": ("hbm",), "dram": ("dram", "dram_staging"), "nvme": ("nvme",)}
_FUTURE_KIND_ATTR = "_lazytrain_kind"


def plan_id(plan) -> str:
    """The plan's digest (`lazytrain.planner.plan.plan_digest`), recorded in windows.jsonl."""
    return plan.digest()


class _Window:
    """One open window of one micro-batch (internal, mutable)."""

    __slots__ = ("name", "start", "end", "waits", "stream_waits", "bytes", "peaks")

    def __init__(self, name: str, start) -> None:
        self.name, self.start, self.end = name, start, None
        self.waits = dict.fromkeys(CHANNELS, 0.0)
        self.stream_waits: list[tuple[str, object, object]] = []  # CUDA event pairs
        self.bytes = dict.fromkeys(BYTE_CHANNELS, 0)
        self.peaks: dict[str, int] | None = None


class _IoProxy:
    """`store.io` with its futures tagged by kind and its waits timed per kind.

    Everything else is forwarded to the wrapped `NvmeIO` unchanged.
    """

    def __init__(self, io, instrument: "Instrument") -> None:
        self._io, self._instrument = io, instrument

    def __getattr__(self, name):
        return getattr(self._io, name)

    def write(self, *args, **kwargs):
        return _tag(self._io.write(*args, **kwargs), "nvme_write")

    def read(self, *args, **kwargs):
        return _tag(self._io.read(*args, **kwargs), "nvme_read")

    def wait(self, futures) -> None:
        """As `NvmeIO.wait` (wait for all, then raise the first failure), timed per kind."""
        futures = list(futures)
        for kind in ("nvme_write", "nvme_read"):
            group = [f for f in futures if getattr(f, _FUTURE_KIND_ATTR, None) == kind]
            if group:
                with self._instrument.wait(kind):
                    self._io.device.wait_futures(group)  # through the device API: ordered
        self._io.wait(futures)


def _tag(futures: list, kind: str) -> list:
    for f in futures:
        setattr(f, _FUTURE_KIND_ATTR, kind)
    return futures


class _Wait:
    """Context manager timing one host-side wait of `channel`, exclusive of nested waits."""

    __slots__ = ("inst", "channel", "start", "nested")

    def __init__(self, inst: "Instrument", channel: str) -> None:
        self.inst, self.channel = inst, channel

    def __enter__(self):
        self.nested = 0.0
        self.inst._stack.append(self)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        elapsed = time.perf_counter() - self.start
        stack = self.inst._stack
        stack.pop()
        if stack:
            stack[-1].nested += elapsed
        w = self.inst._open
        if w is not None:
            w.waits[self.channel] += (elapsed - self.nested) * 1e3


class _StreamWait:
    """CUDA: a pair of compute-stream events around a compute-stream wait of `channel`."""

    __slots__ = ("inst", "channel", "start")

    def __init__(self, inst: "Instrument", channel: str) -> None:
        self.inst, self.channel = inst, channel

    def __enter__(self):
        self.start = self.inst._event()
        return self

    def __exit__(self, *exc) -> None:
        w = self.inst._open
        if w is not None:
            w.stream_waits.append((self.channel, self.start, self.inst._event()))


class Instrument:
    """Collects per-window measurements of one engine; see the module docstring.

    Args:
        device: the engine's device API (`runtime/device.py`): timing events on CUDA, wall
            clock on the CPU backends.
        store: the engine's `CheckpointStore` (bytes moved, peaks; its `io` gets the proxy).
        plan: the plan being executed (for `plan_id`).
    """

    def __init__(self, *, device, store, plan) -> None:
        self.device, self.store = device, store
        self.cuda = device.is_cuda
        self.plan_id = plan_id(plan)
        self._stack: list[_Wait] = []
        self._open: _Window | None = None
        self._mb: int | None = None
        self._mb_windows: list[_Window] = []
        self._records: list[dict] = []
        self._moved_seen: dict[str, dict[str, int]] = {}
        self._ledger_seen: dict[str, dict[str, int]] = {}

    # --- wiring ------------------------------------------------------------------------------

    def attach(self, engine) -> None:
        """Wrap the engine's waiting calls (instance attributes; the classes are untouched)."""
        opt, weights, drain, store = engine.optimizer, engine.weights, engine.drain, self.store
        opt.wait = self._timed("optimizer", opt.wait)
        weights.load = self._timed("h2d", weights.load, count=_weight_bytes(weights))
        drain.drain = self._timed("d2h", drain.drain, count=_grad_bytes)
        drain.flush = self._timed("d2h", drain.flush)
        transfer = store.transfer

        def timed_transfer(boundary, kind, *args, **kwargs):
            with _Wait(self, kind):
                return transfer(boundary, kind, *args, **kwargs)

        store.transfer = timed_transfer
        store.io = _IoProxy(store.io, self)
        if self.cuda:
            weights.ready = self._stream_timed("h2d", weights.ready)
            store.get = self._stream_timed("h2d", store.get)
            store.end_window = self._cuda_barrier(store.end_window)

    def set_plan(self, plan) -> None:
        """A new plan from the next window on (re-planning switches at a step boundary)."""
        self.plan_id = plan_id(plan)

    def wait(self, channel: str) -> _Wait:
        """`with inst.wait("nvme_read"):` times a host-side wait of `channel`."""
        return _Wait(self, channel)

    def _timed(self, channel: str, fn, *, count=None):
        def wrapped(*args, **kwargs):
            with _Wait(self, channel):
                out = fn(*args, **kwargs)
            if count is not None and self._open is not None:
                self._open.bytes[channel] += count(*args, **kwargs)
            return out
        return wrapped

    def _stream_timed(self, channel: str, fn):
        def wrapped(*args, **kwargs):
            with _StreamWait(self, channel):
                return fn(*args, **kwargs)
        return wrapped

    def _cuda_barrier(self, end_window):
        """Before the store's barrier, make compute wait on its d2h, then h2d stream (timed)."""
        dev = self.device
        channels = (("d2h", self.store.d2h_stream), ("h2d", self.store.h2d_stream))

        def wrapped():
            for channel, stream in channels:
                with _StreamWait(self, channel):
                    # the barrier would wait on these events anyway
                    dev.wait_stream(dev.compute, stream)
            return end_window()
        return wrapped

    def _event(self):
        return self.device.timing_event()

    # --- windows -----------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Forget anything not taken yet (e.g. from `compute_gradients`)."""
        self._records.clear()
        self._mb_windows = []
        self._mb = None
        self._moved_seen = {}
        self._ledger_seen = {}

    def begin_micro_batch(self, index: int) -> None:
        """Close the previous micro-batch's record and start micro-batch `index`."""
        self._finish_micro_batch()
        self._mb = index

    def window(self, name: str) -> "_WindowScope":
        """`with inst.window("f3"):` around the whole window, its barrier included."""
        return _WindowScope(self, name)

    def take_records(self) -> list[dict]:
        """The step's records, one per micro-batch (schema without "step"); clears them.

        On CUDA this synchronizes on the last event (sync point; call once per step).
        """
        self._finish_micro_batch()
        out, self._records = self._records, []
        self._moved_seen = {}
        self._ledger_seen = {}
        return out

    def _finish_micro_batch(self) -> None:
        if self._mb is None:
            return
        moved = self.store.bytes_moved_by_window()
        peaks = self.store.peak_by_window()
        windows = []
        for w in self._mb_windows:
            now = moved.get(w.name)
            if now is not None:
                seen = self._moved_seen.get(w.name, {})
                for kind, n in now.items():
                    w.bytes[kind] += n - seen.get(kind, 0)
                self._moved_seen[w.name] = now
            if w.name in peaks:
                w.peaks = _tier_peaks(peaks[w.name])
            windows.append(self._resolve(w))
        self._add_ledger(windows)
        self._records.append({"micro_batch": self._mb, "plan_id": self.plan_id,
                              "ledger_peak": self._ledger_peak(),
                              "windows": windows})
        self._mb_windows = []
        self._mb = None

    def _add_ledger(self, windows: list[dict]) -> None:
        """Each window's ledger figures: peak HBM and pinned bytes held (all owners; the peak
        since the step started, as `peak_bytes`) and bytes moved per channel in this
        micro-batch (`runtime/ledger.py`)."""
        ledger = self.device.ledger
        hbm, pinned = ledger.peak_by_window("hbm"), ledger.peak_by_window("pinned")
        moved = ledger.moved_by_window()
        for w in windows:
            name = w["name"]
            now = moved.get(name, {})
            seen = self._ledger_seen.get(name, {})
            w["ledger"] = {"hbm_bytes": int(hbm.get(name, 0)),
                           "pinned_bytes": int(pinned.get(name, 0)),
                           "moved": {c: int(now.get(c, 0) - seen.get(c, 0)) for c in CHANNELS
                                     if c in ("h2d", "d2h", "nvme_read", "nvme_write")}}
            self._ledger_seen[name] = dict(now)

    def _ledger_peak(self) -> dict:
        """The window of the step's HBM peak so far and its largest owners (bytes)."""
        window, owners = self.device.ledger.peak_owners("hbm")
        top = dict(sorted(owners.items(), key=lambda kv: -kv[1])[:8])
        return {"window": window, "hbm_bytes": int(sum(owners.values())), "owners": top,
                "pinned_bytes": int(self.device.ledger.peak_bytes("pinned"))}

    def _resolve(self, w: _Window) -> dict:
        wall = self.device.elapsed_ms(w.start, w.end)
        for channel, a, b in w.stream_waits:
            w.waits[channel] += self.device.elapsed_ms(a, b)
        waits = {c: round(w.waits[c], 4) for c in CHANNELS}
        return {"name": w.name, "wall_ms": round(wall, 4),
                "compute_ms": round(max(0.0, wall - sum(w.waits.values())), 4),
                "wait_ms": waits, "bytes": dict(w.bytes),
                "peak_bytes": w.peaks or dict.fromkeys(PEAK_TIERS, 0)}


class _WindowScope:
    __slots__ = ("inst", "name")

    def __init__(self, inst: Instrument, name: str) -> None:
        self.inst, self.name = inst, name

    def __enter__(self):
        inst = self.inst
        inst._open = _Window(self.name, inst._event() if inst.cuda else time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        inst = self.inst
        w = inst._open
        w.end = inst._event() if inst.cuda else time.perf_counter()
        w.peaks = _tier_peaks(inst.store.bytes_by_tier())  # pre/post; store windows override
        inst._mb_windows.append(w)
        inst._open = None


def _tier_peaks(accounting: dict[str, int]) -> dict[str, int]:
    return {t: int(sum(accounting.get(k, 0) for k in keys)) for t, keys in _STORE_TIER_KEYS.items()}


def _weight_bytes(weights):
    size = torch.empty((), dtype=weights.dtype).element_size()
    return lambda group, *args, **kwargs: group.numel * size


def _grad_bytes(group, grad, *args, **kwargs) -> int:
    return 0 if grad is None else group.numel * 4  # fp32 into the host accumulator


def write_windows_jsonl(path: str | Path, *, step: int, records: list[dict]) -> None:
    """Append one line per micro-batch record of `step` to `path` (RUN_DIR/windows.jsonl).

    Appends are line-sized writes on one open file; a crash leaves at most a torn last line
    (readers skip lines that do not parse).
    """
    with open(path, "a") as fh:
        for rec in records:
            fh.write(json.dumps({"step": step, **rec}) + "\n")
