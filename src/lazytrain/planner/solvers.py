"""Solver adapters: one recorded linear model, solved by SCIP (PySCIPOpt) or HiGHS (highspy).

Owns `LinearModel` (the small model interface the MILP's constraint families write to: add a
variable, add a row, objective terms, an offset) and `solve()`, which hands a recorded model to
one backend and returns a `SolveResult` in the model's own variable order. The adapters hold
no formulation logic: `planner/milp.py` writes the model once, and both backends read it
(checkmate's two backends drifted into two models; recording once prevents that).

HiGHS MIP solves of GUARD_MIN_VARS columns or more run in a forked child with a hard deadline
(`solver_guard.run_guarded`: 3x the time limit + 30 s); past it the child is killed and the MIP
start is returned as the incumbent with status "time_limit".

Must not know: tiers, windows or plans. The solver packages are imported lazily inside the
adapters, so importing this module loads neither (and `lazytrain.planner` never imports it);
`solver_installed` is the one probe of which are installed, and loads neither either.

Statuses (`SolveResult.status`): "optimal" (proven within the requested gap), "time_limit"
(stopped by the time limit; `values` holds the incumbent if one was found), "node_limit"
(the same for a node limit: SCIP's limits/nodes, HiGHS's mip_max_nodes, which HiGHS reports
as "solution limit reached"), "infeasible",
"unbounded", "error" (anything else, with the backend's own status in `detail`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from lazytrain.planner.solver_guard import hard_deadline_s, run_guarded

INF = math.inf


@dataclass(kw_only=True, slots=True)
class LinearModel:
    """A (mixed-integer) linear program in row form: min c.x + offset, row_lb <= A x <= row_ub.

    Variables and rows are numbered in creation order; names are `family[idx]` strings chosen by
    the caller (see `milp_vars.row_name`). Coefficients are stored per row as {column: value}.
    """

    var_names: list[str] = field(default_factory=list)
    var_lb: list[float] = field(default_factory=list)
    var_ub: list[float] = field(default_factory=list)
    var_integer: list[bool] = field(default_factory=list)
    obj: list[float] = field(default_factory=list)
    obj_offset: float = 0.0
    row_names: list[str] = field(default_factory=list)
    row_coeffs: list[dict[int, float]] = field(default_factory=list)
    row_lb: list[float] = field(default_factory=list)
    row_ub: list[float] = field(default_factory=list)

    @property
    def num_vars(self) -> int:
        return len(self.var_names)

    @property
    def num_rows(self) -> int:
        return len(self.row_names)

    def add_var(self, name: str, *, lb: float = 0.0, ub: float = INF, obj: float = 0.0,
                integer: bool = False) -> int:
        """Add one column; returns its index."""
        self.var_names.append(name)
        self.var_lb.append(float(lb))
        self.var_ub.append(float(ub))
        self.var_integer.append(bool(integer))
        self.obj.append(float(obj))
        return len(self.var_names) - 1

    def add_obj(self, var: int, coef: float) -> None:
        """Add `coef` to the objective coefficient of `var`."""
        self.obj[var] += float(coef)

    def add_row(self, name: str, coeffs: dict[int, float], *, lb: float = -INF,
                ub: float = INF) -> int:
        """Add the row `lb <= sum coeffs[v] * x[v] <= ub`; zero coefficients are dropped."""
        self.row_names.append(name)
        self.row_coeffs.append({v: float(c) for v, c in coeffs.items() if c != 0.0})
        self.row_lb.append(float(lb))
        self.row_ub.append(float(ub))
        return len(self.row_names) - 1

    def objective_value(self, x: list[float]) -> float:
        """c.x + offset for a full assignment."""
        return self.obj_offset + math.fsum(c * v for c, v in zip(self.obj, x) if c)

    def row_activity(self, r: int, x: list[float]) -> float:
        return math.fsum(c * x[v] for v, c in self.row_coeffs[r].items())

    def max_violation(self, x: list[float]) -> tuple[float, str]:
        """Largest bound or row violation of an assignment, with the variable/row name."""
        worst, where = 0.0, ""
        for v, val in enumerate(x):
            bad = max(self.var_lb[v] - val, val - self.var_ub[v], 0.0)
            if self.var_integer[v]:
                bad = max(bad, abs(val - round(val)))
            if bad > worst:
                worst, where = bad, self.var_names[v]
        for r in range(self.num_rows):
            a = self.row_activity(r, x)
            bad = max(self.row_lb[r] - a, a - self.row_ub[r], 0.0)
            if bad > worst:
                worst, where = bad, self.row_names[r]
        return worst, where


@dataclass(kw_only=True, frozen=True, slots=True)
class SolveResult:
    """What a backend returned, in the model's variable order."""

    backend: str
    status: str
    values: list[float] | None
    """Incumbent (or LP optimum), one value per variable; None when no solution was found."""
    objective: float | None
    """c.x + offset of `values`."""
    dual_bound: float | None
    """The backend's proven lower bound on the objective (None if unknown)."""
    solve_s: float
    detail: str = ""

    @property
    def gap(self) -> float | None:
        """(objective - dual_bound) / |dual_bound|, the plan's gap (plan / bound - 1)."""
        if self.objective is None or self.dual_bound is None:
            return None
        if not math.isfinite(self.dual_bound) or self.dual_bound == 0.0:
            return None
        return max(0.0, (self.objective - self.dual_bound) / abs(self.dual_bound))


