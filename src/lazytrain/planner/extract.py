"""From solver columns to plans and back: the MILP's warm start and its extraction.

`start_from_plan` writes a Plan as a full assignment of `milp.build_milp`'s columns (the warm
start; also how tests check that the model's objective equals the evaluator's step), and
`extract_decisions` / `extract_plan` read a solver assignment back as Decisions / a validated
Plan. Knows the variable families of `milp_vars.MilpVars`, no formulation; no solver, no torch.
"""

from __future__ import annotations

import math

from lazytrain.planner.evaluate import Decisions, build_plan
from lazytrain.planner.milp import Milp
from lazytrain.planner.milp_paths import reloaded
from lazytrain.planner.milp_vars import KINDS, row_name
from lazytrain.planner.plan import Bounds, InternalTransfer, Plan, SolveRecord, Transfer
from lazytrain.planner.windows import window_name, window_ord

BINARY_TOL = 1e-4
"""A binary's solver value must be within this of 0 or 1; extraction rounds at 0.5."""
FRACTION_EPS = 1e-7
"""Transfer fractions below this are dropped at extraction (then each kind is renormalized)."""


def start_from_plan(milp: Milp, plan: Plan) -> list[float] | None:
    """A full assignment (incl. transfer fractions, t[o] and slacks) reproducing `plan`.

    Binaries and fractions come from the plan; t[o] and the slacks take the least value their
    rows allow (their minimal epigraph values). Returns None when the plan cannot be expressed
    in this model (a segment longer than k_max, a transfer outside the modelled windows, keep,
    resident weights or q8 not offered, a resident block inside a recompute segment) or the assignment breaks a row by more than 1e-6.
    """
    v, L = milp.v, milp.p.L
    x = [0.0] * milp.model.num_vars
    try:
        for s, e in plan.segments():
            x[v.seg[s, e]] = 1.0
            if s > 0:
                x[v.mat[s]] = 1.0
        for i, tier in enumerate(plan.tiers[:L]):
            if tier == "recompute":
                if i == 0:
                    x[v.emb[plan.segment_end_of(0)]] = 1.0
            else:
                x[getattr(v, tier)[i]] = 1.0
        for j in plan.keep_internals:
            x[v.keep[j]] = 1.0
        for j in plan.resident_weights:
            x[v.resident[j]] = 1.0
        for j in plan.q8_blocks:
            x[v.q8[j]] = 1.0
        family = {kind: fam for fam, kind in KINDS.items()}
        last_write: dict[int, int] = {}
        for tr in plan.transfers:
            o = window_ord(tr.window, L)
            x[v.transfer(family[tr.kind])[tr.boundary, o]] += tr.fraction
            if tr.kind == "nvme_write":
                last_write[tr.boundary] = max(o, last_write.get(tr.boundary, o))
        for (i, q), c in v.wdone.items():  # every write of i has run by the end of window q
            x[c] = 1.0 if last_write.get(i, -1) <= q else 0.0
        for (i, e), c in v.nvb.items():  # NVMe boundary i with segment end e
            x[c] = 1.0 if plan.tiers[i] == "nvme" and plan.segment_end_of(i) == e else 0.0
        paths = plan.weight_paths or ("host_convert",) * L
        for (j, w), c in v.path.items():
            x[c] = 1.0 if paths[j] == w else 0.0
        _start_levels(milp, plan, x)
    except KeyError:
        return None
    _complete_paths(milp, x)
    _complete_epigraph(milp, x)
    worst, _ = milp.model.max_violation(x)
    return x if worst <= 1e-6 else None


def _start_levels(milp: Milp, plan: Plan, x: list[float]) -> None:
    """Set the save-level columns (`planner/milp_levels.py`) from the plan's levels, tiers and
    internal transfers. Raises KeyError where the model has no such column (a level the
    problem does not offer, a transfer outside the modelled windows)."""
    v, L = milp.v, milp.p.L
    for j, level in enumerate(plan.save_levels):
        if level != "L0":
            x[v.lvl[j, int(level[1:]), plan.saved_tiers[j]]] = 1.0
    for tr in plan.internal_transfers:
        fam = v.id2h if tr.kind == "d2h" else v.ih2d
        x[fam[tr.block, int(plan.save_levels[tr.block][1:]), window_ord(tr.window, L)]] \
            += tr.fraction


def _complete_paths(milp: Milp, x: list[float]) -> None:
    """Set the weight-path auxiliaries (`planner/milp_paths.py`) to the least values their
    rows allow, given the path, segment and resident columns: the loads, then the recompute
    chain block by block."""
    v, p = milp.v, milp.p
    _complete_epigraph(milp, x, set(v.wload.values()) | set(v.wreload.values())
                       | set(v.cast_max.values()))
    for (q, e), (ld, cf) in sorted(v.chain.items()):
        prev = v.chain.get((q - 1, e))
        inn = math.fsum(x[c] for c in reloaded(v, q, e))
        x[ld] = (x[prev[0]] if prev else 0.0) + x[v.wreload[0, q, e]] / p.bw_h2d
        x[cf] = max(x[prev[1]] if prev else 0.0, x[ld]) + p.F[q] * inn


