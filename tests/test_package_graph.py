"""tools/package_graph.py on hand-made package trees: edges with their import-statement counts,
cycles between packages, files over the line limit, Graphviz output. The real tree is never
read here: its graph changes with every refactor, the fake trees' graphs are written by hand."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "package_graph.py"


@pytest.fixture(scope="module")
def pg():
    spec = importlib.util.spec_from_file_location("package_graph", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["package_graph"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules["package_graph"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def cyclic(tmp_path):
    """Package `fake`: a and b import each other (b lazily, inside a function), b imports the
    top-level module c through a relative import, c has 601 lines and d exactly 600."""
    filler = "x = 0\n"
    return _write(tmp_path / "fake", {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/x.py": "import os\nfrom fake.b.y import f, g\nfrom fake.b import y\n",
        "b/__init__.py": "",
        "b/y.py": "def f():\n    import fake.a.x\n    return fake.a.x\n\ndef g():\n    pass\n",
        "b/z.py": "from ..c import x\nfrom . import y\n",
        "c.py": filler * 601,
        "d.py": "import fake\n" + filler * 599,
    })


def test_two_packages_importing_each_other_give_one_cycle_and_counted_edges(pg, cyclic):
    graph = pg.build_graph(cyclic)
    assert graph.nodes == ["a", "b", "c", "d", "fake"]
    # a/x.py: two statements into b ('from fake.b.y import f, g' is one site, not two);
    # b/y.py: one lazy import of a; b/z.py: '..c' resolves to fake.c, '.' to b itself (no edge);
    # d.py: 'import fake' lands in the package's own __init__.
    sites = {key: (e.sites, e.example) for key, e in graph.edges.items()}
    assert sites == {("a", "b"): (2, "a/x.py"), ("b", "a"): (1, "b/y.py"),
                     ("b", "c"): (1, "b/z.py"), ("d", "fake"): (1, "d.py")}
    assert pg.cycle_groups(graph) == [["a", "b"]]
    assert pg.cycles(graph) == [["a", "b", "a"]]


def test_only_files_over_the_limit_are_reported(pg, cyclic):
    assert pg.long_files(cyclic) == [("c.py", 601)]
    assert pg.long_files(cyclic, max_lines=5) == [("c.py", 601), ("d.py", 600), ("b/y.py", 6)]


def test_a_three_package_ring_is_one_group_and_one_cycle(pg, tmp_path):
    root = _write(tmp_path / "ring", {
        "__init__.py": "",
        "p/__init__.py": "from ring.q import v\n",
        "q/__init__.py": "from ring import r\n",
        "r.py": "import ring.p\n",
        "s.py": "import ring.p\n",  # points into the ring, is not part of it
    })
    graph = pg.build_graph(root)
    assert pg.cycle_groups(graph) == [["p", "q", "r"]]
    # the same ring from each of its three nodes is reported once
    assert pg.cycles(graph) == [["p", "q", "r", "p"]]


def test_cli_prints_edges_cycle_and_long_file(cyclic):
    out = subprocess.run([sys.executable, str(TOOL), "--root", str(cyclic)],
                         capture_output=True, text=True, check=True).stdout
    assert "import cycles between packages: 1\n  a -> b -> a   (a/x.py, b/y.py)" in out
    assert "files over 600 lines: 1\n  c.py: 601\n" in out
    assert any(line.split() == ["a", "->", "b", "2", "a/x.py"] for line in out.splitlines())


def test_cli_dot_output_marks_the_cycle_edges_red(cyclic):
    out = subprocess.run([sys.executable, str(TOOL), "--root", str(cyclic), "--dot"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith('digraph "fake" {')
    assert '"a" -> "b" [label="2", color="red"];' in out
    assert '"b" -> "a" [label="1", color="red"];' in out
    assert '"b" -> "c" [label="1"];' in out
    assert out.rstrip().endswith("}")


def test_cli_reports_no_cycle_on_an_acyclic_tree(tmp_path):
    root = _write(tmp_path / "flat", {"__init__.py": "", "a.py": "import flat.b\n", "b.py": ""})
    out = subprocess.run([sys.executable, str(TOOL), "--root", str(root)],
                         capture_output=True, text=True, check=True).stdout
    assert "import cycles between packages: none" in out
    assert "files over 600 lines: none" in out


def test_cli_rejects_a_directory_that_is_no_package(tmp_path):
    res = subprocess.run([sys.executable, str(TOOL), "--root", str(tmp_path)],
                         capture_output=True, text=True)
    assert res.returncode == 2
    assert "no __init__.py" in res.stderr


@pytest.fixture
def lazy(tmp_path):
    """Package `lazy`: m imports n at module level and n imports m inside a function (a 2-file
    cycle); o imports m only under TYPE_CHECKING (no edge, so m -> o closes no cycle); p loads o
    with importlib at module level and a module by name inside a function."""
    return _write(tmp_path / "lazy", {
        "__init__.py": "",
        "m.py": ("from typing import TYPE_CHECKING\n"
                 "from lazy.n import g\n"
                 "if TYPE_CHECKING:\n"
                 "    from lazy.o import T\n"
                 "\n"
                 "def f():\n"
                 "    import json  # lazy: optional dependency (the [json] extra)\n"
                 "    from . import o\n"
                 "    import csv; s = '# lazy: inside a string is no comment'\n"),
        "n.py": "def g():\n    from lazy import m\n    return m\n",
        "o.py": ("import typing\n"
                 "if typing.TYPE_CHECKING:\n"
                 "    from lazy.m import f\n"
                 "else:\n"
                 "    f = None\n"),
        "p.py": ("import importlib\n"
                 "X = importlib.import_module('lazy.o')\n"
                 "def h(name):\n"
                 "    return importlib.import_module(name)  # lazy: plug-in named by the user\n"),
    })


def test_file_graph_counts_function_imports_but_not_type_checking_ones(pg, lazy):
    graph = pg.build_file_graph(lazy)
    assert graph.succ == {"lazy": [], "lazy.m": ["lazy.n", "lazy.o"], "lazy.n": ["lazy.m"],
                          "lazy.o": [], "lazy.p": ["lazy.o"]}
    assert graph.sites[("lazy.n", "lazy.m")] == "n.py:2"
    assert graph.sites[("lazy.m", "lazy.o")] == "m.py:8"
    assert pg.strongly_connected(graph.succ) == [["lazy.m", "lazy.n"]]
    assert pg.file_cycles(graph) == [["lazy.m", "lazy.n", "lazy.m"]]


def test_function_level_imports_are_listed_with_their_reasons(pg, lazy):
    found = [(imp.where, imp.text, imp.reason) for imp in pg.build_file_graph(lazy).function_imports]
    assert found == [
        ("m.py:7", "import json", "optional dependency (the [json] extra)"),
        ("m.py:8", "from . import o", "NO REASON"),
        ("m.py:9", "import csv", "NO REASON"),
        ("n.py:2", "from lazy import m", "NO REASON"),
        ("p.py:4", "importlib.import_module(name)", "plug-in named by the user"),
    ]


def test_decorators_and_defaults_run_outside_the_function(pg, tmp_path):
    root = _write(tmp_path / "deco", {
        "__init__.py": "",
        "a.py": ("import importlib\n"
                 "def f(x=importlib.import_module('deco.b')):\n"
                 "    return (lambda: __import__('deco.b'))\n"),
        "b.py": "",
    })
    graph = pg.build_file_graph(root)
    assert graph.succ["deco.a"] == ["deco.b"]
    assert [imp.where for imp in graph.function_imports] == ["a.py:3"]


def test_cli_prints_file_cycles_lazy_imports_and_the_summary(lazy):
    out = subprocess.run([sys.executable, str(TOOL), "--root", str(lazy)],
                         capture_output=True, text=True, check=True).stdout
    assert "file-level import cycles: 1\n  lazy.m -> lazy.n -> lazy.m   (m.py:2, n.py:2)\n" in out
    assert "  m.py:8  from . import o   [NO REASON]\n" in out
    assert "  p.py:4  importlib.import_module(name)   [plug-in named by the user]\n" in out
    # the package graph counts TYPE_CHECKING imports (a dependency all the same): m <-> n and
    # m <-> o are package cycles there, only m <-> n is a file cycle
    assert out.endswith("package cycles: 2\nfile cycles: 1\n"
                        "function-level imports: 5 (limit 25)\nfiles over 600 lines: 0\n")
