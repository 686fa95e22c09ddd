"""A small discrete-event engine over FIFO streams with dependencies, buffer pools and barriers.

Owns the mechanics only: when a task may start, at what rate it runs, when it ends, and which
constraint made it wait. Knows nothing of plans, tiers or blocks (`sim/tasks.py` builds the
task graph from a Plan; `sim/simulate.py` turns the timeline into window reports).

Model (GPU, `overlap=True`):
- One FIFO queue per stream (compute, h2d, d2h, nvme_read, nvme_write, host): a stream runs at
  most one task at a time, in the order the tasks were issued, like a CUDA stream / one copy
  engine; `host` is the host CPU's weight conversion and gradient accumulation.
- A task starts when (a) the previous task on its stream has ended, (b) every dependency has
  ended, (c) with barriers on, every task of every earlier window has ended (the engine's
  window barrier, docs/execution_model.md), and (d) a slot of its pool is free, if it takes one.
- Rates: compute and host run 1 ms of work per ms; a copy stream moves `rate` bytes per ms.
  Duplex cap: while an h2d and a d2h task run at once and `rate_h2d + rate_d2h > duplex`, the
  two share the duplex max-min fairly: each gets `min(own rate, duplex / 2)` and the leftover
  of the one that needs less goes to the other, so `r_h2d + r_d2h <= duplex` always. (A PCIe
  link has separate lanes per direction; the cap stands for the root complex / host memory
  limit. Fair sharing is what two DMA engines competing for it get with no pacing by the
  engine, and it is the rule of docs/execution_model.md, "Duplex sharing", which the evaluator
  and the MILP price in closed form; this engine gets it task by task.)

Model (CPU, `overlap=False`): one shared resource. At any time exactly one task runs (compute,
copies and host work contend for the same cores); among the ready stream heads the earliest-issued one
runs. Copies run at their own stream's rate; no duplex sharing (nothing runs concurrently).

A slot pool (`pools`) models reusable device buffers: a task with `acquire=pool` takes a slot at
its start; the slot is freed when every task listed in `hold_until` has ended (or at the task's
own end if `hold_until` is empty).
"""

from __future__ import annotations

from dataclasses import dataclass, field

STREAMS = ("compute", "h2d", "d2h", "nvme_read", "nvme_write", "host")
"""Stream names, in the order the engine tries to start their heads (deterministic). `host` is
the host CPU's conversion and accumulation work (ms of work, like compute)."""

_EPS_MS = 1e-12
"""Time tolerance for event coincidence, ms (far below any reported digit)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class TaskSpec:
    """One unit of work on one stream.

    `work` is ms for the compute stream and bytes for a copy stream. `deps` pairs each
    predecessor's task id with the reason it must come first ("weight load before use").
    """

    id: int
    name: str
    stream: str
    window: int
    """Index into the window list given to `run` (0-based, execution order)."""
    work: float
    deps: tuple[tuple[int, str], ...] = ()
    acquire: str | None = None
    """Pool a slot of which this task takes at its start (e.g. "weights", "grads")."""
    hold_until: tuple[int, ...] = ()
    """Task ids whose end frees the acquired slot (all of them); empty: this task's own end."""
    kind: str = ""
    """Free-form label for reports ("fwd", "recompute", "weights", "d2h", ...)."""
    block: int | None = None
    boundary: int | None = None


@dataclass(kw_only=True, frozen=True, slots=True)
class TaskRun:
    """When a task ran and why it started when it did.

    `waited_on` is the task whose end released the binding constraint (None: the barrier or
    time zero); `reason` names that constraint: a dependency's reason string, "stream order",
    "buffer <pool>", "window barrier", "shared resource" (CPU) or "ready".
    `duplex_delay_ms` is how much longer the task ran because it shared the duplex cap.
    """

    id: int
    start_ms: float
    end_ms: float
    reason: str
    waited_on: int | None
    duplex_delay_ms: float = 0.0


@dataclass(kw_only=True, slots=True)
class _State:
    """Mutable bookkeeping of one `run` (internal)."""

    end: dict[int, float] = field(default_factory=dict)
    start: dict[int, float] = field(default_factory=dict)
    remaining: dict[int, float] = field(default_factory=dict)
    delay: dict[int, float] = field(default_factory=dict)
    why: dict[int, tuple[str, int | None]] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)
    head: dict[str, int] = field(default_factory=dict)
    free_slots: dict[str, list[tuple[float, int | None]]] = field(default_factory=dict)
    held: dict[int, str] = field(default_factory=dict)
    window_left: list[int] = field(default_factory=list)
    window_end: list[float] = field(default_factory=list)


