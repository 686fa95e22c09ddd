"""Save levels under seeded random plans: every legal plan (random boundary tiers, keep, levels,
saved tiers, internal d2h/h2d windows and fractions) validates, round-trips through JSON with
every field, prices its HBM as the contract's holding intervals say (computed here by brute
force), agrees with the event simulator where the contract says the two agree (CPU; GPU with a
duplex cap above both links), and prices as before once its save-level fields are stripped (an
old plan: the full re-forward); each illegal change of a legal plan is refused; the greedy never
returns a plan that breaks validation or a budget it started within. Plus one hand-computed
window: the saved internals' h2d queue behind a same-window NVMe chain.

Source: docs/execution_model.md, "Save levels", "In-window order", "HBM capacity".
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.heuristics import greedy_levels
from lazytrain.planner.plan import (
    InternalTransfer, Plan, PlanValidationError, SolveRecord, Transfer,
)
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.staging import bounce_bound_by_window
from lazytrain.planner.windows import internal_legal_ords, segments_of, window_name, window_ord
from lazytrain.sim import disagreements, simulate

KB_PER_MS = 1e6  # bytes/s: 1000 bytes per ms
SEEDS = range(60)


def random_problem(rng: random.Random, L: int, *, gpu: bool, **changes) -> PlanningProblem:
    """Random costs with 0 <= Fr1 <= Fr <= Fg, F <= Fg, S1 <= S2; horizons 1..8."""
    F = [rng.uniform(0.5, 2.0) for _ in range(L)]
    Fg = [f * rng.uniform(1.0, 1.6) for f in F]
    Fr = [g * rng.uniform(0.5, 1.0) for g in Fg]
    S1 = [rng.randint(0, 2000) for _ in range(L)]
    bw = rng.choice([1e13, KB_PER_MS, 0.5 * KB_PER_MS])
    base = dict(
        fwd_ms=tuple(F), fwd_grad_ms=tuple(Fg), bwd_ms=tuple(rng.uniform(1, 3) for _ in F),
        reforward_ms=tuple(Fr), reforward_l1_ms=tuple(r * rng.random() for r in Fr),
        saved_bytes=tuple((s, s + rng.randint(0, 3000)) for s in S1),
        weight_bytes=tuple(rng.randint(500, 1500) for _ in F),
        grad_bytes=tuple(rng.randint(500, 1500) for _ in F),
        internal_bytes=tuple(rng.randint(0, 200) for _ in F),
        boundary_bytes=tuple(rng.randint(300, 1200) for _ in range(L + 1)),
        params_per_block=(10,) * L, embed_ms=0.5, head_ms=1.0, ends_grad_bytes=300,
        const_ms=0.3, window_overhead_ms=rng.choice([0.0, 0.1]), grad_accum=rng.choice([1, 2]),
        h2d_bytes_per_s=bw, d2h_bytes_per_s=bw, duplex_bytes_per_s=2 * bw,
        nvme_read_bytes_per_s=bw, nvme_write_bytes_per_s=bw,
        hbm_bytes=10**12, dram_bytes=10**12, nvme_bytes=10**12,
        drain_windows=rng.choice([1, 2, 3, 8]), prefetch_windows=rng.choice([1, 2, 3, 8]),
        nvme_lead_windows=rng.choice([0, 1, 8]), copies_overlap_compute=gpu)
    base.update(changes)
    return PlanningProblem(**base)


def _split(rng: random.Random, ords) -> list[tuple[int, float]]:
    """1-3 of `ords` with random fractions summing to 1."""
    picks = sorted(rng.sample(list(ords), rng.randint(1, min(3, len(ords)))))
    weights = [rng.uniform(0.1, 1.0) for _ in picks]
    return [(o, w / sum(weights)) for o, w in zip(picks, weights)]


def random_plan(rng: random.Random, p: PlanningProblem) -> Plan | None:
    """A legal plan: random tiers (nvme included), keep, levels, saved tiers and internal
    transfers in legal windows (every h2d after a cut that every d2h is at or before)."""
    L = p.num_blocks
    tiers = tuple(rng.choice(["hbm", "dram", "recompute"]) for _ in range(1)) + tuple(
        rng.choice(["hbm", "dram", "nvme", "recompute"]) for _ in range(L - 1)) + ("hbm",)
    if any(e - s > p.k_max for s, e in segments_of(tiers)):
        return None
    keep = tuple(j for j in range(L) if tiers[j + 1] != "recompute" and rng.random() < 0.2)
    try:
        d = decisions_from_tiers(p, tiers, keep)
    except ValueError:  # no legal boundary schedule within these horizons
        return None
    levels, saved, moves = [], [], []
    hz = dict(drain_windows=p.drain_windows, prefetch_windows=p.prefetch_windows)
    for j in range(L):
        level = "L0" if j in keep else rng.choice(["L0", "L1", "L2"])
        tier = "none" if level == "L0" else "hbm"
        d2h, h2d = internal_legal_ords("d2h", j, L, **hz), internal_legal_ords("h2d", j, L, **hz)
        cuts = [c for c in d2h if h2d and h2d[-1] > c]
        if level != "L0" and cuts and rng.random() < 0.6:
            tier, cut = "dram", rng.choice(cuts)
            for kind, ords in (("d2h", [o for o in d2h if o <= cut]),
                               ("h2d", [o for o in h2d if o > cut])):
                moves += [InternalTransfer(block=j, kind=kind, window=window_name(o, L),
                                           fraction=x) for o, x in _split(rng, ords)]
        levels.append(level)
        saved.append(tier)
    d = dataclasses.replace(d, save_levels=tuple(levels), saved_tiers=tuple(saved),
                            internal_transfers=tuple(moves))
    return build_plan(p, d, solver=SolveRecord(backend="manual"))


def cases(gpu_share: float = 0.5):
    """(seed, problem, plan) for every seed whose draw gives a legal plan."""
    for seed in SEEDS:
        rng = random.Random(seed)
        p = random_problem(rng, rng.randint(2, 6), gpu=rng.random() < gpu_share)
        plan = random_plan(rng, p)
        if plan is not None:
            yield seed, p, plan


def _ords(plan: Plan, j: int, kind: str) -> list[int]:
    return [window_ord(t.window, plan.num_blocks) for t in plan.internal_transfers
            if t.block == j and t.kind == kind]


def contract_saved_hbm(p: PlanningProblem, plan: Plan) -> list[float]:
    """Brute force over windows: hbm tier holds S in [j, 2L-j]; dram in [j, last d2h] and
    [first h2d, 2L-j]; S = S1 at L1, S2 at L2."""
    L = plan.num_blocks
    out = [0.0] * (2 * L + 1)
    for j, level in enumerate(plan.save_levels):
        if level == "L0":
            continue
        size = p.saved_bytes[j][0 if level == "L1" else 1]
        dram = plan.saved_tiers[j] == "dram"
        for o in range(j, 2 * L - j + 1):
            if not dram or o <= max(_ords(plan, j, "d2h")) or o >= min(_ords(plan, j, "h2d")):
                out[o] += size
    return out


def test_the_generator_covers_every_level_tier_and_split():
    seen = set()
    for _seed, _p, plan in cases():
        seen |= {(lv, t) for lv, t in zip(plan.save_levels, plan.saved_tiers)}
        if any(t.fraction < 1 for t in plan.internal_transfers):
            seen.add("split")
        if set(plan.tiers) >= {"nvme", "recompute"}:
            seen.add("nvme+recompute")
        if plan.keep_internals:
            seen.add("kept")
    assert seen >= {("L0", "none"), ("L1", "hbm"), ("L1", "dram"), ("L2", "hbm"),
                    ("L2", "dram"), "split", "nvme+recompute", "kept"}


def test_random_legal_plans_validate_and_round_trip_every_field():
    n = 0
    for seed, _p, plan in cases():
        again = Plan.from_dict(json.loads(plan.to_json()))
        assert again == plan, seed
        assert again.digest() == plan.digest()
        again.validate()
        n += 1
    assert n >= 30


def test_hbm_saved_bytes_and_peak_follow_the_contract_intervals():
    for seed, p, plan in cases():
        ev = evaluate(p, plan)
        want = contract_saved_hbm(p, plan)
        assert [w.hbm_saved_bytes for w in ev.windows] == pytest.approx(want), seed
        L = plan.num_blocks
        for o, w in enumerate(ev.windows):  # fixed + checkpoints + kept + resident + saved
            kept = sum(p.internal_bytes[j] for j in plan.keep_internals if j <= o <= 2 * L - j)
            res = sum(p.weight_bytes[j] for j in plan.resident_weights if j <= o <= 2 * L - j)
            assert ev.hbm_by_window[o] == pytest.approx(
                p.fixed_hbm_bytes + w.hbm_checkpoint_bytes + kept + res + want[o]), (seed, o)
        assert ev.peak_hbm_bytes == pytest.approx(max(ev.hbm_by_window))
        # DRAM: a dram block's S is page-locked from its first d2h to its last h2d window and
        # joins the bounce buffers at the window where the two peak together
        dram = [0.0] * (2 * L + 1)
        for j, tier in enumerate(plan.saved_tiers):
            if tier == "dram":
                size = p.saved_bytes[j][0 if plan.save_levels[j] == "L1" else 1]
                for o in range(min(_ords(plan, j, "d2h")), max(_ords(plan, j, "h2d")) + 1):
                    dram[o] += size
        bounce = bounce_bound_by_window(p.boundary_bytes, plan.tiers, L, plan.horizons())
        states = sum(p.params_per_block) * p.host_bytes_per_param
        tier_dram = sum(a for a, t in zip(p.boundary_bytes, plan.tiers) if t == "dram")
        assert ev.dram_bytes == pytest.approx(
            tier_dram + states + max(b + s for b, s in zip(bounce, dram))), seed


def ring_bound(p: PlanningProblem, plan: Plan) -> bool:
    """Whether a GPU plan has a segment with 3 or more recompute loads: the third waits for a
    free weight buffer (the ring of four holds block j's and block j-1's weights), which the
    contract's R[s,e] does not count, so the simulator may be later there (with or without
    levels; known gap of the recompute chain, not of save levels)."""
    return p.copies_overlap_compute and any(e - s >= 4 for s, e in plan.segments())


def test_simulator_agrees_with_evaluator_on_random_plans_with_levels():
    # CPU: every term adds up; GPU: the duplex cap (2 x link) never binds, so only the
    # in-window order and the fluid terms set a window (docs/execution_model.md)
    n = 0
    for seed, p, plan in cases(gpu_share=0.6):
        if ring_bound(p, plan):
            continue
        assert disagreements(p, plan, rel_tol=1e-6, abs_tol_ms=1e-6) == [], seed
        n += bool(plan.internal_transfers)
    assert n >= 10


def test_an_old_plan_without_the_fields_prices_with_the_full_re_forward():
    for seed, p, plan in cases():
        d = json.loads(plan.to_json())
        for key in ("save_levels", "saved_tiers", "internal_transfers"):
            d.pop(key, None)
        old = Plan.from_dict(d).validate()
        assert old.reforwards_in_full and not old.save_levels
        ev, L = evaluate(p, old), p.num_blocks
        for j in range(L):  # b{j}: B + Fg (not kept) + the segment's recompute, f{j}: F or Fg
            rec = sum(rec_ for s, e in old.segments() if e - 1 == j
                      for rec_ in [sum(p.fwd_ms[s:e - 1]) + (p.embed_ms if s == 0 and
                                   old.tiers[0] == "recompute" else 0.0)])
            kept = j in old.keep_internals
            assert ev.windows[2 * L - j].compute_ms == pytest.approx(
                p.bwd_ms[j] + (0.0 if kept else p.fwd_grad_ms[j]) + rec), (seed, j)
            assert ev.windows[j].compute_ms == pytest.approx(
                p.fwd_grad_ms[j] if kept else p.fwd_ms[j])
        assert all(w.hbm_saved_bytes == 0 for w in ev.windows)
        if not ring_bound(p, old):
            assert simulate(p, old).step_ms == pytest.approx(ev.step_ms)


def _mutations(plan: Plan, p: PlanningProblem, rng: random.Random):
    """(name, illegal plan) pairs made from a legal one."""
    L, moves = plan.num_blocks, list(plan.internal_transfers)
    hz = dict(drain_windows=p.drain_windows, prefetch_windows=p.prefetch_windows)
    if moves:
        k = rng.randrange(len(moves))
        t = moves[k]
        legal = internal_legal_ords(t.kind, t.block, L, **hz)
        for o in (legal[0] - 1, legal[-1] + 1):  # one window outside the legal range
            if 0 <= o <= 2 * L:
                yield f"off by one {t.kind}", dataclasses.replace(plan, internal_transfers=tuple(
                    moves[:k] + [dataclasses.replace(t, window=window_name(o, L))]
                    + moves[k + 1:]))
        yield "fractions not 1", dataclasses.replace(plan, internal_transfers=tuple(
            moves[:k] + [dataclasses.replace(t, fraction=t.fraction / 2)] + moves[k + 1:]))
        last_d2h = window_name(max(_ords(plan, t.block, "d2h")), L)
        yield "h2d in a d2h window", dataclasses.replace(plan, internal_transfers=tuple(
            dataclasses.replace(m, window=last_d2h) if m.block == t.block and m.kind == "h2d"
            else m for m in moves))
        yield "moves of an hbm block", dataclasses.replace(plan, saved_tiers=tuple(
            "hbm" if j == t.block else s for j, s in enumerate(plan.saved_tiers)))
    if plan.keep_internals:
        j = plan.keep_internals[0]
        yield "level on a kept block", dataclasses.replace(
            plan, save_levels=tuple("L2" if b == j else v for b, v in
                                    enumerate(plan.save_levels)),
            saved_tiers=tuple("hbm" if b == j else v for b, v in enumerate(plan.saved_tiers)))
    last = L - 1
    if last not in plan.keep_internals:  # block L-1 has no legal (d2h, h2d) pair
        d2h = internal_legal_ords("d2h", last, L, **hz)
        yield "block L-1 in dram", dataclasses.replace(
            plan, save_levels=plan.save_levels[:last] + ("L2",),
            saved_tiers=plan.saved_tiers[:last] + ("dram",),
            internal_transfers=tuple(m for m in moves if m.block != last) + tuple(
                InternalTransfer(block=last, kind=k, window=window_name(o, L), fraction=1.0)
                for k, o in (("d2h", d2h[0] if d2h else L), ("h2d", L))))


def test_every_illegal_change_of_a_legal_plan_is_refused():
    names = set()
    for seed, p, plan in cases():
        for name, bad in _mutations(plan, p, random.Random(seed)):
            with pytest.raises(PlanValidationError):
                bad.validate()
            names.add(name)
    assert names >= {"off by one d2h", "off by one h2d", "fractions not 1", "h2d in a d2h window",
                     "moves of an hbm block", "level on a kept block", "block L-1 in dram"}


def test_greedy_levels_keep_validation_and_every_budget_they_started_within():
    tried = 0
    for seed in range(40):
        rng = random.Random(1000 + seed)
        L = rng.randint(2, 6)
        p = random_problem(rng, L, gpu=rng.random() < 0.7, k_max=rng.choice([2, 3, 8]))
        start = evaluate(p, decisions_from_tiers(p, ("hbm",) * (L + 1)))
        p = p.replace(hbm_bytes=int(start.peak_hbm_bytes * rng.uniform(0.8, 1.5)),
                      dram_bytes=int(start.dram_bytes + rng.uniform(0, 4000)))
        tiers = tuple(rng.choice(["hbm", "dram", "recompute"]) for _ in range(L)) + ("hbm",)
        if any(e - s > p.k_max for s, e in segments_of(tiers)):
            continue
        d = decisions_from_tiers(p, tiers)
        before = evaluate(p, d)
        plan = build_plan(p, greedy_levels(p, d), solver=SolveRecord(backend="manual"))
        after = evaluate(p, plan)
        if before.feasible:
            tried += 1
            assert after.feasible, (seed, after.violations)
            assert after.step_ms <= before.step_ms + 1e-9
    assert tried >= 15


def two_blocks(**changes) -> PlanningProblem:
    """2 blocks: F 1, Fg 1.5, B 2, Fr 1.2, Fr1 0.5 ms; P = G = A = 1000 B at 1000 B/ms."""
    base = dict(
        fwd_ms=(1.0, 1.0), fwd_grad_ms=(1.5, 1.5), bwd_ms=(2.0, 2.0), reforward_ms=(1.2, 1.2),
        reforward_l1_ms=(0.5, 0.5), weight_bytes=(1000, 1000), grad_bytes=(1000, 1000),
        internal_bytes=(0, 0), boundary_bytes=(1000, 1000, 1000), params_per_block=(10, 10),
        embed_ms=0.5, head_ms=1.0, h2d_bytes_per_s=KB_PER_MS, d2h_bytes_per_s=KB_PER_MS,
        duplex_bytes_per_s=2 * KB_PER_MS, nvme_read_bytes_per_s=KB_PER_MS,
        nvme_write_bytes_per_s=KB_PER_MS, hbm_bytes=10**12, dram_bytes=10**12,
        nvme_bytes=10**12, drain_windows=8, prefetch_windows=8, nvme_lead_windows=8)
    base.update(changes)
    return PlanningProblem(**base)


def test_saved_internals_h2d_queue_behind_a_same_window_nvme_chain():
    # 2 blocks, boundary 1 nvme with its whole chain in turn (write, read, h2d; its d2h in f1),
    # block 0 L2 in dram (S2 = 1500 B) with its d2h in f1 and its h2d in turn.
    # turn's H2D stream: A1 h2d waits for its read: write [0, 1], read [1, 2], h2d [2, 3];
    # then W1 for b1 [3, 4]; then the internals [4, 5.5]. Head 1 ms: the window is 5.5 ms.
    p = two_blocks(saved_bytes=((400, 1500), (400, 1500)))
    d = decisions_from_tiers(p, ("hbm", "nvme", "hbm"))
    chain = (Transfer(boundary=1, kind="d2h", window="f1", fraction=1.0),) + tuple(
        Transfer(boundary=1, kind=k, window="turn", fraction=1.0)
        for k in ("nvme_write", "nvme_read", "h2d"))
    d = dataclasses.replace(d, transfers=chain, save_levels=("L2", "L0"),
                            saved_tiers=("dram", "none"), internal_transfers=(
                                InternalTransfer(block=0, kind="d2h", window="f1", fraction=1.0),
                                InternalTransfer(block=0, kind="h2d", window="turn",
                                                 fraction=1.0)))
    plan = build_plan(p, d, solver=SolveRecord(backend="manual"))
    assert plan.window("turn").time_ms == pytest.approx(5.5)
    assert simulate(p, plan).window("turn").time_ms == pytest.approx(5.5)


def test_greedy_moves_an_l1_block_to_l2_where_only_the_l1_bytes_given_back_make_room():
    # 2 blocks, every boundary hbm (A = 1000 B): HBM holds 1000, 2000, 3000, 2000, 1000 B in
    # f0, f1, turn, b1, b0. Block 0: L1 saves Fr - Fr1 - (Fg - F) = 1.2 - 0.5 - 0.5 = 0.2 ms on
    # S1 = 100 B, L2 saves 1.2 - 0.5 = 0.7 ms on S2 = 5000 B (tried after L1: less per byte);
    # block 1's autograd forward costs more than any level saves. Budget 3000 + 5000 B: L2 in
    # hbm fits exactly once block 0's L1 bytes are given back (8000 B at turn); in dram its
    # 5 ms copies would be exposed (f1 and b1 compute 1 and 3.2 ms).
    p = two_blocks(fwd_grad_ms=(1.5, 3.0), saved_bytes=((100, 5000), (100, 5000)),
                   hbm_bytes=8000, nvme_bytes=0)
    d = greedy_levels(p, decisions_from_tiers(p, ("hbm",) * 3))
    assert (d.save_levels, d.saved_tiers) == (("L2", "L0"), ("hbm", "none"))
    assert max(evaluate(p, d).hbm_by_window) == 8000
