"""The hard deadline around HiGHS: a solve that ignores its time limit is killed and the MIP
start comes back as the incumbent; answers and errors of a normal solve pass through."""

from __future__ import annotations

import multiprocessing
import time

import pytest

import lazytrain.planner.solvers as solvers
from lazytrain.planner.solver_guard import run_guarded
from lazytrain.planner.solvers import LinearModel


def _tiny_model() -> LinearModel:
    m = LinearModel()
    x = m.add_var("x", ub=1, integer=True, obj=-1.0)
    y = m.add_var("y", ub=1, integer=True, obj=-2.0)
    m.add_row("cap", {x: 1.0, y: 1.0}, ub=1.0)
    return m


def _never_returns(**_):
    time.sleep(3600)


def test_a_solve_past_its_hard_deadline_returns_the_start_as_the_incumbent(monkeypatch):
    monkeypatch.setattr(solvers, "_solve_highs", _never_returns)
    monkeypatch.setattr(solvers, "hard_deadline_s", lambda limit: 1.0)
    monkeypatch.setattr(solvers, "GUARD_MIN_VARS", 0)  # the tiny model too
    t0 = time.perf_counter()
    res = solvers.solve(_tiny_model(), backend="highs", time_limit_s=0.1, start=[1.0, 0.0])
    assert time.perf_counter() - t0 < 30  # not the hour the solve would take
    assert res.status == "time_limit" and res.values == [1.0, 0.0]
    assert res.objective == pytest.approx(-1.0) and res.dual_bound is None
    assert "hard deadline" in res.detail
    none = solvers.solve(_tiny_model(), backend="highs", time_limit_s=0.1)
    assert none.values is None and none.status == "time_limit"


def test_a_guarded_solve_returns_the_solver_answer(monkeypatch):
    pytest.importorskip("highspy")
    monkeypatch.setattr(solvers, "GUARD_MIN_VARS", 0)
    res = solvers.solve(_tiny_model(), backend="highs", time_limit_s=10)
    assert res.status == "optimal" and res.values == pytest.approx([0.0, 1.0])


def _raises(**_):
    raise ValueError("bad model")


def test_an_error_in_the_guarded_call_is_raised_here():
    with pytest.raises(ValueError, match="bad model"):
        run_guarded(_raises, {}, wall_s=30, fallback=lambda s: None)


def _guarded_double(x: int) -> int:
    return run_guarded(lambda v: 2 * v, {"v": x}, wall_s=30.0, fallback=lambda s: None)


def test_a_guarded_call_inside_a_pool_worker_runs_there():
    # a Pool worker is daemonic and may not fork children: the planner sweep plans in one
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply(_guarded_double, (21,)) == 42
