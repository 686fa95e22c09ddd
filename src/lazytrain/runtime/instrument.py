"""Per-window instrumentation of the engine: wall, compute, waits, busy and host time per channel.

Owns what one step of the engine measured, window by window, and its JSON form
(`RUN_DIR/windows.jsonl`). It decides nothing and changes no ordering, and it replaces no method
of another object: it is the device API's observer (`Device.set_observer`, an explicit
interface), and every wait, copy and piece of host work of the runtime already goes through the
device API, which knows each one's channel *by construction*:

| what the device API reports   | where it comes from                                            |
|-------------------------------|----------------------------------------------------------------|
| `on_wait(channel, s)`         | the engine's thread blocked: `host_wait` of an event (channel  |
|                               | of its stream: h2d/ckpt_h2d -> h2d, d2h/ckpt_d2h -> d2h),      |
|                               | `wait_futures` (the channel the job was submitted with:        |
|                               | nvme_read, nvme_write, optimizer, d2h for the gradient drain), |
|                               | a synchronous copy on the CPU backends (compute waits for it)  |
| `on_stream_wait(channel,a,b)` | CUDA: the compute stream's `wait_event`, a pair of compute-    |
|                               | stream timing events around it                                 |
| `on_busy(channel, s)`,        | a channel moving bytes: a copy (CPU: timed on the host; CUDA:  |
| `on_busy_events(channel,a,b)` | the copy stream's own events), an NVMe chunk (its thread)      |
| `on_host(s)`                  | host work: master -> compute dtype conversion, gradient        |
|                               | accumulation (on its worker)                                   |

Per window: `compute_ms` is the compute stream's busy time, from pairs of timing events (CUDA
events on the compute stream; wall clock on the CPU backends, where compute runs on the
engine's thread) around the stretches in which the engine's thread queues compute: a stretch
ends where that thread blocks (`on_block`: a host wait, a synchronous copy, its own host work)
and the next begins where the block ends, and a compute-stream wait for a copy (the pair of
`on_stream_wait`) is cut out too. So the compute stream's idle while the host was blocked is
not compute: it is `host_blocked_ms`, the time between the event before each block and the
one after it (on CUDA, kernels queued before a wait keep the stream busy through part of it,
and only the rest counts). `wall_ms = compute_ms + host_blocked_ms + the compute-stream
waits for copies`; `exposed_ms = wall_ms - compute_ms`. Not told apart: a stream starved by
slow kernel launches without any block still counts as compute (kernel-level timing, e.g.
CUPTI, would separate it). Refit and re-planning read
`compute_ms`: block costs come from device time only. `busy_ms` per channel is the channel's
own busy time (it may overlap compute); `host_ms` the host work of the window, on any thread.

Which window gets a stall: the one open when the engine's thread waited. An NVMe read is waited
for by an h2d of the same boundary later in its issuing window or by that window's barrier
(`end_window` waits for every future issued in the window), so its stall never leaks into a
later window. Work on other threads (NVMe chunks, accumulation) is booked to the window open
when it ran.

windows.jsonl schema (one JSON object per line, one line per step and micro-batch; the
re-planning/refit code reads these key names):

    {"step": int,               # optimizer step, 1-based (as metrics.jsonl)
     "micro_batch": int,        # 0..grad_accum-1
     "plan_id": str,            # plan_id(plan): sha256 of the canonical plan JSON, 16 hex
     "windows": [               # execution order: pre, f0..f{L-1}, turn, b{L-1}..b0, post
        {"name": str,
         "wall_ms": float,      # window wall time, ms (includes its barrier)
         "compute_ms": float,   # compute-stream time (see above), ms
         "exposed_ms": float,   # wall_ms - compute_ms
         "host_blocked_ms": float,  # compute stream idle while the engine thread was blocked
         "host_blocked_on_ms": {"h2d", "d2h", "nvme_read", "nvme_write", "optimizer",
                                "host": float ms},  # the same, by what the thread waited
                                # for (an outermost wait's channel; host: its host work)
                                # (optional: files written before it lack it)
         "wait_ms": {"h2d", "d2h", "nvme_read", "nvme_write", "optimizer", "host": float ms},
         "busy_ms": {"h2d", "d2h", "nvme_read", "nvme_write": float ms},
         "host_ms": float,      # host work (conversion, accumulation), ms
         "bytes": {"h2d", "d2h", "nvme_read", "nvme_write": int},
                                # bytes the device API copied / NVMe I/O issued in the window
                                # (the ledger's; NVMe kinds include 4 KiB padding)
         "saved_d2h_bytes": int,  # of which L1/L2 blocks' saved internals moved D2H / H2D
         "saved_h2d_bytes": int,  # by the plan's internal transfers (runtime/saved_store.py)
         "peak_bytes": {"hbm", "dram", "nvme": int},
                                # store accounting: checkpoint bytes in HBM, host bytes
                                # (dram + dram_staging), NVMe file bytes. Peaks are the store's
                                # per-window-name peaks since the step started, so for
                                # micro_batch k they are the max over micro-batches 0..k.
         "ledger": {"hbm_bytes": int,      # the allocation ledger (runtime/ledger.py): peak
                    "pinned_bytes": int,   # HBM / pinned bytes held by all owners, per window
                    "moved": {"h2d", "d2h", "nvme_read", "nvme_write": int}}}],
     "ledger_peak": {"window": str, "hbm_bytes": int, "pinned_bytes": int,
                     "owners": {owner: bytes}}}   # the step's HBM peak so far, largest owners

`pre` and `post` are not store windows: their `peak_bytes` are the store's bytes at the window's
end.
"""

