"""Expand a Plan + PlanningProblem into the event simulator's task graph (one micro-batch).

Owns the translation of docs/execution_model.md into tasks with explicit dependencies; it does
not evaluate any window equation (that is `planner/evaluate.py`'s job, which this must not
reuse: the simulator is the independent check). Windows: `pre`, f0..f{L-1}, `turn`,
b{L-1}..b0, `post`.

Tasks per window, in the runtime engine's issue order (runtime/engine.py: the plan's transfers
first, then the next weight load, then compute):
- `pre`: embedding forward (compute, embed_ms); block 0's weight load (h2d, P[0]) in a step's
  first micro-batch only (`load_in_pre`): a later one's was prefetched in the previous `post`.
- `f{j}`: the plan's transfers in the window (by kind d2h, nvme_write, nvme_read, h2d; the
  saved internals' d2h after the activation d2h); load of block j+1's weights (P[j+1], j+1 <
  L); the saved internals' h2d; forward of block j (F[j], or Fg[j] when kept or at save level
  L1/L2).
- `turn`: transfers; load of block L-1's weights for its backward unless resident; head.
- `b{j}`: d2h of block j+1's gradients (G[j+1]); transfers; load of block j-1's weights (unless
  resident); when block j = e-1 ends segment (s, e): [re-embed when boundary 0 is recompute],
  then per k = s..e-2 the load of P[k] and the recompute forward F[k]; the re-forward of block
  j by its save level (`reforward_ms`): Fg[j] when the plan has no `save_levels` (the full
  re-forward), Fr[j] (the truncated one) at L0, Fr1[j] at L1 (`reforward_l1_ms`), none at L2 or
  when kept; B[j].
- saved internals (docs/execution_model.md, "Save levels"): a `d2h` fraction x of block j's
  internals moves x * S (S1[j] at L1, S2[j] at L2, `saved_bytes`) on the D2H stream after the
  window's activation d2h; an `h2d` fraction last on the H2D stream, after the window's weight
  load and a segment's recompute loads (so the H2D bytes `X` before the recompute loads stay
  the activation prefetches and the next block's weights, "In-window order"). The tier `hbm`
  moves nothing; the simulator tracks no HBM.
- `post`: drain of G[0] (+ the embedding/head gradients in the step's last micro-batch) after
  B[0]; with `prefetch_in_post` (a micro-batch that another follows in the step) no ends
  gradient, then block 0's weight load for the next one.
- host (only for the rates the problem models, > 0): beside every weight load, a `host` task
  converting those weights into staging (P[k] / host_convert_bytes_per_s, ms); beside every
  gradient drain, one accumulating it (G / host_accumulate_bytes_per_s, ms). They carry no
  dependency on their copy: the staging is chunked, so the conversion of a block runs ahead of
  (and pipelines with) its H2D and the accumulation with the landing of the drain; the window
  barrier makes the window last at least as long as the host work it issued (GPU), and on a
  CPU the shared resource adds it to the window (docs/execution_model.md, "Host work").

- window overhead (only when `window_overhead_ms` > 0): every window opens with an `overhead`
  task on the compute stream (the engine's Python and bookkeeping before it issues the
  window's work), and every other task of the window waits for it ("window overhead first"),
  so the window lasts o + its work on a GPU and adds o on a CPU.

Dependencies (reason strings appear in `compare` explanations):
- "weight load before use": a compute task waits for the load of its block's weights.
- "double-buffer reuse": a streamed weight load takes a slot of the `weights` pool (size
  `weight_buffers`; the engine's DeviceWeights ring has 3: two for double buffering, one for
  segment recompute loads), freed when every compute using those weights has ended. A resident
  block's forward load goes to its own buffer (no slot), as in the engine.
- "boundary produced before offload", "d2h staged before nvme write", "checkpoint written before
  read", "checkpoint read before h2d", "staged before h2d": a chunk waits for every source chunk
  of its boundary issued so far, as the runtime does (its NVMe write waits for the D2H event,
  its read for every write future, its H2D for every read future), not only for the bytes it
  moves: a chained transfer never pipelines with its source in one window.
- "prefetch before its consumer": the first compute that reads an offloaded boundary waits for
  all its h2d chunks.
- "internals produced before offload": an internals d2h waits for the forward that saved them;
  "internals staged before h2d": an internals h2d for every d2h of that block issued so far;
  "saved internals prefetched": block j's backward (its re-forward at L1) for every h2d.
- "gradient drain after backward": drain of G[j] waits for B[j]; B[j] takes a `grads` pool slot
  (size `grad_buffers`) freed by the drain.
- boundaries flow along the compute stream (the producing forward / recompute).
"""

