"""The heuristic's search: candidate plans evaluated in full or incrementally, and its phases.

`Search` scores a candidate (tiers, keep-internals, 8-bit blocks, resident weights) by the
step time of the fluid model (`evaluate`) and its capacity shortfall: `build` runs the real
transfer scheduler (`schedule.schedule_loads`, the same numbers as `evaluate`), `delta` rescores
a neighbour by recomputing only the windows and holding intervals a move touches. The phases
`heuristics.heuristic_plan` composes: lifetime-ordered tiers (`lifetime`), greedy keep and
resident weights (`keep_suffix`, `resident_fill`), 8-bit trims (`q8_top_up`, `q8_trim`), a
greedy repair (best ratio of shortfall removed to step time added) and a first-improvement
local search (tier moves, +-1 shifts, (un)materialize, keep and resident toggles on every
block). Deterministic: no randomness; a deadline (wall clock or step count) truncates repair
and local search.

Knows no solver and no torch.
"""

from __future__ import annotations

import dataclasses
import time

from lazytrain.planner.chains import recompute_terms
from lazytrain.planner.evaluate import holding_intervals
from lazytrain.planner.window_time import host_ms
from lazytrain.planner.windows import check_tiers, horizons_of, segment_ends, segments_of
from lazytrain.planner.plan import Transfer
from lazytrain.planner.windows import OFFLOAD_TIERS, TIERS, window_name
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.schedule import Loads, schedule_loads, schedule_offload, schedule_prefetch
from lazytrain.planner.staging import bounce_bound_by_window

MAX_SWEEPS = 12
"""Local-search passes over the neighbourhood (deterministic cap)."""
_IMPROVE_MS = 1e-6
"""A move must shorten the step by more than this (ms) to be accepted."""