from __future__ import annotations

import threading
from pathlib import Path

from lazytrain.atomic import append_jsonl

CHANNELS = ("h2d", "d2h", "nvme_read", "nvme_write", "optimizer", "host")
"""Channels the compute can wait for (`wait_ms` keys)."""
BYTE_CHANNELS = ("h2d", "d2h", "nvme_read", "nvme_write")
"""Channels that move bytes (`bytes` and `busy_ms` keys)."""
PEAK_TIERS = ("hbm", "dram", "nvme")
"""`peak_bytes` keys."""
_STORE_TIER_KEYS = {"hbm": ("hbm",), "dram": ("dram", "dram_staging"), "nvme": ("nvme",)}


def plan_id(plan) -> str:
    """The plan's digest (`lazytrain.planner.plan.plan_digest`), recorded in windows.jsonl."""
    return plan.digest()


class _Window:
    """One open window of one micro-batch (internal, mutable)."""

    __slots__ = ("name", "start", "end", "waits", "stream_waits", "busy", "busy_events",
                 "host_ms", "peaks", "computing", "blocked", "open_at", "depth")

    def __init__(self, name: str, start) -> None:
        self.name, self.start, self.end = name, start, None
        self.waits = dict.fromkeys(CHANNELS, 0.0)
        self.stream_waits: list[tuple[str, object, object]] = []  # CUDA event pairs
        self.busy = dict.fromkeys(BYTE_CHANNELS, 0.0)
        self.busy_events: list[tuple[str, object, object]] = []  # CUDA event pairs
        self.host_ms = 0.0
        self.computing: list[tuple[object, object]] = []  # timing-event pairs of compute
        self.blocked: list[tuple] = []  # (event, event, channel) around the engine's blocks
        self.open_at = start  # the event the current compute stretch began at (None: blocked)
        self.depth = 0  # nested blocks of the engine's thread
        self.peaks: dict[str, int] | None = None


