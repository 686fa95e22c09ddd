"""Import layering: spec <- planner <- sim/report; runtime never imports the solver; the planner
never imports torch (docs/design.md, "The parts")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lazytrain"

# package -> lazytrain subpackages (or modules) it must never import
FORBIDDEN = {
    "spec": {"planner", "sim", "report", "runtime", "models", "data", "train", "cli", "dist"},
    "planner": {"sim", "report", "runtime", "models", "data", "train", "cli", "dist"},
    "sim": {"runtime", "models", "data", "train", "cli", "dist"},
    "report": {"runtime", "models", "data", "train", "cli", "dist",
               "planner.milp", "planner.solvers"},
    "runtime": {"planner.milp", "planner.solvers", "planner.heuristics", "planner.bounds",
                "planner.policy", "sim", "report", "train", "cli"},
    "models": {"runtime", "planner.milp", "planner.solvers", "sim", "report", "train", "cli"},
    "data": {"planner", "sim", "report", "runtime", "train", "cli"},
    "dist": {"train", "cli"},
}
NO_TORCH = {"spec", "planner", "sim", "report"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the module's package
                base = path.relative_to(PACKAGE.parent).with_suffix("").parts[: -node.level]
                prefix = ".".join(base)
                mod = f"{prefix}.{node.module}" if node.module else prefix
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{alias.name}" for alias in node.names)
    return names


def _files(subpackage: str) -> list[Path]:
    root = PACKAGE / subpackage
    return sorted(root.rglob("*.py")) if root.is_dir() else []


@pytest.mark.parametrize("subpackage", sorted(FORBIDDEN))
def test_subpackage_imports_only_what_the_layering_allows(subpackage):
    bad = []
    for path in _files(subpackage):
        for name in _imports(path):
            for target in FORBIDDEN[subpackage]:
                full = f"lazytrain.{target}"
                if name == full or name.startswith(full + "."):
                    bad.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("subpackage", sorted(NO_TORCH))
def test_planning_side_never_imports_torch(subpackage):
    bad = [f"{p.relative_to(PACKAGE)} imports {n}" for p in _files(subpackage)
           for n in _imports(p) if n == "torch" or n.startswith("torch.")]
    assert not bad, "\n".join(bad)


def test_importing_the_planner_loads_neither_torch_nor_a_solver():
    code = ("import sys, lazytrain.planner, lazytrain.planner.plan, lazytrain.planner.evaluate;"
            "print(','.join(m for m in ('torch', 'pyscipopt', 'highspy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