from __future__ import annotations

from dataclasses import dataclass

from lazytrain.contract import TURN_WINDOW, backward_window, forward_window
from lazytrain.planner.plan import Plan
from lazytrain.planner.windows import window_names
from lazytrain.planner.problem import PlanningProblem
from lazytrain.sim.events import TaskSpec

_FRACTION_TOL = 1e-6
"""Tolerance when matching cumulative byte ranges of transfer chunks (fraction of A[i])."""

_SOURCE_KIND = {"nvme_write": "d2h", "nvme_read": "nvme_write"}
_SOURCE_REASON = {"nvme_write": "d2h staged before nvme write",
                  "nvme_read": "checkpoint written before read"}


@dataclass(kw_only=True, frozen=True, slots=True)
class TaskGraph:
    """Tasks in issue order and the window names they index."""

    tasks: tuple[TaskSpec, ...]
    windows: tuple[str, ...]


class _Builder:
    """Collects tasks for one micro-batch; tracks producers of boundaries, loads and chunks."""

    def __init__(self, problem: PlanningProblem, plan: Plan, *, load_in_pre: bool = True,
                 prefetch_in_post: bool = False) -> None:
        self.p = problem
        self.plan = plan
        self.load_in_pre = load_in_pre
        self.prefetch_in_post = prefetch_in_post
        self.L = plan.num_blocks
        self.windows = ["pre", *window_names(self.L), "post"]
        self.widx = {w: k for k, w in enumerate(self.windows)}
        self.specs: list[dict] = []
        self.produced: dict[int, int] = {}       # boundary -> forward task producing it
        self.chunks: dict[tuple[int, str], list[tuple[float, float, int]]] = {}
        self.users: dict[int, list[int]] = {}    # weight-load id -> compute ids using it
        self.bwd: dict[int, int] = {}            # block -> B[j] task
        self.drain_of: dict[int, int] = {}       # block -> its gradient drain task
        self.open_loads: set[int] = set()        # loads whose slot still gains users
        self.lead: dict[str, int] = {}           # window -> its overhead task
        self.saved_by: dict[int, int] = {}       # block -> forward task saving its internals
        self.internal: dict[tuple[int, str], list[tuple[float, int]]] = {}  # (block, kind)

    def begin(self, window: str) -> None:
        """Open `window`: its overhead task first, when the problem models one."""
        if self.p.window_overhead_ms > 0:
            self.lead[window] = self.add(f"overhead {window}", "compute", window,
                                         self.p.window_overhead_ms, kind="overhead")

    def add(self, name: str, stream: str, window: str, work: float, *,
            deps: list[tuple[int | None, str]] = (), kind: str = "", block: int | None = None,
            boundary: int | None = None, acquire: str | None = None) -> int:
        tid = len(self.specs)
        deps = list(deps) + [(self.lead.get(window), "window overhead first")]
        self.specs.append(dict(id=tid, name=name, stream=stream, window=self.widx[window],
                               work=float(work), deps=tuple((d, r) for d, r in deps
                                                            if d is not None),
                               kind=kind, block=block, boundary=boundary, acquire=acquire))
        return tid

    def load(self, block: int, window: str, why: str, *, resident: bool = False) -> int:
        """Weight load of `block` (h2d, `load_bytes[block]`; host conversion of
        `convert_bytes[block]` on the host_convert path only) into a `weights` pool slot (a
        resident block's forward load goes to its own buffer instead: no slot)."""
        tid = self.add(f"W{block} {why}", "h2d", window, self.p.load_bytes[block],
                       kind="weights", block=block, acquire=None if resident else "weights")
        if self.p.host_convert_bytes_per_s > 0 and self.p.convert_bytes[block] > 0:
            self.add(f"convert W{block} {why}", "host", window,
                     self.p.convert_bytes[block] / self.p.host_convert_bytes_per_s * 1e3,
                     kind="convert", block=block)
        self.users[tid] = []
        self.open_loads.add(tid)
        return tid

    def accumulate(self, name: str, window: str, nbytes: float, block: int) -> None:
        """The host's accumulation of a drained gradient of `nbytes` (when modelled)."""
        if self.p.host_accumulate_bytes_per_s > 0:
            self.add(f"accumulate {name}", "host", window,
                     nbytes / self.p.host_accumulate_bytes_per_s * 1e3, kind="accumulate",
                     block=block)

    def compute(self, name: str, window: str, ms: float, *, load: int | None,
                deps: list[tuple[int | None, str]], kind: str, block: int | None,
                acquire: str | None = None) -> int:
        all_deps = list(deps) + ([(load, "weight load before use")] if load is not None else [])
        tid = self.add(name, "compute", window, ms, deps=all_deps, kind=kind, block=block,
                       acquire=acquire)
        if load in self.open_loads:
            self.users[load].append(tid)
        return tid

    def transfers(self, window: str) -> None:
        """The plan's activation chunks issued in `window`, by kind, each with its sources."""
        for kind in ("d2h", "nvme_write", "nvme_read", "h2d"):
            for t in self.plan.transfers_in(window):
                if t.kind == kind:
                    self.chunk(t.boundary, kind, window, t.fraction)
        self.internal_transfers(window, "d2h")

    def reforward_ms(self, j: int) -> float:
        """The re-forward of block j in b{j} (not kept), ms: Fg[j] (full) when the plan has no
        `save_levels`; else Fr[j] at L0, Fr1[j] at L1, 0 at L2."""
        if self.plan.reforwards_in_full:
            return self.p.fwd_grad_ms[j]
        level = self.plan.level_of(j)
        if level == "L0":
            return self.p.reforward[j]
        return self.p.reforward_l1_ms[j] if level == "L1" else 0.0

    def internal_transfers(self, window: str, kind: str) -> None:
        """The saved internals' `kind` fractions the plan issues in `window`, by block."""
        mine = [t for t in self.plan.internal_transfers_in(window) if t.kind == kind]
        for t in sorted(mine, key=lambda t: t.block):
            self.internal_chunk(t.block, kind, window, t.fraction)

    def internal_chunk(self, j: int, kind: str, window: str, fraction: float) -> int:
        """One fraction of block j's saved internals on `kind`'s stream (x * S bytes)."""
        s1, s2 = self.p.saved_bytes[j]
        nbytes = fraction * (s1 if self.plan.level_of(j) == "L1" else s2)
        done = self.internal.setdefault((j, kind), [])
        hi = (done[-1][0] if done else 0.0) + fraction
        if kind == "d2h":
            deps = [(self.saved_by.get(j), "internals produced before offload")]
        else:
            have = self.internal.get((j, "d2h"), [])
            if not have or have[-1][0] < hi - _FRACTION_TOL:
                raise ValueError(f"block {j}: internals h2d in window {window} moves bytes up to "
                                 f"{hi:.3f} of its saved internals before their d2h has covered"
                                 f" them; the plan breaks precedence (run Plan.validate())")
            deps = [(tid, "internals staged before h2d") for _hi, tid in have]
        tid = self.add(f"S{j} {kind} {fraction:.2f}", kind, window, nbytes, deps=deps,
                       kind=f"saved_{kind}", block=j)
        done.append((hi, tid))
        return tid

    def chunk(self, i: int, kind: str, window: str, fraction: float) -> int:
        done = self.chunks.setdefault((i, kind), [])
        lo = done[-1][1] if done else 0.0
        hi = lo + fraction
        if kind == "d2h":
            deps = [(self.produced.get(i), "boundary produced before offload")]
        else:
            src = _SOURCE_KIND.get(kind) or ("d2h" if self.plan.tiers[i] == "dram" else "nvme_read")
            why = _SOURCE_REASON.get(kind) or ("staged before h2d" if src == "d2h"
                                               else "checkpoint read before h2d")
            have = self.chunks.get((i, src), [])
            if not have or have[-1][1] < hi - _FRACTION_TOL:
                raise ValueError(f"boundary {i}: {kind} in window {window} moves bytes up to "
                                 f"{hi:.3f} of A[{i}] before {src} has covered them; the plan "
                                 f"breaks cumulative precedence (run Plan.validate())")
            deps = [(tid, why) for _a, _b, tid in have]  # the whole source issued so far
        tid = self.add(f"A{i} {kind} {fraction:.2f}", kind, window,
                       fraction * self.p.boundary_bytes[i], deps=deps, kind=kind, boundary=i)
        done.append((lo, hi, tid))
        return tid

    def boundary_ready(self, i: int) -> list[tuple[int | None, str]]:
        """Dependencies for reading boundary i in backward (hbm: producer; offloaded: h2d)."""
        if self.plan.tiers[i] in ("dram", "nvme"):
            return [(tid, "prefetch before its consumer")
                    for _a, _b, tid in self.chunks.get((i, "h2d"), [])]
        return [(self.produced.get(i), "boundary kept in hbm")]

    def freeze(self) -> TaskGraph:
        tasks = []
        for s in self.specs:
            hold = tuple(self.users.get(s["id"], ())) if s["acquire"] == "weights" else ()
            if s["kind"] == "bwd":
                hold = (self.drain_of[s["block"]],)
            tasks.append(TaskSpec(hold_until=hold, **s))
        return TaskGraph(tasks=tuple(tasks), windows=tuple(self.windows))


