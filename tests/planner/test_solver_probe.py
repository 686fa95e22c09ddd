"""The one solver probe, `solvers.solver_installed`: it answers what an import would, loads no
solver package, and every caller that picks a backend by what is installed follows it (the
feasibility phase, `resolve_backend`'s auto choice and its refusal of a named backend that is
missing)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lazytrain.planner.milp_solve import feasibility_backend
from lazytrain.planner.solvers import (
    AUTO_HIGHS_MAX_BLOCKS, installed_backends, resolve_backend, solver_installed,
)

PACKAGES = {"highs": "highspy", "scip": "pyscipopt"}


def _imports(package: str) -> bool:
    """The reference: does `import package` succeed in a fresh interpreter?"""
    return subprocess.run([sys.executable, "-c", f"import {package}"],
                          capture_output=True).returncode == 0


def test_the_probe_answers_what_an_import_would_and_loads_no_solver():
    code = ("import json, sys; from lazytrain.planner.solvers import solver_installed; "
            "print(json.dumps([{b: solver_installed(b) for b in ('highs', 'scip')}, "
            "[m for m in ('highspy', 'pyscipopt') if m in sys.modules]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    found, loaded = json.loads(out.stdout)
    assert found == {b: _imports(p) for b, p in PACKAGES.items()}
    assert loaded == []


def test_an_unknown_backend_is_a_key_error():
    with pytest.raises(KeyError):
        solver_installed("gurobi")


def test_without_highs_the_feasibility_phase_keeps_the_asked_backend(monkeypatch):
    monkeypatch.setitem(sys.modules, "highspy", None)  # import highspy now raises ImportError
    assert solver_installed("highs") is False
    assert feasibility_backend("scip") == "scip"


def test_with_highs_the_feasibility_phase_uses_it():
    pytest.importorskip("highspy")
    assert feasibility_backend("scip") == "highs"


def test_auto_takes_the_installed_backend_when_its_size_rule_pick_is_missing(monkeypatch):
    pytest.importorskip("highspy")
    monkeypatch.setitem(sys.modules, "pyscipopt", None)  # SCIP not installed
    assert resolve_backend("auto", AUTO_HIGHS_MAX_BLOCKS + 1) == "highs"
    assert installed_backends() == ("highs",)


def test_a_named_backend_that_is_not_installed_is_a_one_line_error(monkeypatch):
    pytest.importorskip("highspy")
    monkeypatch.setitem(sys.modules, "pyscipopt", None)
    with pytest.raises(ValueError, match=r"^planner\.backend: scip needs the pyscipopt package, "
                                         r"which is not installed; set planner\.backend: auto"):
        resolve_backend("scip", 8)


def test_with_no_solver_auto_keeps_its_size_rule_pick(monkeypatch):
    for package in PACKAGES.values():
        monkeypatch.setitem(sys.modules, package, None)
    assert installed_backends() == ()
    assert resolve_backend("auto", 8) == "highs"
    assert resolve_backend("auto", AUTO_HIGHS_MAX_BLOCKS + 1) == "scip"