def _complete_epigraph(milp: Milp, x: list[float], epi: set[int] | None = None) -> None:
    """Set every column of `epi` (default: every t[o] and slack) to the least value its rows
    allow, given all other columns (rows with one column of `epi`)."""
    m = milp.model
    if epi is None:
        epi = set(milp.v.t.values()) | set(milp.v.slack_hbm.values()) | set(
            milp.v.slack_host.values())
    for c in epi:
        x[c] = m.var_lb[c]
    for r in range(m.num_rows):
        row = m.row_coeffs[r]
        cols = [c for c in row if c in epi]
        if len(cols) != 1:
            continue
        c = cols[0]
        a = row[c]
        rest = math.fsum(k * x[q] for q, k in row.items() if q != c)
        bound = (m.row_lb[r] - rest) / a if a > 0 else (m.row_ub[r] - rest) / a
        if math.isfinite(bound):
            x[c] = max(x[c], bound)


def _on(val: float, name: str) -> bool:
    """Round a binary's solver value (BINARY_TOL) to a bool."""
    if min(abs(val), abs(val - 1.0)) > BINARY_TOL:
        raise RuntimeError(f"solver value {val!r} of binary {name} is not within {BINARY_TOL} of "
                           f"0 or 1")
    return val > 0.5


def extract_decisions(milp: Milp, x: list[float]) -> Decisions:
    """Round binaries (BINARY_TOL), keep fractions >= FRACTION_EPS, renormalize -> Decisions."""
    v, L = milp.v, milp.p.L
    tiers = []
    for i in range(L):
        on = [name for name in ("hbm", "dram", "nvme")
              if i in getattr(v, name) and _on(x[getattr(v, name)[i]], row_name(name, i))]
        tiers.append(on[0] if on else "recompute")
    tiers.append("hbm")
    keep = tuple(j for j, c in v.keep.items() if _on(x[c], row_name("keep", j)))
    resident = tuple(j for j, c in v.resident.items() if _on(x[c], row_name("resident", j)))
    q8 = tuple(j for j, c in v.q8.items() if _on(x[c], row_name("q8", j)))
    starts = [0] + [i for i in range(1, L + 1) if tiers[i] != "recompute"]
    end_of = {s: e for s, e in zip(starts[:-1], starts[1:])}
    transfers = []
    for fam, kind in KINDS.items():
        need = ("dram", "nvme") if fam in ("d2h", "h2d") else ("nvme",)
        for i in range(L):
            if tiers[i] not in need:
                continue
            cells = [(o, x[v.transfer(fam)[i, o]]) for o in v.ords(fam, i)
                     if end_of[i] in v.legal_ends[fam, i, o]]
            cells = [(o, f) for o, f in cells if f >= FRACTION_EPS]
            total = math.fsum(f for _, f in cells)
            transfers += [Transfer(boundary=i, kind=kind, window=window_name(o, L),
                                   fraction=f / total) for o, f in cells]
    paths = tuple(w for j in range(L) for w in milp.p.path_loads
                  if _on(x[v.path[j, w]], row_name("path", j, w))) if v.path else None
    levels, saved_tiers, internal = extract_levels(milp, x)
    return Decisions(tiers=tuple(tiers), keep_internals=keep, resident_weights=resident,
                     q8_blocks=q8, transfers=tuple(transfers), weight_paths=paths,
                     save_levels=levels, saved_tiers=saved_tiers, internal_transfers=internal)


def extract_levels(milp: Milp, x: list[float]):
    """(save_levels, saved_tiers, internal_transfers) of an assignment: every block "L0" /
    "none" but those whose lvl column is on (BINARY_TOL), and one whole d2h and h2d per
    dram-tier block. (None, None, ()) when the model offers no levels: `build_plan` then
    writes every block L0 where the problem truncates the re-forward (`evaluate.levels_of`),
    as a plan from the planner does (docs/execution_model.md, "Save levels")."""
    v, L = milp.v, milp.p.L
    if not v.lvl:
        return None, None, ()  # no levels offered: `evaluate.levels_of` decides (L0)
    levels, tiers = ["L0"] * L, ["none"] * L
    for (j, level, tier), c in v.lvl.items():
        if _on(x[c], row_name("lvl", j, f"L{level}", tier)):
            levels[j], tiers[j] = f"L{level}", tier
    internal = []
    for kind, fam in (("d2h", v.id2h), ("h2d", v.ih2d)):
        for (j, level, o), c in fam.items():
            if levels[j] == f"L{level}" and tiers[j] == "dram" and _on(
                    x[c], row_name(f"i{kind}", j, f"L{level}", window_name(o, L))):
                internal.append(InternalTransfer(block=j, kind=kind,
                                                 window=window_name(o, L), fraction=1.0))
    internal.sort(key=lambda t: (window_ord(t.window, L), t.block, t.kind))
    return tuple(levels), tuple(tiers), tuple(internal)


def extract_plan(milp: Milp, x: list[float], *, solver: SolveRecord,
                 bounds: Bounds | None = None) -> Plan:
    """The Plan of a solver assignment (evaluated and validated by `evaluate.build_plan`).

    Raises:
        PlanValidationError: the extracted plan breaks the contract (a bug in this model).
    """
    return build_plan(milp.problem, extract_decisions(milp, x), solver=solver, bounds=bounds)
