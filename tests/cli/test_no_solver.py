"""`lazytrain plan` and a tiny `lazytrain train` on a machine without HiGHS and SCIP (the GPU
machine's case): each runs in a subprocess whose sitecustomize puts None in sys.modules for
highspy and pyscipopt, so `import` fails and `importlib.util.find_spec` returns None, as for a
package that is not installed. The heuristic plans, no LP bound is claimed, and one line says
that the MILP was unavailable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HIDE = """import sys
for _name in ("highspy", "pyscipopt"):
    sys.modules[_name] = None  # import raises ModuleNotFoundError; find_spec returns None
"""
PROBE = ("import importlib.util, json; print(json.dumps([importlib.util.find_spec(m) is None "
         "for m in ('highspy', 'pyscipopt')]))")
UNAVAILABLE = "MILP unavailable: neither highspy nor pyscipopt is installed"


def _env(tmp_path: Path) -> dict:
    hide = tmp_path / "hide"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text(HIDE)
    src = Path(__file__).resolve().parents[2] / "src"
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), str(src)])}


def _lazytrain(tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lazytrain.cli.main", *args],
                          capture_output=True, text=True, env=_env(tmp_path), timeout=timeout)


def test_the_hiding_makes_both_solvers_look_uninstalled(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=_env(tmp_path), check=True)
    assert json.loads(out.stdout) == [True, True]


@pytest.mark.parametrize("policy", ["milp", "heuristic"])
def test_plan_without_solvers_is_the_heuristic_plan_without_an_lp_bound(tmp_path, repo_root,
                                                                        policy):
    config = str(repo_root / "configs" / "tiny-llama-cpu.yaml")
    sets = ["--set", f"planner.policy={policy}", "--set", "planner.deterministic=true"]
    table = _lazytrain(tmp_path, "plan", "--config", config, *sets)
    assert table.returncode == 0, table.stderr[-2000:]
    lines = table.stdout.splitlines()
    assert (sum(line.startswith(UNAVAILABLE) for line in lines) == 1) == (policy == "milp")
    row = "heuristic (no MILP solver)" if policy == "milp" else "heuristic "
    assert sum(line.startswith(row) for line in lines) == 1  # the plan's row says who made it
    assert not any(line.startswith("LP bound ") for line in lines)
    assert any(line.startswith("memory bound ") for line in lines)
    got = _lazytrain(tmp_path, "plan", "--config", config, *sets, "--json")
    assert got.returncode == 0, got.stderr[-2000:]
    plan = json.loads(got.stdout)["plan"]
    assert plan["bounds"]["lp_step_ms"] is None
    assert plan["bounds"]["memory_step_ms"] is not None
    assert plan["solver"]["backend"] == "heuristic"
    # the reference: the heuristic policy's plan of the same problem, solvers hidden alike
    ref = _lazytrain(tmp_path, "plan", "--config", config, "--set", "planner.policy=heuristic",
                     "--set", "planner.deterministic=true", "--json")
    assert ref.returncode == 0, ref.stderr[-2000:]
    want = json.loads(ref.stdout)["plan"]
    for key in ("boundaries", "keep_internals", "resident_weights", "transfers", "predicted"):
        assert plan[key] == want[key], key


@pytest.mark.slow
def test_a_tiny_train_runs_without_solvers(tmp_path, repo_root):
    config = str(repo_root / "configs" / "tiny-llama-cpu.yaml")
    run = _lazytrain(tmp_path, "train", "--config", config, "--run-dir", str(tmp_path / "run"),
                     "--set", "planner.policy=milp", "--set", "train.steps=1",
                     "--set", "data.num_eval=0", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sum(UNAVAILABLE in line for line in run.stdout.splitlines()) == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary  # the run finished and wrote its summary
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["bounds"]["lp_step_ms"] is None
    assert plan["provenance"]["milp_unavailable"].startswith(UNAVAILABLE)