BACKENDS = ("highs", "scip")
SOLVER_PACKAGES = {"highs": "highspy", "scip": "pyscipopt"}
"""Backend -> the Python package that provides it (the `[highs]` and `[scip]` extras)."""
GUARD_MIN_VARS = 1000
"""HiGHS MIPs with at least this many columns run under the hard-deadline guard (a fork per
solve costs milliseconds, which brute-force loops over small models would pay thousands of
times; the presolve hang was seen on a 64-block model of about 5,700 columns)."""


@contextlib.contextmanager
def solver_output_to_stderr():
    """Send whatever solvers print to file descriptor 1 (HiGHS's banner is written by C++
    before any option can silence it) to stderr, so stdout holds only results (`--json`)."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # captured stdout without a descriptor
        yield
        return
    saved = os.dup(fd)
    try:
        os.dup2(sys.stderr.fileno(), fd)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


@contextlib.contextmanager
def _banner_discarded():
    """Point file descriptors 1 and 2 at os.devnull while HiGHS builds its first instance: the
    banner ("Running HiGHS ...") is written by C++ before `output_flag` can silence it, and it
    is no result and no diagnostic, so it goes neither to stdout nor to stderr."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


# `auto` backend: from benchmarks/planner.py on 2 shared cores. 2026-11-29: at L = 64 HiGHS
# reached the 0.5% gap in 1.4 s cold / 0.8 s warm against SCIP's 6.3 s / 3.7 s; at L = 128
# SCIP warm reached 0.18% in 9.4 s while HiGHS warm stayed at 3.9%. 2026-12-01 (recompute-order
# rows, two-phase budgets): L = 64 HiGHS warm 0.01% in 0.8 s, SCIP warm 0.24% in 1.5 s; L = 128
# split seed SCIP warm 0.47% in 10.5 s, HiGHS warm 0.58% at its 30 s limit; L = 128 NVMe-heavy
# HiGHS warm 0.00% in 22 s, SCIP 2.14% at its 30 s limit. So HiGHS up to 64 blocks, SCIP
# above (mixed at 128; HiGHS has also overrun its MIP time limit there, ERGO-Code/HiGHS#885).
AUTO_HIGHS_MAX_BLOCKS = 64


def solver_installed(backend: str) -> bool:
    """True when the package of `backend` ("highs" or "scip", `SOLVER_PACKAGES`) is on the
    path. Found, not imported: the probe loads no solver.

    Raises:
        KeyError: unknown backend name.
    """
    return importlib.util.find_spec(SOLVER_PACKAGES[backend]) is not None


def installed_backends() -> tuple[str, ...]:
    """The backends whose package is installed (`solver_installed`), in `BACKENDS` order;
    empty when neither HiGHS nor SCIP is (the planner then plans by the heuristic)."""
    return tuple(b for b in BACKENDS if solver_installed(b))