def _ladder(c: int) -> list[int]:
    """c, c - 1 and 3c/4, largest first: the largest count may leave boundaries no HBM."""
    return sorted({x for x in (c, c - 1, 3 * c // 4) if x >= 0}, reverse=True)


def _materialize(tiers, blocks) -> tuple[str, ...]:
    """`tiers` with each block's output boundary materialized ("dram"; `lifetime` places it)."""
    after = {j + 1 for j in blocks}
    return tuple("dram" if t == "recompute" and i in after else t for i, t in enumerate(tiers))


@dataclasses.dataclass
class State:
    """A fully evaluated candidate: decisions (tiers, keep, q8, res: resident weights, every
    kept block and maybe others), its schedule {boundary: {kind: {ord: fraction}}}, window
    loads, window times (ms), HBM held per window (bytes), DRAM and NVMe bytes, and the score
    (capacity shortfall in bytes, step time in ms; compared in that order)."""

    tiers: tuple[str, ...]
    keep: tuple[int, ...]
    q8: tuple[int, ...]
    res: tuple[int, ...]
    ends: list[int]
    sched: dict
    loads: Loads
    times: list[float]
    hbm: list[float]
    dram: float
    nvme: float
    score: tuple[float, float]

    def transfers(self) -> tuple[Transfer, ...]:
        """The schedule as Plan transfers, in boundary, kind and window order."""
        L = len(self.tiers) - 1
        return tuple(Transfer(boundary=i, kind=k, window=window_name(o, L), fraction=x)
                     for i in sorted(self.sched) for k in sorted(self.sched[i])
                     for o, x in sorted(self.sched[i][k].items()))


class Search:
    """Evaluates candidates in full (`build`) or incrementally (`delta`) for one problem.

    Args:
        problem: the planning problem.
        deadline: repair and local search stop once `clock()` passes it (s on the wall clock,
            or a step count when `clock` counts steps).
        clock: read before each repair round and local-search move (default: seconds).
    """

    def __init__(self, problem: PlanningProblem, *, deadline: float,
                 clock=time.perf_counter) -> None:
        self.clock = clock  # read before each step; stop once past `deadline` (s, or steps)
        p = self.p = problem
        self.L = problem.num_blocks
        self.deadline = deadline
        self.states_base = (sum(n * p.host_bytes_per_param for n in p.params_per_block)
                            + p.ends_params * p.host_bytes_per_param + p.nvme_staging_bytes
                            - p.nvme_bounce_bytes)  # bounce buffers: per plan, in `_dram`
        self._bounce: dict[tuple, int] = {}

    # --- scoring -----------------------------------------------------------------------------

    def _score(self, times, hbm, dram, nvme, q8) -> tuple[float, float]:
        p = self.p
        short = (max(0.0, max(hbm) - p.hbm_bytes) + max(0.0, dram - p.dram_bytes)
                 + max(0.0, nvme - p.nvme_bytes))
        # per step: the 8-bit updates' time on the optimizer tail (window_time.q8_update_ms) and the
        # penalty, over the grad_accum micro-batches whose window times `times` holds one of
        q8_ms = sum(p.params_per_block[j] for j in q8) / 1e9 * (
            p.q8_update_ms_per_gparam + p.q8_penalty_ms_per_gparam) / p.grad_accum
        return (short, sum(times) + q8_ms)

    def _dram(self, tiers, q8) -> float:
        p = self.p
        return (self.states_base + sum(p.boundary_bytes[i] for i, t in enumerate(tiers)
                                       if t == "dram")
                + self._bounce_peak(tiers)
                - sum(p.params_per_block[j] for j in q8)
                * (p.host_bytes_per_param - p.host_bytes_per_param_q8))

    def _bounce_peak(self, tiers) -> int:
        """Peak NVMe bounce bytes of `tiers` (`staging.bounce_bound_by_window`), cached by its
        NVMe boundaries and their segment ends, all it depends on (most moves keep them)."""
        ends = segment_ends(tiers)
        key = tuple((i, ends[i]) for i, t in enumerate(tiers[:-1]) if t == "nvme")
        if key not in self._bounce:
            self._bounce[key] = max(bounce_bound_by_window(self.p.boundary_bytes, tiers, self.L,
                                                           horizons_of(self.p)))
        return self._bounce[key]

    def _intervals(self, i, tier, end, sched_i):
        d, h = sched_i.get("d2h"), sched_i.get("h2d")
        return holding_intervals(i, tier, end, self.L, last_d2h=max(d) if d else None,
                                 first_h2d=min(h) if h else None)

    def build(self, tiers, keep, q8=(), res=()) -> State:
        """Full evaluation with the real scheduler (the same numbers as `evaluate`); the
        resident weights are `res` and every kept block."""
        p, L = self.p, self.L
        tiers, res = check_tiers(p, tiers), tuple(sorted(set(keep) | set(res)))
        sched, loads = schedule_loads(p, tiers, keep, res)
        times = [loads.time_ms(o) for o in range(2 * L + 1)]
        ends = segment_ends(tiers) + [L]
        hbm = [float(p.fixed_hbm_bytes)] * (2 * L + 1)
        for i, t in enumerate(tiers):
            for lo, hi in self._intervals(i, t, ends[i], sched.get(i, {})):
                for o in range(lo, hi + 1):
                    hbm[o] += p.boundary_bytes[i]
        for j in res:
            for o in range(j, 2 * L - j + 1):
                hbm[o] += p.weight_bytes[j] + (p.internal_bytes[j] if j in keep else 0)
        dram = self._dram(tiers, q8)
        nvme = float(sum(p.boundary_bytes[i] for i, t in enumerate(tiers) if t == "nvme"))
        return State(tiers=tiers, keep=tuple(sorted(keep)), q8=tuple(sorted(q8)), res=res,
                      ends=ends,
                      sched=sched, loads=loads, times=times, hbm=hbm, dram=dram, nvme=nvme,
                      score=self._score(times, hbm, dram, nvme, q8))

    def delta(self, cur: State, tiers, keep, q8, res=()) -> tuple[float, float]:
        """Score of a neighbour of `cur`, recomputing only what the move touches."""
        p, L = self.p, self.L
        A = p.boundary_bytes
        ends = segment_ends(tiers) + [L]
        changed = [i for i in range(L) if tiers[i] != cur.tiers[i] or ends[i] != cur.ends[i]]
        chan = {k: v[:] for k, v in cur.loads.chan.items()}
        loads = Loads(p, cur.loads.comp[:], chan["h2d"], chan["d2h"],
                       rec=(cur.loads.rec_ms[:], cur.loads.rec_bytes[:]),
                       host=cur.loads.host[:])
        loads.chan = chan
        touched: set[int] = set()
        res = set(keep) | set(res)
        self._shift_fixed(loads, cur, tiers, keep, res, touched)
        for i in changed:
            for kind, cell in cur.sched.get(i, {}).items():
                for o, x in cell.items():
                    chan[kind][o] -= x * A[i]
                    touched.add(o)
        new_sched = {}
        off = [i for i in changed if tiers[i] in OFFLOAD_TIERS]
        for i in off:
            new_sched[i] = schedule_offload(loads, p, i, tiers[i], ends[i])
        for i in sorted(off, key=lambda i: -ends[i]):
            new_sched[i].update(schedule_prefetch(loads, p, i, tiers[i], ends[i], new_sched[i]))
        for cells in new_sched.values():
            for cell in cells.values():
                touched.update(cell)
        times = cur.times
        dt = 0.0
        for o in touched:
            dt += loads.time_ms(o) - times[o]
        hbm = cur.hbm[:]
        for i in changed:
            for sign, t, e, sc in ((-1, cur.tiers[i], cur.ends[i], cur.sched.get(i, {})),
                                   (1, tiers[i], ends[i], new_sched.get(i, {}))):
                for lo, hi in self._intervals(i, t, e, sc):
                    for o in range(lo, hi + 1):
                        hbm[o] += sign * A[i]
        for blocks, old, size in ((keep, cur.keep, p.internal_bytes),
                                  (res, cur.res, p.weight_bytes)):
            for j in set(blocks) ^ set(old):
                for o in range(j, 2 * L - j + 1):
                    hbm[o] += size[j] if j in blocks else -size[j]
        dram = self._dram(tiers, q8)
        nvme = float(sum(A[i] for i, t in enumerate(tiers) if t == "nvme"))
        short, cost = self._score([sum(times) + dt], hbm, dram, nvme, q8)
        return short, cost

    def _shift_fixed(self, loads: Loads, cur: State, tiers, keep, res, touched: set) -> None:
        """Apply the compute/weight-traffic changes of new segments, keep and resident toggles."""
        p, L = self.p, self.L
        old, new = set(segments_of(cur.tiers)), set(segments_of(tiers))
        emb_old = cur.tiers[0] == "recompute"
        emb_new = tiers[0] == "recompute"
        for segs, sign, emb in ((old - new, -1, emb_old), (new - old, 1, emb_new)):
            for s, e in segs:
                o = 2 * L - e + 1
                loads.comp[o] += sign * (sum(p.fwd_ms[s:e - 1]) + (p.embed_ms if s == 0 and emb
                                                                   else 0.0))
                loads.chan["h2d"][o] += sign * sum(p.load_bytes[s:e - 1])
                loads.host[o] += sign * host_ms(p, sum(p.convert_bytes[s:e - 1]), 0.0)
                touched.add(o)
        if emb_old != emb_new:  # boundary 0's segment may be unchanged while its tier toggles
            e = next(e for s, e in new if s == 0)
            if (0, e) in old:
                o = 2 * L - e + 1
                loads.comp[o] += p.embed_ms if emb_new else -p.embed_ms
                touched.add(o)
        for j in set(keep) ^ set(cur.keep):
            sign = 1 if j in keep else -1
            loads.comp[j] += sign * (p.fwd_grad_ms[j] - p.fwd_ms[j])
            loads.comp[2 * L - j] -= sign * p.reforward[j]
            touched.update((j, 2 * L - j))
        for j in set(res) ^ set(cur.res):
            sign = 1 if j in res else -1
            o = L if j == L - 1 else 2 * L - j - 1  # where block j's weights would reload
            loads.chan["h2d"][o] -= sign * p.load_bytes[j]
            loads.host[o] -= sign * host_ms(p, p.convert_bytes[j], 0.0)
            touched.add(o)
        rec_ms, rec_bytes = recompute_terms(p, tiers, keep)
        for o in touched:  # segments and keep toggles move the recompute-order terms
            loads.rec_ms[o], loads.rec_bytes[o] = rec_ms[o], rec_bytes[o]

    # --- moves -------------------------------------------------------------------------------

    def _valid(self, tiers, res) -> bool:
        """Legal tiers (NVMe only with a drive, segments up to k_max), and the boundary after
        every kept or resident block materialized (inside a segment the runtime would
        re-forward it on held weights, which the evaluator prices as a reload)."""
        p = self.p
        if any(t == "nvme" for t in tiers) and p.nvme_bytes <= 0:
            return False
        if any(e - s > p.k_max for s, e in segments_of(tiers)):
            return False
        return all(tiers[j + 1] != "recompute" for j in res)

    def edits(self, *, repair: bool = False) -> list[tuple]:
        """The neighbourhood as edit descriptors, in a fixed order (see `apply`)."""
        L = self.L
        out = [("tier", i, t) for i in range(L) for t in TIERS]
        if not repair:
            out += [("shift", i, n) for i in range(1, L) for n in (i - 1, i + 1) if 0 < n < L]
        if self.p.allow_keep:
            out += [(what, j, None) for what in ("keep", "res") for j in range(L - 1, -1, -1)]
        if self.p.allow_q8 and repair:
            out.append(("q8", None, None))
        return out

    def apply(self, cur: State, edit: tuple, *, repair: bool = False):
        """(tiers, keep, q8, res) after `edit` on `cur`, or None when it is a no-op or invalid.

        In repair mode only edits that free memory are offered (a tier later in TIERS,
        dropping a keep or a resident block, adding an 8-bit block). Dropping a keep leaves
        the block's weights resident (a "res" edit drops them).
        """
        what, i, arg = edit
        tiers, keep, q8, res = cur.tiers, cur.keep, cur.q8, cur.res
        if what == "tier":
            if arg == tiers[i] or (repair and TIERS.index(arg) < TIERS.index(tiers[i])):
                return None
            tiers = tiers[:i] + (arg,) + tiers[i + 1:]
        elif what == "shift":
            if tiers[i] == "recompute" or tiers[arg] != "recompute":
                return None
            new = list(tiers)
            new[i], new[arg] = "recompute", tiers[i]
            tiers = tuple(new)
        elif what == "keep":
            if i in keep:
                keep = tuple(x for x in keep if x != i)
            elif repair or tiers[i + 1] == "recompute":
                return None
            else:
                keep, res = tuple(sorted(keep + (i,))), tuple(sorted(set(res) | {i}))
        elif what == "res":
            if i in keep or (repair and i not in res) or tiers[i + 1] == "recompute":
                return None
            res = tuple(x for x in res if x != i) if i in res else tuple(sorted(res + (i,)))
        else:
            free = [j for j in range(self.L) if j not in q8]
            if not free:
                return None
            q8 = tuple(sorted(q8 + (free[0],)))
        keep, res = ((tuple(j for j in b if tiers[j + 1] != "recompute")) for b in (keep, res))
        return (tiers, keep, q8, res) if self._valid(tiers, res) else None

    # --- phases ------------------------------------------------------------------------------

    def lifetime(self, tiers, keep=(), q8=(), res=()) -> State:
        """Lifetime-ordered tiers for the materialized boundaries of `tiers`, with `keep`, `q8`
        and `res` held fixed.

        The latest h boundaries go to hbm, with h the largest count whose plan fits HBM
        (binary search); earlier ones to dram while DRAM fits, then nvme while NVMe fits; the
        rest are un-materialized where k_max and `keep` allow, else dram (repair fixes that).
        """
        lo, hi = 0, sum(t != "recompute" for t in tiers[:-1])
        best = self.build(self._assign(tiers, 0, set(keep) | set(res), q8), keep, q8, res)
        if max(best.hbm) > self.p.hbm_bytes:
            return best
        while lo < hi:
            mid = (lo + hi + 1) // 2
            st = self.build(self._assign(tiers, mid, set(keep) | set(res), q8), keep, q8, res)
            if max(st.hbm) <= self.p.hbm_bytes:
                lo, best = mid, st
            else:
                hi = mid - 1
        return best

    def _assign(self, tiers, h: int, res, q8) -> tuple[str, ...]:
        """`lifetime`'s tiers with the latest h materialized boundaries (below L) in hbm."""
        p, L = self.p, self.L
        mats = [i for i in range(L - 1, -1, -1) if tiers[i] != "recompute"]
        dram_free = p.dram_bytes - self._dram(("recompute",) * (L + 1), q8)
        out = list(tiers)
        used_d = used_n = 0.0
        for rank, i in enumerate(mats):
            a = p.boundary_bytes[i]
            if rank < h:
                out[i] = "hbm"
            elif used_d + a <= dram_free:
                out[i], used_d = "dram", used_d + a
            elif p.nvme_bytes > 0 and used_n + a <= p.nvme_bytes:
                out[i], used_n = "nvme", used_n + a
            else:
                out[i] = "recompute"  # fits nowhere: merge its segment when k_max allows
                if not self._valid(tuple(out), res):
                    out[i] = "dram"
        return tuple(out)

    def keep_suffix(self, tiers, q8=(), res=()) -> State:
        """Greedy keep from the last block down: keep-internals on blocks L-c..L-1 (their
        output boundaries materialized), c the largest count that fits HBM with every boundary
        offloaded, then `lifetime` tiers around that keep (the best of `_ladder(c)`). A kept
        block saves its re-forward and weight reload in backward for I[j] + P[j] bytes of HBM
        (I[j] if in `res`, already resident) from f{j} to b{j}: a roomy GPU keeps most blocks,
        out of the local search's reach."""
        def with_keep(c: int):
            keep = tuple(range(self.L - c, self.L))
            return _materialize(tiers, keep), keep, q8, res

        c = self._largest_fit(self.L, with_keep)
        return min((self.lifetime(*with_keep(c)) for c in _ladder(c)), key=lambda st: st.score)

    def resident_fill(self, cur: State) -> State:
        """Greedy resident weights, as `keep_suffix` does with keep, on the blocks `cur` does
        not keep (or `cur` if no better): a resident block skips its backward reload of P[j]
        bytes for P[j] bytes of HBM, the best use of HBM on slow H2D. Blocks go in order of
        step time saved per byte, each alone on `cur` (ties: the last block first), as the
        reload only costs where it lengthens its window; as many as fit with every boundary
        offloaded (then `lifetime` tiers) or with `cur`'s tiers as they are."""
        free = [j for j in range(self.L - 1, -1, -1) if j not in cur.res]
        saved = {j: (cur.score[1] - self.delta(cur, _materialize(cur.tiers, (j,)), cur.keep,
                                               cur.q8, cur.res + (j,))[1]) / self.p.weight_bytes[j]
                 for j in free}
        free.sort(key=lambda j: -saved[j])

        def with_res(r: int):
            res = cur.res + tuple(free[:r])
            return _materialize(cur.tiers, res), cur.keep, cur.q8, res

        r = self._largest_fit(len(free), with_res)
        as_is = self._largest_fit(len(free), with_res, offloaded=False)  # `cur`'s tiers kept
        return min([cur, self.build(*with_res(as_is))]
                   + [self.lifetime(*with_res(r)) for r in _ladder(r) if r > 0],
                   key=lambda st: st.score)

    def _largest_fit(self, hi: int, args, *, offloaded: bool = True) -> int:
        """The largest c in 0..hi whose decisions `args(c)` = (tiers, keep, q8, res) fit HBM
        with every boundary offloaded (or with its tiers as they are: `offloaded=False`) (HBM
        grows with c: binary search)."""
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            tiers, keep, q8, res = args(mid)
            if offloaded:
                tiers = self._assign(tiers, 0, set(keep) | set(res), q8)
            st = self.build(tiers, keep, q8, res)
            lo, hi = (mid, hi) if max(st.hbm) <= self.p.hbm_bytes else (lo, mid - 1)
        return lo

    def q8_trim(self, cur: State) -> State:
        """`cur` with 8-bit states dropped from the last blocks first while DRAM still fits
        (each costs q8_penalty_ms_per_gparam and, at run time, a slower update)."""
        p = self.p
        room = p.dram_bytes - cur.dram
        q8 = list(cur.q8)
        for j in reversed(cur.q8):
            extra = p.params_per_block[j] * (p.host_bytes_per_param - p.host_bytes_per_param_q8)
            if extra <= room:
                q8.remove(j)
                room -= extra
        nxt = cur if q8 == list(cur.q8) else self.build(cur.tiers, cur.keep, tuple(q8), cur.res)
        return nxt if nxt.score <= cur.score else cur

    def repair(self, cur: State) -> State:
        """While a capacity is short: apply the move with the best shortfall removed per ms
        (after `q8_top_up`, which closes a DRAM shortfall with 8-bit states in one step)."""
        cur = self.q8_top_up(cur)
        for _ in range(3 * self.L + 8):
            if cur.score[0] <= 0 or self.clock() > self.deadline:
                break
            best, best_ratio = None, 0.0
            for edit in self.edits(repair=True):
                move = self.apply(cur, edit, repair=True)
                if move is None:
                    continue
                short, cost = self.delta(cur, *move)
                gain = cur.score[0] - short
                if gain > 0:
                    ratio = gain / max(cost - cur.score[1], 1e-3)
                    if best is None or ratio > best_ratio:
                        best, best_ratio = move, ratio
            if best is None:
                break
            nxt = self.build(*best)
            if nxt.score >= cur.score:
                break
            cur = nxt
        return cur

    def q8_top_up(self, cur: State) -> State:
        """8-bit states on the fewest blocks (in block order, as the q8 edit adds them) that
        close `cur`'s DRAM shortfall, in one move: at q8_penalty_ms_per_gparam per 1e9
        parameters it is the cheapest DRAM there is, but one block per greedy round takes L
        rounds of the whole neighbourhood (the repair's deadline ran out first on 64 blocks)."""
        p = self.p
        need = cur.dram - p.dram_bytes
        if not p.allow_q8 or need <= 0:
            return cur
        q8 = list(cur.q8)
        for j in range(self.L):
            if need <= 0:
                break
            if j not in q8:
                q8.append(j)
                need -= p.params_per_block[j] * (p.host_bytes_per_param
                                                 - p.host_bytes_per_param_q8)
        nxt = self.build(cur.tiers, cur.keep, tuple(sorted(q8)), cur.res)
        return nxt if nxt.score < cur.score else cur

    def local_search(self, cur: State) -> State:
        """First-improvement descent over `moves` until a full pass finds nothing."""
        edits = self.edits()
        for _ in range(MAX_SWEEPS):
            improved = False
            for edit in edits:
                if self.clock() > self.deadline:
                    return cur
                move = self.apply(cur, edit)
                if move is None:
                    continue
                est = self.delta(cur, *move)
                if est[0] > cur.score[0] or (est[0] == cur.score[0]
                                             and est[1] >= cur.score[1] - _IMPROVE_MS):
                    continue
                nxt = self.build(*move)
                if nxt.score[0] < cur.score[0] or (nxt.score[0] == cur.score[0] and
                                                   nxt.score[1] < cur.score[1] - _IMPROVE_MS):
                    cur, improved = nxt, True
            if not improved:
                break
        return cur