def duplex_rates(h2d: float, d2h: float, duplex: float) -> tuple[float, float]:
    """Max-min fair split of the duplex cap between a running h2d and d2h copy.

    Args:
        h2d, d2h: each direction's own rate (bytes/ms).
        duplex: cap on the sum (bytes/ms).

    Returns:
        (h2d rate, d2h rate) with each <= its own rate and the sum <= duplex.
    """
    if h2d + d2h <= duplex:
        return h2d, d2h
    half = duplex / 2.0
    if h2d <= half:
        return h2d, min(d2h, duplex - h2d)
    if d2h <= half:
        return min(h2d, duplex - d2h), d2h
    return half, half


def run(tasks: list[TaskSpec], *, num_windows: int, rates: dict[str, float],
        duplex: float | None, overlap: bool, pools: dict[str, int],
        barriers: bool = True) -> dict[int, TaskRun]:
    """Simulate `tasks` and return when each ran.

    Args:
        tasks: in issue order (each stream runs its tasks in this order); ids are unique and
            every dependency id refers to a task in the list.
        num_windows: number of windows (task.window < num_windows).
        rates: work per ms for each stream (1.0 for compute; bytes/ms for copies).
        duplex: cap on h2d + d2h bytes/ms while both run (None: no cap). GPU mode only.
        overlap: True: streams run concurrently (GPU); False: one shared resource (CPU).
        pools: slot count per pool name.
        barriers: whether a window waits for every earlier window to end.

    Returns:
        {task id: TaskRun}.

    Raises:
        RuntimeError: the graph deadlocks (a cycle through stream order, dependencies or
            pools); the message lists the stuck stream heads.
    """
    by_id = {t.id: t for t in tasks}
    queues: dict[str, list[int]] = {s: [] for s in STREAMS}
    for t in tasks:
        queues[t.stream].append(t.id)
    st = _State(head={s: 0 for s in STREAMS},
                free_slots={p: [(0.0, None)] * n for p, n in pools.items()},
                window_left=[0] * num_windows, window_end=[0.0] * num_windows)
    for t in tasks:
        st.window_left[t.window] += 1
    holders: dict[int, list[int]] = {}  # task id in hold_until -> acquirer ids it must free
    for t in tasks:
        for h in (t.hold_until if t.acquire else ()):
            holders.setdefault(h, []).append(t.id)
    pending_hold = {t.id: set(t.hold_until) for t in tasks if t.acquire}
    now = 0.0
    done = 0
    while done < len(tasks):
        done += _start_ready(st, by_id, queues, now=now, overlap=overlap, barriers=barriers,
                             pending_hold=pending_hold, holders=holders)
        if done >= len(tasks):
            break
        if not st.running:
            stuck = [by_id[queues[s][st.head[s]]].name for s in STREAMS
                     if st.head[s] < len(queues[s])]
            raise RuntimeError(f"event simulation deadlocked at {now:.4f} ms; stuck stream "
                               f"heads: {stuck}")
        now, finished = _advance(st, by_id, rates=rates, duplex=duplex if overlap else None,
                                 now=now)
        for tid in finished:
            _finish(st, by_id[tid], now, pending_hold=pending_hold, holders=holders)
            done += 1
    return {tid: TaskRun(id=tid, start_ms=st.start[tid], end_ms=st.end[tid],
                         reason=st.why[tid][0], waited_on=st.why[tid][1],
                         duplex_delay_ms=st.delay.get(tid, 0.0)) for tid in by_id}