def resolve_backend(backend: str, num_blocks: int) -> str:
    """The concrete solver for `backend` ("auto", "highs" or "scip") on an L-block problem.

    "auto" takes HiGHS up to AUTO_HIGHS_MAX_BLOCKS blocks and SCIP above, or the other one when
    only that one is installed (with neither installed, the size rule's pick).

    Raises:
        ValueError: unknown backend name, or a named backend whose package is not installed
            while the other one is (the message names `planner.backend` and the fix).
    """
    if backend == "auto":
        preferred = "highs" if num_blocks <= AUTO_HIGHS_MAX_BLOCKS else "scip"
        installed = installed_backends()
        return preferred if preferred in installed or not installed else installed[0]
    if backend not in BACKENDS:
        raise ValueError(f"planner.backend must be one of {('auto',) + tuple(BACKENDS)}; "
                         f"got {backend!r}")
    installed = installed_backends()
    if installed and backend not in installed:
        raise ValueError(f"planner.backend: {backend} needs the {SOLVER_PACKAGES[backend]} "
                         f"package, which is not installed; set planner.backend: auto (uses "
                         f"{installed[0]}) or pip install {SOLVER_PACKAGES[backend]}")
    return backend


def solve(model: LinearModel, *, backend: str = "highs", time_limit_s: float = 10.0,
          gap: float = 0.005, threads: int = 1, seed: int = 0,
          start: list[float] | None = None, relax: bool = False,
          fixed: dict[int, float] | None = None, node_limit: int | None = None) -> SolveResult:
    """Solve `model` with one backend.

    Args:
        model: the recorded model (not modified).
        backend: "highs" or "scip".
        time_limit_s: wall-clock limit, s; math.inf: none (`node_limit` then bounds the
            search, and the answer no longer depends on how busy the machine is).
        gap: relative gap at which the search stops (dimensionless).
        threads: solver threads (1: deterministic).
        seed: the solver's random seed (same seed + same model -> same answer).
        start: a full assignment to try as the first incumbent (MIP start); ignored for LPs.
        relax: drop integrality (the LP relaxation).
        fixed: {column: value} bounds fixed for this solve only (brute-force checks, warm-start
            completion).
        node_limit: stop after this many branch-and-bound nodes (status "node_limit"): a
            work limit that, unlike the time limit, gives the same answer on a loaded machine
            (`planner.deterministic`). None: no limit.

    Returns:
        SolveResult (status as in the module docstring).

    Raises:
        ValueError: unknown backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"planner.backend must be one of {BACKENDS}; got {backend!r}")
    kwargs = dict(model=model, time_limit_s=time_limit_s, gap=gap, threads=threads, seed=seed,
                  start=start, relax=relax, fixed=fixed or {}, node_limit=node_limit)
    if backend == "scip":
        return _solve_scip(**kwargs)
    if relax or model.num_vars < GUARD_MIN_VARS:
        return _solve_highs(**kwargs)
    # HiGHS may run far past its limit inside its MIP presolve, where it checks neither the
    # limit nor its interrupt callbacks: a forked child, killed at the hard deadline
    return run_guarded(_solve_highs, kwargs, wall_s=hard_deadline_s(time_limit_s),
                       fallback=lambda elapsed: _start_as_result(model, start, elapsed))


def _start_as_result(model: LinearModel, start: list[float] | None,
                     elapsed_s: float) -> SolveResult:
    """What a killed solve returns: the MIP start as the incumbent (None without one)."""
    objective = model.objective_value(start) if start is not None else None
    return SolveResult(backend="highs", status="time_limit", values=start, objective=objective,
                       dual_bound=None, solve_s=elapsed_s,
                       detail="killed at the hard deadline (HiGHS ran past its time limit)")


def _bounds(model: LinearModel, fixed: dict[int, float]) -> tuple[list[float], list[float]]:
    lb, ub = list(model.var_lb), list(model.var_ub)
    for v, val in fixed.items():
        lb[v] = ub[v] = float(val)
    return lb, ub


# --- HiGHS ------------------------------------------------------------------------------------


# HiGHS checks `time_limit` only at some points of its MIP loop; on large models (L = 128) it was
# seen running minutes past the limit inside one node's LP. The interrupt callbacks below stop it
# at a hard deadline, a little after the nominal limit so the regular limit normally wins.
HIGHS_DEADLINE_FACTOR = 1.1
# HiGHS 1.16 at L = 128 spent minutes in the presolve of the root-reduced-cost heuristic's sub-MIP
# (HPresolve::strengthenInequalities), where neither `time_limit` nor the interrupt callbacks are
# checked. Our LP relaxation is within ~0.3% of the optimum and the warm start supplies the
# incumbent, so that heuristic is switched off.
HIGHS_SUBMIP_OPTIONS = {"mip_heuristic_run_root_reduced_cost": False}


def _enforce_highs_deadline(h, highspy, *, deadline: float) -> None:
    """Interrupt HiGHS (MIP loop, simplex and IPM iterations) once `deadline` (perf_counter s) passes.

    The incumbent found so far is kept: HiGHS returns it with an "Interrupted by user" status,
    which `_solve_highs` maps to `time_limit`.
    """
    kinds = (highspy.cb.HighsCallbackType.kCallbackMipInterrupt,
             highspy.cb.HighsCallbackType.kCallbackSimplexInterrupt,
             highspy.cb.HighsCallbackType.kCallbackIpmInterrupt)

    def on_interrupt_check(callback_type, message, data_out, data_in, user_data):
        if time.perf_counter() > deadline:
            data_in.user_interrupt = True

    h.setCallback(on_interrupt_check, None)
    for kind in kinds:
        h.startCallback(kind)


def _solve_highs(model: LinearModel, *, time_limit_s, gap, threads, seed, start, relax,
                 fixed, node_limit=None) -> SolveResult:
    import highspy  # lazy: optional dependency (the [highs] extra)

    with _banner_discarded():  # HiGHS prints its banner on the first instance
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(gap))
    h.setOptionValue("threads", int(threads))
    h.setOptionValue("random_seed", int(seed))
    if node_limit is not None:
        h.setOptionValue("mip_max_nodes", int(node_limit))
    for option, value in HIGHS_SUBMIP_OPTIONS.items():
        h.setOptionValue(option, value)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = model.num_vars, model.num_rows
    lb, ub = _bounds(model, fixed)
    lp.col_cost_ = np.asarray(model.obj, dtype=np.float64)
    lp.col_lower_ = np.asarray(lb, dtype=np.float64)
    lp.col_upper_ = np.asarray(ub, dtype=np.float64)
    lp.row_lower_ = np.asarray(model.row_lb, dtype=np.float64)
    lp.row_upper_ = np.asarray(model.row_ub, dtype=np.float64)
    lp.offset_ = float(model.obj_offset)
    starts, index, value = [0], [], []
    for coeffs in model.row_coeffs:
        index.extend(coeffs.keys())
        value.extend(coeffs.values())
        starts.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = model.num_vars, model.num_rows
    lp.a_matrix_.start_ = np.asarray(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(value, dtype=np.float64)
    is_mip = not relax and any(model.var_integer)
    if is_mip:
        lp.integrality_ = [highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous
                           for b in model.var_integer]
    h.passModel(lp)
    if is_mip and start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = [float(v) for v in start]
        sol.value_valid = True
        h.setSolution(sol)
    # HiGHS keeps one process-wide thread scheduler; another instance with a different thread
    # count makes run() fail with "scheduler already initialized", so reset it per solve.
    highspy.Highs.resetGlobalScheduler(True)
    t0 = time.perf_counter()
    _enforce_highs_deadline(h, highspy, deadline=t0 + float(time_limit_s) * HIGHS_DEADLINE_FACTOR)
    h.run()
    solve_s = time.perf_counter() - t0
    ms = h.getModelStatus()
    name = h.modelStatusToString(ms).lower()
    info = h.getInfo()
    has_sol = info.primal_solution_status == 2  # kSolutionStatusFeasible
    values = list(h.getSolution().col_value) if has_sol else None
    if "optimal" in name:
        status = "optimal"
    elif "time limit" in name or "interrupt" in name:
        status = "time_limit"
    elif "solution limit" in name:  # HiGHS's kSolutionLimit: mip_max_nodes reached
        status = "node_limit"
    elif "infeasible" in name:
        status = "infeasible"
    elif "unbounded" in name:
        status = "unbounded"
    else:
        status = "error"
    objective = model.objective_value(values) if values is not None else None
    if (start is not None and objective is not None and has_sol
            and abs(objective - info.objective_function_value) > 1e-6 * max(1.0, abs(objective))):
        # HiGHS 1.16 can report a better optimum than the columns getSolution() returns (the MIP
        # start's; seen: 17256 ms returned, 15410 ms reported, status "optimal"). The columns
        # are what we extract, so solve again without the start and keep the time spent.
        again = _solve_highs(model, time_limit_s=time_limit_s, gap=gap, threads=threads,
                             seed=seed, start=None, relax=relax, fixed=fixed,
                             node_limit=node_limit)
        return SolveResult(backend="highs", status=again.status, values=again.values,
                           objective=again.objective, dual_bound=again.dual_bound,
                           solve_s=solve_s + again.solve_s, detail=again.detail)
    if is_mip:
        dual = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else None
    else:
        dual = objective if status == "optimal" else None
    return SolveResult(backend="highs", status=status, values=values, objective=objective,
                       dual_bound=dual, solve_s=solve_s, detail=name)


# --- SCIP -------------------------------------------------------------------------------------


SCIP_NO_TIME_LIMIT_S = 1e20
"""SCIP's largest limits/time (its infinity), s: what math.inf becomes."""


