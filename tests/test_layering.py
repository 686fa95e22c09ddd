"""Import layering, stated as an allow-list: for each package of src/lazytrain, the lazytrain
packages and top-level modules it may import; any other import fails, naming the file and the
import. Beside it the rules the allow-list must never contradict (spec <- planner <- sim/report;
runtime never imports the solver; the planner never imports runtime or torch), no import cycle
between packages, no import cycle between files, at most 25 function-level imports each with a
`# lazy: <reason>` comment, and no file of 600 lines or more (docs/design.md, "The parts").

The graphs are read with tools/package_graph.py's own functions, so the test and
`python tools/package_graph.py` always agree on what an import is (for the package graph lazy
imports inside functions and `TYPE_CHECKING` blocks count; for the file graph an import inside
a function counts, a `TYPE_CHECKING` one does not).
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "lazytrain"


def _load_package_graph():
    name = "_package_graph_for_layering"  # not `package_graph`: test_package_graph owns that
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "package_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


pg = _load_package_graph()

FOUNDATION = frozenset({"lazytrain", "atomic", "errors", "units"})
"""Leaf modules every package may import: the package `__init__` (`__version__`), the atomic
file writers, the error classes and the unit constants. They import nothing of lazytrain
(`test_foundation_imports_nothing_of_lazytrain`), so they can never close a cycle."""

CONTRACT = "contract"
"""`lazytrain/contract.py`, the numbers planner and runtime share: every package may import it
(both sides must), and it imports nothing of lazytrain but `units` and `errors`
(`test_the_contract_imports_only_the_standard_library_units_and_errors`), so it can never close
a cycle either."""

CONTRACT_MAY_IMPORT = frozenset({"units", "errors"})

ALLOWED: dict[str, frozenset[str]] = {
    # leaves
    "lazytrain": frozenset(),
    "contract": CONTRACT_MAY_IMPORT,
    "atomic": frozenset(),
    "errors": frozenset(),
    "units": frozenset(),
    "megatrain": frozenset(),
    "data": frozenset(),
    # the typed run config (reads MegaTrain YAML through megatrain)
    "config": frozenset({"megatrain"}),
    # planning side: torch-free
    "spec": frozenset(),
    "planner": frozenset({"spec", "config"}),
    "sim": frozenset({"planner"}),
    "report": frozenset({"planner", "sim"}),
    # torch side
    "models": frozenset({"spec"}),
    "runtime": frozenset({"spec", "planner", "models", "config"}),
    "dist": frozenset({"planner", "runtime", "models", "config"}),
    # where the costs come from: measures on the torch side, reads the cache torch-free
    "profile": frozenset({"spec", "planner", "runtime", "models", "config"}),
    # forward-only and decode passes through the engine's weight path, and the lm-eval model
    "evaluation": frozenset({"spec", "planner", "runtime", "models", "data", "config"}),
    "train": frozenset({"spec", "planner", "report", "runtime", "models", "data", "dist",
                        "config", "profile", "evaluation"}),
    "cli": frozenset({"spec", "planner", "sim", "report", "runtime", "train", "config",
                      "megatrain", "profile", "evaluation"}),
}
"""Node -> the nodes it may import besides FOUNDATION. A node is a subpackage or a top-level
module, as in tools/package_graph.py. Derived from what the code imported when the list was
written; widening it is a design decision, and NEVER below must still hold."""

SOLVER_MODULES = ("planner.milp", "planner.milp_inputs", "planner.milp_vars", "planner.milp_loads",
                  "planner.milp_rows", "planner.milp_solve", "planner.extract",
                  "planner.feasibility", "planner.gaps", "planner.solvers", "planner.wear")
"""The MILP and its solver interface, module by module (the rules match by name prefix, so each
module of the split formulation is named)."""

NEVER: dict[str, frozenset[str]] = {
    "spec": frozenset({"planner", "sim", "report", "runtime", "models", "data", "train", "cli",
                       "dist"}),
    "planner": frozenset({"sim", "report", "runtime", "models", "data", "train", "cli",
                          "dist"}),
    "sim": frozenset({"runtime", "models", "data", "train", "cli", "dist"}),
    "report": frozenset({"runtime", "models", "data", "train", "cli", "dist", *SOLVER_MODULES}),
    "runtime": frozenset({*SOLVER_MODULES, "planner.heuristics", "planner.bounds",
                          "planner.policy", "sim", "report", "train", "cli"}),
    "models": frozenset({"runtime", *SOLVER_MODULES, "sim", "report", "train", "cli"}),
    "data": frozenset({"planner", "sim", "report", "runtime", "train", "cli"}),
    "dist": frozenset({"train", "cli"}),
    "profile": frozenset({*SOLVER_MODULES, "sim", "report", "train", "cli"}),
    "evaluation": frozenset({*SOLVER_MODULES, "sim", "report", "train", "cli"}),
}
"""Node -> packages or modules (`planner.milp`) it must never import: the project's layering
rules. They are finer than ALLOWED where a rule names a module (runtime may import the Plan
from `planner.plan` but never the solver), so they are checked on every import as well."""

NO_TORCH = frozenset({"spec", "planner", "sim", "report"})


def _graph():
    return pg.build_graph(PACKAGE)


def _imports_by_file() -> list[tuple[str, str, str]]:
    """(file relative to src/lazytrain, its node, dotted lazytrain name) for every name that
    every import statement of every file names."""
    graph = _graph()
    nodes = set(graph.nodes)
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        src = pg.node_of(rel, "lazytrain")
        out += [(str(rel), src, name) for name in _names(path)
                if pg.node_of_name(name, package="lazytrain", nodes=nodes) is not None]
    return out


def _names(path: Path) -> list[str]:
    """Every dotted name the import statements of one file name (relative imports resolved)."""
    rel = path.relative_to(PACKAGE)
    module = ".".join(("lazytrain", *rel.with_suffix("").parts))
    is_init = rel.name == "__init__.py"
    if is_init:
        module = module.removesuffix(".__init__")
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [name for names in pg.import_sites(tree, module=module, is_init=is_init)
            for name in names]


def _lands_in(name: str, target: str) -> bool:
    full = f"lazytrain.{target}"
    return name == full or name.startswith(full + ".")


def test_every_package_has_an_allow_list():
    missing = sorted(set(_graph().nodes) - set(ALLOWED))
    assert not missing, (f"no allow-list entry for {missing}: add each to ALLOWED in "
                         "tests/test_layering.py with the packages it may import")


def test_the_allow_list_breaks_no_layering_rule():
    clashes = [f"{node} is allowed {sorted(ALLOWED[node] & rule)}, which NEVER forbids"
               for node, rule in NEVER.items() if ALLOWED[node] & rule]
    assert not clashes, "\n".join(clashes)
    assert not set(NEVER) - set(ALLOWED), "every NEVER entry needs an ALLOWED entry"


def test_every_import_is_on_the_allow_list():
    nodes = set(_graph().nodes)
    bad = []
    for rel, src, name in _imports_by_file():
        dst = pg.node_of_name(name, package="lazytrain", nodes=nodes)
        if dst != src and dst not in ALLOWED.get(src, frozenset()) | _shared_with(src):
            bad.append(f"{rel} imports {name} ({src} may not import {dst})")
    assert not bad, "\n".join(bad)


def test_no_import_breaks_a_layering_rule():
    bad = [f"{rel} imports {name} ({src} must never import {target})"
           for rel, src, name in _imports_by_file()
           for target in sorted(NEVER.get(src, ())) if _lands_in(name, target)]
    assert not bad, "\n".join(bad)


def _shared_with(node: str) -> frozenset[str]:
    """What `node` may import beyond its own entry: FOUNDATION and the contract (the contract
    itself only what CONTRACT_MAY_IMPORT names)."""
    return frozenset() if node == CONTRACT else FOUNDATION | {CONTRACT}


def test_the_contract_imports_only_the_standard_library_units_and_errors():
    path = PACKAGE / "contract.py"
    bad = [name for name in _names(path)
           if name.split(".")[0] not in sys.stdlib_module_names
           and not any(_lands_in(name, ok) for ok in CONTRACT_MAY_IMPORT)]
    assert not bad, f"contract.py may import only the standard library, units, errors: {bad}"
    edges = {dst for (src, dst) in _graph().edges if src == CONTRACT}
    assert edges <= CONTRACT_MAY_IMPORT, edges


def test_both_sides_import_the_contract():
    importers = {src for (src, dst) in _graph().edges if dst == CONTRACT}
    assert {"planner", "runtime", "spec", "config", "sim"} <= importers, importers


def test_foundation_imports_nothing_of_lazytrain():
    edges = sorted(f"{src} -> {dst} ({edge.example})"
                   for (src, dst), edge in _graph().edges.items() if src in FOUNDATION)
    assert not edges, "\n".join(edges)


def test_no_import_cycle_between_packages():
    graph = _graph()
    found = [" -> ".join(cyc) + "  (" + ", ".join(graph.edges[(a, b)].example
                                                   for a, b in zip(cyc, cyc[1:])) + ")"
             for cyc in pg.cycles(graph)]
    assert not found, "import cycles between packages:\n" + "\n".join(found)


def test_no_import_cycle_between_files():
    graph = pg.build_file_graph(PACKAGE)
    found = [" -> ".join(cyc) + "  (" + ", ".join(graph.sites[(a, b)]
                                                   for a, b in zip(cyc, cyc[1:])) + ")"
             for cyc in pg.file_cycles(graph)]
    assert not found, ("import cycles between files (move the shared code into the lower "
                       "module or a new small one):\n" + "\n".join(found))


def test_function_level_imports_are_few_and_each_says_why():
    lazy = pg.build_file_graph(PACKAGE).function_imports
    bare = [f"{imp.where}: {imp.text}" for imp in lazy if imp.reason == pg.NO_REASON]
    assert not bare, ("function-level imports without a reason: move each to module top, or "
                      "end its line with '# lazy: <reason>' (an optional dependency, or keeping "
                      "torch out of a torch-free command):\n" + "\n".join(bare))
    assert len(lazy) <= pg.FUNCTION_IMPORT_LIMIT, (
        f"{len(lazy)} function-level imports, at most {pg.FUNCTION_IMPORT_LIMIT}: move them to "
        "module top:\n" + "\n".join(f"{imp.where}: {imp.text}  # lazy: {imp.reason}"
                                     for imp in lazy))


def test_no_file_of_600_lines_or_more():
    long = [f"{path}: {count} lines (split it by concern)"
            for path, count in pg.long_files(PACKAGE, max_lines=599)]
    assert not long, "\n".join(long)


@pytest.mark.parametrize("subpackage", sorted(NO_TORCH))
def test_planning_side_never_imports_torch(subpackage):
    bad = [f"{path.relative_to(PACKAGE)} imports {name}"
           for path in sorted((PACKAGE / subpackage).rglob("*.py")) for name in _names(path)
           if name == "torch" or name.startswith("torch.")]
    assert not bad, "\n".join(bad)


def test_importing_the_planner_loads_neither_torch_nor_a_solver():
    code = ("import sys, lazytrain.planner, lazytrain.planner.plan, lazytrain.planner.evaluate;"
            "print(','.join(m for m in ('torch', 'pyscipopt', 'highspy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