def build_tasks(problem: PlanningProblem, plan: Plan, *, load_in_pre: bool = True,
                prefetch_in_post: bool = False) -> TaskGraph:
    """The task graph of one micro-batch of `plan` on `problem` (see the module docstring):
    `load_in_pre` for a step's first micro-batch (block 0 loads in `pre`), `prefetch_in_post`
    for one that another follows (block 0 loads for it in `post`).

    Raises:
        ValueError: the plan and the problem have different block counts, a transfer moves
            bytes its source has not yet covered (names boundary or block and window), or the
            plan has save levels the problem has no costs for.
    """
    if plan.num_blocks != problem.num_blocks:
        raise ValueError(f"plan has {plan.num_blocks} blocks but the problem has "
                         f"{problem.num_blocks}; re-plan for this model")
    levels = set(plan.save_levels) - {"L0"}
    if levels and not (problem.saved_bytes and problem.reforward_l1_ms):
        raise ValueError(f"plan has save levels {sorted(levels)} but the problem has no "
                         f"saved_bytes / reforward_l1_ms; build the problem with "
                         f"planner.save_levels on, or re-plan without levels")
    b = _Builder(problem, plan, load_in_pre=load_in_pre, prefetch_in_post=prefetch_in_post)
    fwd_load = _forward(b)
    bwd_load = _turn(b, fwd_load)
    _backward(b, fwd_load, bwd_load)
    return b.freeze()


