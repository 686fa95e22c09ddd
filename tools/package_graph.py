"""Print the import graph between the packages of src/lazytrain, its cycles and its long files.

Run from the repository root:

    python tools/package_graph.py                  # edges, cycles, files over 600 lines
    python tools/package_graph.py --dot | dot -Tsvg > graph.svg
    python tools/package_graph.py --root path/to/pkg --max-lines 400

A node is a subpackage (`spec`, `planner`, ..., `cli`) or a top-level module (`config`,
`atomic`, ...); the package's own `__init__.py` is the node named after the package. An edge
`a -> b` means some file of `a` imports something of `b`; its weight is the number of import
sites (import statements naming something of `b`; lazy imports inside functions and
`TYPE_CHECKING` blocks count, since they are dependencies all the same), shown with the first
importing file in path order. A cycle is a strongly connected group of two or more nodes; for
each node of a group the shortest cycle through it is printed. Only the standard library is
used (`ast`), so the script runs before the package is installed.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PACKAGE = ROOT / "src" / "lazytrain"
MAX_LINES = 600
"""Files over this many lines are listed (the style guide asks why at 600)."""


@dataclass(kw_only=True)
class Edge:
    """Imports from node `src` into node `dst`: how many import statements and the first file
    (in path order) that has one."""

    src: str
    dst: str
    sites: int = 0
    example: str = ""


@dataclass(kw_only=True)
class Graph:
    """The package graph of one package directory.

    `nodes` are sorted node names; `edges` maps (src, dst) to its Edge; `files` is the number
    of `.py` files read.
    """

    package: str
    nodes: list[str] = field(default_factory=list)
    edges: dict[tuple[str, str], Edge] = field(default_factory=dict)
    files: int = 0


def node_of(rel: Path, package: str) -> str:
    """The node a file belongs to, from its path relative to the package directory.

    `planner/milp.py` -> `planner`; `config.py` -> `config`; `__init__.py` -> the package name.
    """
    if len(rel.parts) > 1:
        return rel.parts[0]
    return package if rel.stem == "__init__" else rel.stem


def import_sites(tree: ast.Module, *, module: str, is_init: bool) -> list[list[str]]:
    """The dotted names imported by one file, one list per import statement.

    Args:
        tree: the parsed file.
        module: the file's dotted module name (`lazytrain.planner.milp`); resolves relative
            imports (`from ..spec import model` inside `lazytrain.planner.milp` ->
            `lazytrain.spec.model`).
        is_init: whether the file is a package `__init__.py` (relative imports then start from
            the package itself, not its parent).

    Returns:
        For `import a.b, c` the list `[a.b, c]`; for `from a import x, y` the list
        `[a.x, a.y]` (each may be a submodule or an attribute: `node_of_name` only needs the
        prefix). Statements inside functions and `if TYPE_CHECKING:` blocks are included.
    """
    sites: list[list[str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            sites.append([alias.name for alias in node.names])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_init else 0)
                base = ".".join(parts[:keep])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            sites.append([f"{mod}.{alias.name}" for alias in node.names])
    return sites


def node_of_name(name: str, *, package: str, nodes: set[str]) -> str | None:
    """The node a dotted import name lands in, or None when it is outside the package.

    `lazytrain.runtime.engine.Engine` -> `runtime`; `lazytrain.__version__` -> `lazytrain`
    (the package's `__init__`); `torch.nn` -> None.
    """
    parts = name.split(".")
    if parts[0] != package:
        return None
    if len(parts) > 1 and parts[1] in nodes:
        return parts[1]
    return package


def build_graph(package_dir: Path) -> Graph:
    """Read every `.py` file under `package_dir` and return the graph between its nodes.

    Args:
        package_dir: the package directory (`src/lazytrain`); its name is the import name.

    Returns:
        The Graph; self-imports (a node importing itself) are not edges.

    Raises:
        FileNotFoundError: `package_dir` has no `__init__.py`.
        SyntaxError: a file does not parse (names the file).
    """
    if not (package_dir / "__init__.py").is_file():
        raise FileNotFoundError(f"{package_dir}: no __init__.py; pass --root a package directory")
    package = package_dir.name
    files = sorted(package_dir.rglob("*.py"))
    nodes = {node_of(p.relative_to(package_dir), package) for p in files}
    graph = Graph(package=package, nodes=sorted(nodes), files=len(files))
    for path in files:
        rel = path.relative_to(package_dir)
        src = node_of(rel, package)
        module = ".".join((package, *rel.with_suffix("").parts))
        is_init = rel.name == "__init__.py"
        if is_init:
            module = module.removesuffix(".__init__")
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for names in import_sites(tree, module=module, is_init=is_init):
            targets = {node_of_name(name, package=package, nodes=nodes) for name in names}
            for dst in sorted(targets - {None, src}):
                edge = graph.edges.setdefault((src, dst), Edge(src=src, dst=dst, example=str(rel)))
                edge.sites += 1
    return graph


def _successors(graph: Graph) -> dict[str, list[str]]:
    succ: dict[str, list[str]] = {n: [] for n in graph.nodes}
    for src, dst in sorted(graph.edges):
        succ[src].append(dst)
    return succ


def cycle_groups(graph: Graph) -> list[list[str]]:
    """The strongly connected groups of two or more nodes, each sorted, in sorted order.

    Every import cycle between packages lies inside one group; a graph without cycles has none.
    """
    succ = _successors(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph has a dozen nodes
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in graph.nodes:
        if v not in index:
            visit(v)
    return sorted(groups)


def shortest_cycle(graph: Graph, start: str) -> list[str]:
    """The shortest cycle through `start` as a node list that ends where it begins, or [].

    Breadth-first over the edges, neighbours in sorted order, so the answer is deterministic.
    """
    succ = _successors(graph)
    parent: dict[str, str] = {}
    queue = deque([start])
    seen = {start}
    while queue:
        v = queue.popleft()
        for w in succ[v]:
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if w not in seen:
                seen.add(w)
                parent[w] = v
                queue.append(w)
    return []


def cycles(graph: Graph) -> list[list[str]]:
    """One shortest cycle through each node of each cycle group, without repeats.

    A cycle is reported once however it is rotated: `[a, b, a]` and `[b, a, b]` are the same.
    """
    out: list[list[str]] = []
    seen: set[frozenset[tuple[str, str]]] = set()
    for group in cycle_groups(graph):
        for node in group:
            cyc = shortest_cycle(graph, node)
            key = frozenset(zip(cyc, cyc[1:]))
            if cyc and key not in seen:
                seen.add(key)
                out.append(cyc)
    return out


def long_files(package_dir: Path, *, max_lines: int = MAX_LINES) -> list[tuple[str, int]]:
    """(path relative to `package_dir`, line count) of every `.py` file over `max_lines`.

    Sorted longest first, then by path.
    """
    out = []
    for path in sorted(package_dir.rglob("*.py")):
        count = len(path.read_text(encoding="utf-8").splitlines())
        if count > max_lines:
            out.append((str(path.relative_to(package_dir)), count))
    return sorted(out, key=lambda item: (-item[1], item[0]))


def format_text(graph: Graph, package_dir: Path, *, max_lines: int = MAX_LINES) -> str:
    """The plain-text report: edges, cycles, long files."""
    lines = [f"package graph of {graph.package} ({graph.files} files, {len(graph.nodes)} nodes, "
             f"{len(graph.edges)} edges)", "", "edges (importer -> imported: sites, example):"]
    width = max((len(f"{s} -> {d}") for s, d in graph.edges), default=0)
    for (src, dst), edge in sorted(graph.edges.items()):
        lines.append(f"  {f'{src} -> {dst}':<{width}}  {edge.sites:>3}  {edge.example}")
    found = cycles(graph)
    lines += ["", f"import cycles between packages: {len(found) or 'none'}"]
    for cyc in found:
        sites = ", ".join(f"{graph.edges[(a, b)].example}" for a, b in zip(cyc, cyc[1:]))
        lines.append(f"  {' -> '.join(cyc)}   ({sites})")
    long = long_files(package_dir, max_lines=max_lines)
    lines += ["", f"files over {max_lines} lines: {len(long) or 'none'}"]
    lines += [f"  {path}: {count}" for path, count in long]
    return "\n".join(lines) + "\n"


def format_dot(graph: Graph) -> str:
    """Graphviz text: one node per package, edges labelled with their site counts; the edges
    of a cycle are red."""
    in_cycle = {(a, b) for cyc in cycles(graph) for a, b in zip(cyc, cyc[1:])}
    lines = [f'digraph "{graph.package}" {{', "  rankdir=BT;", "  node [shape=box];"]
    lines += [f'  "{n}";' for n in graph.nodes]
    for (src, dst), edge in sorted(graph.edges.items()):
        color = ', color="red"' if (src, dst) in in_cycle else ""
        lines.append(f'  "{src}" -> "{dst}" [label="{edge.sites}"{color}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=DEFAULT_PACKAGE,
                        help="package directory to read (default: src/lazytrain)")
    parser.add_argument("--dot", action="store_true", help="print Graphviz text instead")
    parser.add_argument("--max-lines", type=int, default=MAX_LINES,
                        help=f"list files over this many lines (default: {MAX_LINES})")
    args = parser.parse_args(argv)
    if args.max_lines < 1:
        parser.error(f"--max-lines must be >= 1; got {args.max_lines}")
    try:
        graph = build_graph(args.root)
    except (FileNotFoundError, SyntaxError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = format_dot(graph) if args.dot else format_text(graph, args.root, max_lines=args.max_lines)
    sys.stdout.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