def _solve_scip(model: LinearModel, *, time_limit_s, gap, threads, seed, start, relax,
                fixed, node_limit=None) -> SolveResult:
    import pyscipopt  # lazy: optional dependency (the [scip] extra)

    m = pyscipopt.Model()
    m.hideOutput()
    m.setParam("limits/time", min(float(time_limit_s), SCIP_NO_TIME_LIMIT_S))
    m.setParam("limits/gap", float(gap))
    m.setParam("randomization/randomseedshift", int(seed))
    m.setParam("parallel/maxnthreads", int(threads))
    if node_limit is not None:
        m.setParam("limits/nodes", int(node_limit))
    lb, ub = _bounds(model, fixed)
    is_mip = not relax and any(model.var_integer)
    xs = []
    for v in range(model.num_vars):
        vtype = "I" if (is_mip and model.var_integer[v]) else "C"
        xs.append(m.addVar(name=model.var_names[v], vtype=vtype,
                           lb=None if lb[v] == -INF else lb[v],
                           ub=None if ub[v] == INF else ub[v], obj=model.obj[v]))
    if model.obj_offset:
        m.addObjoffset(model.obj_offset)
    for r in range(model.num_rows):
        expr = pyscipopt.quicksum(c * xs[v] for v, c in model.row_coeffs[r].items())
        lo, hi = model.row_lb[r], model.row_ub[r]
        if lo == hi:
            m.addCons(expr == lo, name=model.row_names[r])
        elif lo == -INF:
            m.addCons(expr <= hi, name=model.row_names[r])
        elif hi == INF:
            m.addCons(expr >= lo, name=model.row_names[r])
        else:
            m.addCons(pyscipopt.Expr() + lo <= expr, name=model.row_names[r] + "_lo")
            m.addCons(expr <= hi, name=model.row_names[r] + "_hi")
    if is_mip and start is not None:
        sol = m.createSol()
        for x, val in zip(xs, start):
            m.setSolVal(sol, x, float(val))
        m.addSol(sol, free=True)
    t0 = time.perf_counter()
    m.optimize()
    solve_s = time.perf_counter() - t0
    name = m.getStatus()
    status = {"optimal": "optimal", "gaplimit": "optimal", "timelimit": "time_limit",
              "nodelimit": "node_limit", "infeasible": "infeasible",
              "unbounded": "unbounded"}.get(name, "error")
    values = None
    if m.getNSols() > 0:
        best = m.getBestSol()
        values = [m.getSolVal(best, x) for x in xs]
    objective = model.objective_value(values) if values is not None else None
    dual = m.getDualbound() if status != "infeasible" else None
    if dual is not None and (not math.isfinite(dual) or abs(dual) >= m.infinity()):
        dual = None  # SCIP reports -1e20 (its infinity) before the root bound is known
    return SolveResult(backend="scip", status=status, values=values, objective=objective,
                       dual_bound=dual, solve_s=solve_s, detail=name)