def _forward(b: _Builder) -> dict[int, int]:
    """pre and f0..f{L-1}; returns block -> its forward weight-load task."""
    p, L = b.p, b.L
    keep, resident = set(b.plan.keep_internals), set(b.plan.resident_weights)
    b.begin("pre")
    b.produced[0] = b.add("embed", "compute", "pre", p.embed_ms, kind="embed")
    # a later micro-batch's block 0 arrived in the previous post: nothing to wait for
    loads = {0: b.load(0, "pre", "fwd", resident=0 in resident) if b.load_in_pre else None}
    for j in range(L):
        w = forward_window(j)
        b.begin(w)
        kept = j in keep
        b.transfers(w)
        if j + 1 < L:
            loads[j + 1] = b.load(j + 1, w, "fwd", resident=j + 1 in resident)
        b.internal_transfers(w, "h2d")
        grad = kept or b.plan.level_of(j) != "L0"  # autograd: its graph or internals are kept
        b.produced[j + 1] = b.saved_by[j] = b.compute(
            f"{'Fg' if grad else 'F'}{j}", w, p.fwd_grad_ms[j] if grad else p.fwd_ms[j],
            load=loads[j], deps=[(b.produced[j], "boundary produced")],
            kind="fwd_grad" if grad else "fwd", block=j)
        b.open_loads.discard(loads[j])  # the forward is the last user of a streamed slot
    return loads


