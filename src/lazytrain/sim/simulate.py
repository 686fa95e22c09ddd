"""Event simulation of a Plan and its comparison with the fluid window evaluator.

Owns `simulate(problem, plan) -> SimResult` (step time, per-window start/end, exposed time per
window and per channel, the task timeline for a Gantt chart) and `disagreements(problem, plan)` (the
list of disagreements with `lazytrain.planner.evaluate.evaluate`, each with the dependency that
caused it). The task graph comes from `sim/tasks.py`, the mechanics from `sim/events.py`; no
window equation of the evaluator is reused, so agreement is evidence, not tautology.

Exposed time of a window (ms): `time - compute`, split into the compute stream's stall (it
waited on a copy or a buffer inside the window: `compute_end - start - compute`) and, per copy
channel, how far that channel ran past the compute stream's end (`exposed_by_channel`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lazytrain.contract import DEVICE_GRAD_BUFFERS, DEVICE_WEIGHT_SLOTS
from lazytrain.planner.evaluate import evaluate
from lazytrain.planner.plan import Plan
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.weight_paths import with_weight_paths
from lazytrain.sim.events import STREAMS, run
from lazytrain.sim.tasks import build_tasks

COPY_STREAMS = STREAMS[1:]
"""h2d, d2h, nvme_read, nvme_write and host: every stream that may run past the compute."""


@dataclass(kw_only=True, frozen=True, slots=True)
class SimOptions:
    """What the simulated engine looks like beyond the Plan.

    The defaults follow the runtime engine: a ring of four weight buffers
    (`lazytrain.contract.DEVICE_WEIGHT_SLOTS`: two for double buffering, two so segment
    recompute loads ping-pong; planner/build.py counts all four in `fixed_hbm_bytes`), two
    device gradient buffers (`DEVICE_GRAD_BUFFERS`), and window barriers
    (docs/execution_model.md).
    """

    weight_buffers: int = DEVICE_WEIGHT_SLOTS
    """Device weight buffers a streamed load may use (>= 3: the next window's load and one
    recompute load must fit beside the buffer of the block being computed; 4 lets recompute
    loads ping-pong so that only the first is exposed)."""
    grad_buffers: int = DEVICE_GRAD_BUFFERS
    """Device gradient buffers (B[j] needs a free one; the drain frees it) (>= 1)."""
    barriers: bool = True
    """Window barriers (the engine's semantics); False shows what a barrier-free engine gets."""

    def __post_init__(self) -> None:
        if self.weight_buffers < 3:
            raise ValueError(f"weight_buffers must be >= 3 (block in use, next block, one "
                             f"recompute load); got {self.weight_buffers}")
        if self.grad_buffers < 1:
            raise ValueError(f"grad_buffers must be >= 1; got {self.grad_buffers}")


@dataclass(kw_only=True, frozen=True, slots=True)
class SimEvent:
    """One simulated task: what ran where and when (ms from the micro-batch start)."""

    name: str
    stream: str
    window: str
    start_ms: float
    end_ms: float
    kind: str
    work: float
    """ms (compute) or bytes (copies)."""
    block: int | None = None
    boundary: int | None = None
    reason: str = ""
    """Why it started when it did (see `sim.events.TaskRun.reason`)."""
    waited_on: str | None = None
    """Name of the task whose end released it (None: barrier or ready at once)."""
    duplex_delay_ms: float = 0.0


@dataclass(kw_only=True, frozen=True, slots=True)
class SimWindow:
    """Simulated timing of one window (ms)."""

    name: str
    start_ms: float
    end_ms: float
    compute_ms: float
    """Busy time of the compute stream in the window."""
    stall_ms: float
    """Time the compute stream waited inside the window (copies, buffers)."""
    exposed_by_channel: dict = field(default_factory=dict)
    """{stream: ms that channel ran past the end of the window's compute}."""

    @property
    def time_ms(self) -> float:
        """Window duration, ms."""
        return self.end_ms - self.start_ms

    @property
    def exposed_ms(self) -> float:
        """time - compute, ms."""
        return self.time_ms - self.compute_ms


@dataclass(kw_only=True, frozen=True, slots=True)
class SimResult:
    """Event-simulated step of a plan: each micro-batch's timeline (the first, which loads block
    0 in `pre`; the later ones, whose block 0 the previous `post` prefetched), summed."""

    step_ms: float
    """grad_accum * micro_step_ms + const_ms + q8_tail_ms."""
    micro_step_ms: float
    """The mean micro-batch: the sum over the step's micro-batches of the end of `post`
    (pre + windows + post) / grad_accum."""
    windows: tuple[SimWindow, ...]
    """The first micro-batch's pre, f0..f{L-1}, turn, b{L-1}..b0, post."""
    events: tuple[SimEvent, ...]
    copies_overlap_compute: bool = True
    q8_tail_ms: float = 0.0
    """What the plan's 8-bit optimizer updates add to the optimizer tail, once per step, ms:
    each block in `q8_blocks` updates `q8_update_ms_per_gparam` per 1e9 of its parameters
    longer on the one optimizer worker, which the next step's forward waits for block by block
    (docs/execution_model.md, "Host work")."""

    def window(self, name: str) -> SimWindow:
        """The window named `name`.

        Raises:
            KeyError: no such window.
        """
        for w in self.windows:
            if w.name == name:
                return w
        raise KeyError(f"simulation has no window {name!r}")

    def critical_path(self, name: str) -> list[SimEvent]:
        """Events of window `name` on the chain that ended it, in time order."""
        evs = [e for e in self.events if e.window == name]
        if not evs:
            return []
        by_name = {e.name: e for e in evs}
        cur = max(evs, key=lambda e: (e.end_ms, -COPY_STREAMS.count(e.stream)))
        path = [cur]
        while cur.waited_on in by_name and by_name[cur.waited_on] not in path:
            cur = by_name[cur.waited_on]
            path.append(cur)
        return path[::-1]

    def explain(self, name: str) -> str:
        """Which dependencies and sharing shaped window `name` (one line)."""
        return _explain(self, name)


def simulate(problem: PlanningProblem, plan: Plan, *,
             options: SimOptions | None = None) -> SimResult:
    """Event-simulate `plan` on `problem` (see `sim/tasks.py` for the task graph).

    Args:
        problem: costs and bandwidths (ms, bytes, bytes/s); `copies_overlap_compute` picks the
            GPU (concurrent streams, duplex sharing) or CPU (one shared resource) model.
        plan: the plan; its transfers give the activation chunks.
        options: engine details beyond the plan (buffers, barriers).

    Returns:
        SimResult (ms).

    Raises:
        ValueError: the plan does not fit the problem or breaks transfer precedence.
    """
    opts = options or SimOptions()
    problem = with_weight_paths(problem, plan.weight_paths)  # the plan's paths and their bytes
    ga = problem.grad_accum
    # block 0 loads in pre of the first micro-batch and in post of each one another follows
    # (docs/execution_model.md, "Step time"): first, middle (ga - 2 of them) and last differ
    events, windows, micro = _micro_batch(problem, plan, opts, load_in_pre=True,
                                          prefetch_in_post=ga > 1)
    total = micro
    if ga > 1:
        total += _micro_batch(problem, plan, opts, load_in_pre=False, prefetch_in_post=False)[2]
    if ga > 2:
        total += (ga - 2) * _micro_batch(problem, plan, opts, load_in_pre=False,
                                         prefetch_in_post=True)[2]
    tail = math.fsum(problem.params_per_block[j] * problem.q8_update_ms_per_gparam / 1e9
                     for j in plan.q8_blocks)
    return SimResult(step_ms=total + problem.const_ms + tail,
                     micro_step_ms=total / ga, windows=windows, events=events,
                     copies_overlap_compute=problem.copies_overlap_compute, q8_tail_ms=tail)


def _micro_batch(problem: PlanningProblem, plan: Plan, opts: SimOptions, *, load_in_pre: bool,
                 prefetch_in_post: bool
                 ) -> tuple[tuple[SimEvent, ...], tuple[SimWindow, ...], float]:
    """One micro-batch's events, windows and end of `post` (ms), from its own task graph."""
    graph = build_tasks(problem, plan, load_in_pre=load_in_pre,
                        prefetch_in_post=prefetch_in_post)
    per_ms = 1e-3  # bytes/s -> bytes/ms
    rates = {"compute": 1.0, "host": 1.0, "h2d": problem.h2d_bytes_per_s * per_ms,
             "d2h": problem.d2h_bytes_per_s * per_ms,
             "nvme_read": problem.nvme_read_bytes_per_s * per_ms,
             "nvme_write": problem.nvme_write_bytes_per_s * per_ms}
    # a cap below one direction's own rate counts as that rate (docs/execution_model.md,
    # "Duplex sharing"): running both never makes the pair slower than the faster copy alone
    cap = max(problem.duplex_bytes_per_s, problem.h2d_bytes_per_s, problem.d2h_bytes_per_s)
    runs = run(list(graph.tasks), num_windows=len(graph.windows), rates=rates,
               duplex=cap * per_ms,
               overlap=problem.copies_overlap_compute,
               pools={"weights": opts.weight_buffers, "grads": opts.grad_buffers},
               barriers=opts.barriers)
    names = {t.id: t.name for t in graph.tasks}
    events = tuple(SimEvent(name=t.name, stream=t.stream, window=graph.windows[t.window],
                            start_ms=runs[t.id].start_ms, end_ms=runs[t.id].end_ms, kind=t.kind,
                            work=t.work, block=t.block, boundary=t.boundary,
                            reason=runs[t.id].reason,
                            waited_on=names.get(runs[t.id].waited_on),
                            duplex_delay_ms=runs[t.id].duplex_delay_ms)
                   for t in graph.tasks)
    windows = _windows(graph.windows, events, barriers=opts.barriers)
    return events, windows, max((w.end_ms for w in windows), default=0.0)


def _windows(names: tuple[str, ...], events: tuple[SimEvent, ...], *,
             barriers: bool) -> tuple[SimWindow, ...]:
    """Per-window start/end, compute busy time, stall and per-channel exposure."""
    out = []
    prev_end = 0.0
    for name in names:
        evs = [e for e in events if e.window == name]
        start = prev_end if barriers or not evs else min(e.start_ms for e in evs)
        end = max([start] + [e.end_ms for e in evs])
        comp = [e for e in evs if e.stream == "compute"]
        comp_ms = sum(e.end_ms - e.start_ms for e in comp)
        comp_end = max([start] + [e.end_ms for e in comp])
        exposed = {}
        for s in COPY_STREAMS:
            last = max((e.end_ms for e in evs if e.stream == s), default=None)
            if last is not None:
                exposed[s] = max(0.0, last - comp_end)
        out.append(SimWindow(name=name, start_ms=start, end_ms=end, compute_ms=comp_ms,
                             stall_ms=max(0.0, comp_end - start - comp_ms),
                             exposed_by_channel=exposed))
        prev_end = end
    return tuple(out)


def _explain(result: SimResult, name: str) -> str:
    """Name the cross-stream waits, buffer waits, queueing and duplex sharing of a window."""
    path = result.critical_path(name)
    if not path:
        return "empty window"
    items = []
    for e in path:
        if e.waited_on is None or e.reason in ("ready", "window barrier"):
            continue
        pred = next((p for p in path if p.name == e.waited_on), None)
        if pred is None:
            continue  # released by a task of an earlier window
        if e.reason == "stream order":
            if e.stream != "compute":
                items.append(f"{e.name} queued behind {e.waited_on} on {e.stream}")
        elif e.reason.startswith("buffer"):
            items.append(f"{e.name} waited for a free {e.reason[7:]} buffer until "
                         f"{e.waited_on} ended (double-buffer reuse)")
        elif e.reason == "shared resource":
            items.append(f"{e.name} waited for the shared CPU ({e.waited_on})")
        elif pred.stream != e.stream:
            items.append(f"{e.name} waited for {e.waited_on} ({e.reason})")
    shared = [e for e in result.events if e.window == name and e.duplex_delay_ms > 1e-9]
    if shared:
        worst = max(shared, key=lambda e: e.duplex_delay_ms)
        items.append(f"h2d and d2h shared the duplex cap (fair split, +{worst.duplex_delay_ms:.3f}"
                     f" ms on {worst.name})")
    last = path[-1]
    items.append(f"ends with {last.name} on {last.stream}")
    return "; ".join(items)


def disagreements(problem: PlanningProblem, plan: Plan, *, options: SimOptions | None = None,
            rel_tol: float = 0.01, abs_tol_ms: float = 0.01) -> list[str]:
    """Disagreements between the event simulator and the fluid evaluator (empty: they agree).

    A window (or the step) disagrees when `|sim - eval| > max(rel_tol * |eval|, abs_tol_ms)`.
    Each message names the window, both times, the difference and the simulator's explanation
    (the dependency, buffer wait or duplex sharing on the window's critical path).

    Args:
        problem, plan: as for `simulate`.
        options: simulator options.
        rel_tol: relative tolerance (0.01 = 1%).
        abs_tol_ms: absolute tolerance, ms.

    Returns:
        Messages like "b5: simulator 3.400 ms vs evaluator 3.000 ms (+0.400 ms, +13.3%): R4
        waited for W4 recompute (weight load before use); ends with B5 on compute"; the step
        total comes last when it disagrees.
    """
    ev = evaluate(problem, plan)
    sim = simulate(problem, plan, options=options)
    out = []

    def differs(a: float, b: float) -> bool:
        return abs(a - b) > max(rel_tol * abs(b), abs_tol_ms)

    for rec in ev.windows:
        sw = sim.window(rec.name)
        if differs(sw.time_ms, rec.time_ms):
            out.append(f"{rec.name}: {_versus(sw.time_ms, rec.time_ms)}: "
                       f"{sim.explain(rec.name)}")
    if differs(sim.step_ms, ev.step_ms):
        why = [f"{len(out)} window(s) differ"] if out else []
        for edge in ("pre", "post"):
            w = sim.window(edge)
            why.append(f"{edge} {w.time_ms:.3f} ms ({sim.explain(edge)})")
        out.append(f"step: {_versus(sim.step_ms, ev.step_ms)}: {'; '.join(why)}")
    return out


def _versus(sim_ms: float, ev_ms: float) -> str:
    d = sim_ms - ev_ms
    pct = f", {100.0 * d / ev_ms:+.1f}%" if ev_ms else ""
    return f"simulator {sim_ms:.3f} ms vs evaluator {ev_ms:.3f} ms ({d:+.3f} ms{pct})"