def _start_ready(st: _State, by_id: dict[int, TaskSpec], queues: dict[str, list[int]], *,
                 now: float, overlap: bool, barriers: bool, pending_hold: dict[int, set[int]],
                 holders: dict[int, list[int]]) -> int:
    """Start every stream head that may start at `now`; returns how many zero-work tasks ended."""
    ended = 0
    progress = True
    while progress:
        progress = False
        if not overlap and st.running:
            return ended
        candidates = []
        for s in STREAMS:
            if s in st.running or st.head[s] >= len(queues[s]):
                continue
            tid = queues[s][st.head[s]]
            gate = _gate(st, by_id[tid], queues, barriers=barriers)
            if gate is not None:
                candidates.append((tid, gate))
        if not overlap:
            candidates = sorted(candidates)[:1]
        for tid, (reason, waited_on, gate_ms) in candidates:
            t = by_id[tid]
            if not overlap and gate_ms < now - _EPS_MS:
                reason, waited_on = "shared resource", _last_ended(st)
            st.start[tid] = now
            st.why[tid] = (reason, waited_on)
            st.head[t.stream] += 1
            if t.acquire:
                st.free_slots[t.acquire].pop(0)
                st.held[tid] = t.acquire
            progress = True
            if t.work <= 0.0:
                _finish(st, t, now, pending_hold=pending_hold, holders=holders)
                ended += 1
            else:
                st.running[t.stream] = tid
                st.remaining[tid] = t.work
    return ended


def _last_ended(st: _State) -> int | None:
    if not st.end:
        return None
    return max(st.end, key=lambda k: (st.end[k], k))


def _gate(st: _State, t: TaskSpec, queues: dict[str, list[int]], *,
          barriers: bool) -> tuple[str, int | None, float] | None:
    """None if `t` cannot start yet; else (binding reason, task that released it, its time).

    The binding constraint is the one satisfied last; on a tie a dependency beats a buffer,
    which beats the barrier, which beats stream order (the more specific cause is reported).
    """
    cands: list[tuple[float, int, str, int | None]] = [(0.0, -1, "ready", None)]
    for dep, why in t.deps:
        if dep not in st.end:
            return None
        cands.append((st.end[dep], 3, why, dep))
    pos = st.head[t.stream]
    if pos > 0:
        prev = queues[t.stream][pos - 1]
        if prev not in st.end:
            return None
        cands.append((st.end[prev], 0, "stream order", prev))
    if barriers and t.window > 0:
        if any(st.window_left[w] for w in range(t.window)):
            return None
        cands.append((st.window_end[t.window - 1], 1, "window barrier", None))
    if t.acquire:
        slots = st.free_slots[t.acquire]
        if not slots:
            return None
        freed_ms, freed_by = slots[0]
        cands.append((freed_ms, 2, f"buffer {t.acquire}", freed_by))
    latest = max(c[0] for c in cands)
    _, _, reason, by = max((c for c in cands if c[0] >= latest - _EPS_MS), key=lambda c: c[1])
    return reason, by, latest


def _advance(st: _State, by_id: dict[int, TaskSpec], *, rates: dict[str, float],
             duplex: float | None, now: float) -> tuple[float, list[int]]:
    """Run the current tasks to the next completion; returns (new time, ids that ended)."""
    rate = {s: rates[s] for s in st.running}
    if duplex is not None and "h2d" in rate and "d2h" in rate:
        rate["h2d"], rate["d2h"] = duplex_rates(rate["h2d"], rate["d2h"], duplex)
    dt = min(st.remaining[tid] / rate[s] for s, tid in st.running.items())
    finished = []
    for s, tid in list(st.running.items()):
        st.remaining[tid] -= rate[s] * dt
        if rate[s] < rates[s]:
            st.delay[tid] = st.delay.get(tid, 0.0) + dt * (1.0 - rate[s] / rates[s])
        if st.remaining[tid] <= 1e-9 * by_id[tid].work + 1e-12:
            finished.append(tid)
    return now + dt, finished


def _finish(st: _State, t: TaskSpec, now: float, *, pending_hold: dict[int, set[int]],
            holders: dict[int, list[int]]) -> None:
    """Record the end of `t`, free pool slots it completes, close its window if last."""
    st.end[t.id] = now
    if st.running.get(t.stream) == t.id:
        del st.running[t.stream]
    st.window_left[t.window] -= 1
    st.window_end[t.window] = max(st.window_end[t.window], now)
    if st.window_left[t.window] == 0:
        # an empty-so-far later window inherits the barrier time
        for w in range(t.window + 1, len(st.window_end)):
            st.window_end[w] = max(st.window_end[w], st.window_end[w - 1])
    releasing = list(holders.get(t.id, ()))
    if t.acquire and not t.hold_until:
        releasing.append(t.id)
    for acq in releasing:
        pending_hold[acq].discard(t.id)
        if not pending_hold[acq] and acq in st.held and acq in st.end:
            st.free_slots[st.held.pop(acq)].append((now, t.id))
    if t.id in st.held and not pending_hold.get(t.id):
        st.free_slots[st.held.pop(t.id)].append((now, t.id))