class Instrument:
    """Collects per-window measurements of one engine; see the module docstring.

    Args:
        device: the engine's device API (`runtime/device.py`); the instrument becomes its
            observer in `attach`.
        store: the engine's `ActivationStore` (peaks).
        plan: the plan being executed (for `plan_id`).
    """

    def __init__(self, *, device, store, plan) -> None:
        self.device, self.store = device, store
        self.plan_id = plan_id(plan)
        self._lock = threading.Lock()
        self._engine_thread = threading.current_thread()
        self._open: _Window | None = None
        self._mb: int | None = None
        self._mb_windows: list[_Window] = []
        self._records: list[tuple[dict, list[_Window]]] = []  # (host figures, windows)
        self._ledger_seen: dict[str, dict[str, int]] = {}
        self.saved = None  # the engine's SavedStore (`attach`): saved internals moved

    # --- wiring ------------------------------------------------------------------------------

    def attach(self, engine) -> None:
        """Observe the engine's device API (waits, copies, host work): nothing is patched."""
        self._engine_thread = threading.current_thread()
        self.device.set_observer(self)
        self.saved = getattr(engine, "saved", None)

    def set_plan(self, plan) -> None:
        """A new plan from the next window on (re-planning switches at a step boundary)."""
        self.plan_id = plan_id(plan)

    # --- the device API's observer interface -------------------------------------------------

    def on_block(self) -> None:
        """The engine's thread is about to block: the compute stretch ends here."""
        w = self._open
        if w is not None:
            w.depth += 1
            if w.open_at is not None:
                now = self.device.timing_event()
                w.computing.append((w.open_at, now))
                w.blocked.append((now, None, "host"))
                w.open_at = None

    def _unblock(self, w: _Window, channel: str) -> None:
        """The engine's thread's block on `channel` ended: the next compute stretch begins
        (at the outermost block's end, which names the channel)."""
        if w.depth > 0:
            w.depth -= 1
            if w.depth == 0 and w.open_at is None:
                now = self.device.timing_event()
                w.blocked[-1] = (w.blocked[-1][0], now, channel)
                w.open_at = now

    def on_wait(self, channel: str, seconds: float) -> None:
        w = self._open
        if w is not None:
            channel = channel if channel in w.waits else "host"
            w.waits[channel] += seconds * 1e3
            self._unblock(w, channel)

    def on_stream_wait(self, channel: str, start, end) -> None:
        w = self._open
        if w is not None:
            w.stream_waits.append((channel, start, end))
            if w.open_at is not None:  # the compute stream's wait is no compute either
                w.computing.append((w.open_at, start))
                w.open_at = end

    def on_busy(self, channel: str, seconds: float) -> None:
        with self._lock:
            w = self._open
            if w is not None and channel in w.busy:
                w.busy[channel] += seconds * 1e3

    def on_busy_events(self, channel: str, start, end) -> None:
        with self._lock:
            w = self._open
            if w is not None:
                w.busy_events.append((channel, start, end))

    def on_host(self, seconds: float) -> None:
        with self._lock:
            w = self._open
            if w is not None:
                w.host_ms += seconds * 1e3
                if threading.current_thread() is self._engine_thread:
                    self._unblock(w, "host")

    # --- windows -----------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Forget anything not taken yet (e.g. from `compute_gradients`); the calling thread is
        the engine's from now on (the one whose waits are the windows')."""
        self._engine_thread = threading.current_thread()
        self.device.set_observer(self)
        self._records.clear()
        self._mb_windows = []
        self._mb = None
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

        The timing events of every micro-batch are resolved here, once per step (on CUDA a
        sync on the last event: the step's end); a micro-batch's end only takes the host-side
        figures (peaks, ledger), so no micro-batch waits for the device.
        """
        self._finish_micro_batch()
        out = []
        for record, windows in self._records:
            resolved = [self._resolve(w) for w in windows]
            for w, figures in zip(resolved, record.pop("ledger_windows")):
                w["bytes"] = dict(figures["moved"])
                w["ledger"] = figures
                saved = ({} if self.saved is None
                         else self.saved.moved(record["micro_batch"], w["name"]))
                w["saved_d2h_bytes"] = int(saved.get("d2h", 0))
                w["saved_h2d_bytes"] = int(saved.get("h2d", 0))
            out.append({**record, "windows": resolved})
        self._records = []
        self._ledger_seen = {}
        return out

    def _finish_micro_batch(self) -> None:
        """The micro-batch's host-side figures, taken now (they move on with the next one);
        its timing events stay unresolved until `take_records`."""
        if self._mb is None:
            return
        peaks = self.store.peak_by_window()
        for w in self._mb_windows:
            if w.name in peaks:
                w.peaks = _tier_peaks(peaks[w.name])
        self._records.append(({"micro_batch": self._mb, "plan_id": self.plan_id,
                               "ledger_peak": self._ledger_peak(),
                               "ledger_windows": self._ledger_figures(self._mb_windows)},
                              self._mb_windows))
        self._mb_windows = []
        self._mb = None

    def _ledger_figures(self, windows: list[_Window]) -> list[dict]:
        """Each window's ledger figures: peak HBM and pinned bytes held (all owners; the peak
        since the step started, as `peak_bytes`) and bytes moved per channel in this
        micro-batch (`runtime/ledger.py`), which are also the window's `bytes`."""
        ledger = self.device.ledger
        hbm, pinned = ledger.peak_by_window("hbm"), ledger.peak_by_window("pinned")
        moved = ledger.moved_by_window()
        out = []
        for w in windows:
            now = moved.get(w.name, {})
            seen = self._ledger_seen.get(w.name, {})
            delta = {c: int(now.get(c, 0) - seen.get(c, 0)) for c in BYTE_CHANNELS}
            out.append({"hbm_bytes": int(hbm.get(w.name, 0)),
                        "pinned_bytes": int(pinned.get(w.name, 0)), "moved": delta})
            self._ledger_seen[w.name] = dict(now)
        return out

    def _ledger_peak(self) -> dict:
        """The window of the step's HBM peak so far and its largest owners (bytes)."""
        window, owners = self.device.ledger.peak_owners("hbm")
        top = dict(sorted(owners.items(), key=lambda kv: -kv[1])[:8])
        return {"window": window, "hbm_bytes": int(sum(owners.values())), "owners": top,
                "pinned_bytes": int(self.device.ledger.peak_bytes("pinned"))}

    def _resolve(self, w: _Window) -> dict:
        wall = self.device.elapsed_ms(w.start, w.end)
        stream_waits = 0.0
        for channel, a, b in w.stream_waits:
            ms = self.device.elapsed_ms(a, b)
            w.waits[channel] += ms
            stream_waits += ms
        for channel, a, b in w.busy_events:
            w.busy[channel] += self.device.elapsed_ms(a, b)
        # compute: the stretches between the engine thread's blocks and the stream's waits
        # (module docstring), never more than the window less its copy waits
        compute = sum(self.device.elapsed_ms(a, b) for a, b in w.computing)
        compute = max(0.0, min(compute, wall - stream_waits))
        blocked_on = dict.fromkeys(CHANNELS, 0.0)
        for a, b, channel in w.blocked:
            blocked_on[channel] += self.device.elapsed_ms(a, b)
        return {"name": w.name, "wall_ms": round(wall, 4), "compute_ms": round(compute, 4),
                "exposed_ms": round(wall - compute, 4),
                "host_blocked_ms": round(max(0.0, sum(blocked_on.values())), 4),
                "host_blocked_on_ms": {c: round(max(0.0, v), 4) for c, v in blocked_on.items()},
                "wait_ms": {c: round(w.waits[c], 4) for c in CHANNELS},
                "busy_ms": {c: round(w.busy[c], 4) for c in BYTE_CHANNELS},
                "host_ms": round(w.host_ms, 4), "bytes": dict.fromkeys(BYTE_CHANNELS, 0),
                "peak_bytes": w.peaks or dict.fromkeys(PEAK_TIERS, 0)}


