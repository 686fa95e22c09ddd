"""The one solver probe, `solvers.solver_installed`: it answers what an import would, loads no
solver package, and every caller that picks a backend by what is installed follows it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lazytrain.planner.milp_solve import feasibility_backend
from lazytrain.planner.solvers import solver_installed

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