def _turn(b: _Builder, fwd_load: dict[int, int]) -> dict[int, int]:
    """The turn window; returns block -> the weight load its backward uses."""
    p, L, resident = b.p, b.L, set(b.plan.resident_weights)
    b.begin(TURN_WINDOW)
    b.transfers(TURN_WINDOW)
    loads = {L - 1: fwd_load[L - 1] if L - 1 in resident else b.load(L - 1, TURN_WINDOW, "bwd")}
    b.internal_transfers(TURN_WINDOW, "h2d")
    b.compute("head", TURN_WINDOW, p.turn_head_ms, load=None,
              deps=[(b.produced[L], "boundary produced")], kind="head", block=None)
    return loads


def _backward(b: _Builder, fwd_load: dict[int, int], loads: dict[int, int]) -> None:
    """b{L-1}..b0 and post (see the module docstring for the order)."""
    p, L, plan = b.p, b.L, b.plan
    keep, resident = set(plan.keep_internals), set(plan.resident_weights)
    ends = {e - 1: (s, e) for s, e in plan.segments()}
    cache: dict[int, int] = {}   # boundary -> recompute task producing it (this segment)
    for j in range(L - 1, -1, -1):
        w = backward_window(j)
        b.begin(w)
        if j + 1 <= L - 1:
            b.drain_of[j + 1] = b.add(f"G{j + 1} drain", "d2h", w, p.drain_bytes[j + 1],
                                      deps=[(b.bwd[j + 1], "gradient drain after backward")],
                                      kind="grad", block=j + 1)
            b.accumulate(f"G{j + 1}", w, p.block_accumulate_bytes(p.grad_bytes[j + 1]), j + 1)
        b.transfers(w)
        if j >= 1:
            loads[j - 1] = fwd_load[j - 1] if j - 1 in resident else b.load(j - 1, w, "bwd")
        if j in ends:
            s, e = ends[j]
            cache = _recompute(b, s, e, w)
        b.internal_transfers(w, "h2d")  # last on the H2D stream: no recompute waits for them
        grad_dep = (b.bwd.get(j + 1), "gradient flows from the later block")
        if j in keep:
            _bwd(b, j, w, loads[j], deps=[grad_dep])
            continue
        inp = cache.get(j)
        in_deps = [(inp, "recomputed boundary")] if inp is not None else b.boundary_ready(j)
        in_deps += [(tid, "saved internals prefetched")
                    for _hi, tid in b.internal.get((j, "h2d"), ())]
        if b.plan.level_of(j) == "L2":  # no re-forward: the backward reads the saved internals
            _bwd(b, j, w, loads[j], deps=in_deps + [grad_dep])
            continue
        fg = b.compute(f"Fg{j}", w, b.reforward_ms(j), load=loads[j], deps=in_deps,
                       kind="fwd_grad", block=j)
        _bwd(b, j, w, loads[j], deps=[(fg, "re-forward before backward"), grad_dep])
    b.begin("post")
    ends = 0 if b.prefetch_in_post else p.ends_grad_bytes  # drained in the step's last post
    b.drain_of[0] = b.add("G0+ends drain", "d2h", "post", p.drain_bytes[0] + ends,
                          deps=[(b.bwd[0], "gradient drain after backward")], kind="grad",
                          block=0)
    b.accumulate("G0+ends", "post", p.block_accumulate_bytes(p.grad_bytes[0]) + ends, 0)
    if b.prefetch_in_post:  # no user in this micro-batch: its slot frees at its own end
        b.load(0, "post", "next", resident=0 in resident)


def _bwd(b: _Builder, j: int, w: str, load: int, *, deps: list) -> None:
    b.bwd[j] = b.compute(f"B{j}", w, b.p.bwd_ms[j], load=load, deps=deps, kind="bwd", block=j,
                         acquire="grads")


def _recompute(b: _Builder, s: int, e: int, w: str) -> dict[int, int]:
    """Re-embed (if needed) and re-forward blocks s..e-2 in window `w`; boundary -> task."""
    p, plan = b.p, b.plan
    cache: dict[int, int] = {}
    if s == 0 and plan.tiers[0] == "recompute":
        cache[0] = b.add("re-embed", "compute", w, p.embed_ms, kind="embed")
    prev = [(cache[s], "recomputed boundary")] if s in cache else b.boundary_ready(s)
    for k in range(s, e - 1):
        ld = b.load(k, w, "recompute")
        cache[k + 1] = b.compute(f"R{k}", w, p.fwd_ms[k], load=ld, deps=prev,
                                 kind="recompute", block=k)
        prev = [(cache[k + 1], "recomputed boundary")]
    return cache