class _WindowScope:
    __slots__ = ("inst", "name")

    def __init__(self, inst: Instrument, name: str) -> None:
        self.inst, self.name = inst, name

    def __enter__(self):
        inst = self.inst
        window = _Window(self.name, inst.device.timing_event())
        with inst._lock:
            inst._open = window
        return self

    def __exit__(self, *exc) -> None:
        inst = self.inst
        w = inst._open
        w.end = inst.device.timing_event()
        if w.open_at is not None:  # the last compute stretch ends with the window
            w.computing.append((w.open_at, w.end))
        elif w.blocked and w.blocked[-1][1] is None:  # left blocked (an error inside a wait)
            w.blocked[-1] = (w.blocked[-1][0], w.end, "host")
        w.peaks = _tier_peaks(inst.store.bytes_by_tier())  # pre/post; store windows override
        inst._mb_windows.append(w)
        with inst._lock:
            inst._open = None


def _tier_peaks(accounting: dict[str, int]) -> dict[str, int]:
    return {t: int(sum(accounting.get(k, 0) for k in keys)) for t, keys in _STORE_TIER_KEYS.items()}


def write_windows_jsonl(path: str | Path, *, step: int, records: list[dict]) -> None:
    """Append one line per micro-batch record of `step` to `path` (RUN_DIR/windows.jsonl).

    Appends are line-sized writes on one open file; a crash leaves at most a torn last line
    (readers skip lines that do not parse).
    """
    append_jsonl(path, [{"step": step, **rec} for rec in records])  # never through a symlink
