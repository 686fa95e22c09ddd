"""Print the import graph of src/lazytrain: package edges and cycles, file cycles, function-level
imports and long files.

Run from the repository root:

    python tools/package_graph.py                  # edges, cycles, lazy imports, long files
    python tools/package_graph.py --dot | dot -Tsvg > graph.svg
    python tools/package_graph.py --root path/to/pkg --max-lines 400

A node is a subpackage (`spec`, `planner`, ..., `cli`) or a top-level module (`config`,
`atomic`, ...); the package's own `__init__.py` is the node named after the package. An edge
`a -> b` means some file of `a` imports something of `b`; its weight is the number of import
sites (import statements naming something of `b`; lazy imports inside functions and
`TYPE_CHECKING` blocks count, since they are dependencies all the same), shown with the first
importing file in path order. A cycle is a strongly connected group of two or more nodes; for
each node of a group the shortest cycle through it is printed. Only the standard library is
used (`ast`, `tokenize`), so the script runs before the package is installed.

The file graph is finer: a node is one module (`lazytrain.planner.milp`), an edge an import
that runs (module level or inside a function; `TYPE_CHECKING` blocks do not run, so they do not
count) naming a module of the package, or `importlib.import_module` with a constant name. A
parent package's `__init__` that Python runs on the way is not an edge (every module would
otherwise close a loop with an `__init__` that re-exports it). A file cycle is a strongly
connected group of two or more modules.

A function-level import is an import statement, an `importlib.import_module(...)` or a
`__import__(...)` call inside a function (not under `if TYPE_CHECKING:`). Each should say why it
is not at module top with a trailing comment on its first line, `# lazy: <reason>`; one
without is listed as NO REASON. At most FUNCTION_IMPORT_LIMIT are allowed in the package.

The report ends with four summary lines: `package cycles: N`, `file cycles: N`,
`function-level imports: N (limit 25)`, `files over 600 lines: N`.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PACKAGE = ROOT / "src" / "lazytrain"
MAX_LINES = 600
"""Files over this many lines are listed (the style guide asks why at 600)."""
FUNCTION_IMPORT_LIMIT = 25
"""Most function-level imports the package may hold (each with a `# lazy:` reason)."""
LAZY_REASON = re.compile(r"#\s*lazy:\s*(?P<reason>\S.*?)\s*$")
"""The trailing comment that says why an import sits inside a function."""
NO_REASON = "NO REASON"


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
            mod = from_module(node, module=module, is_init=is_init)
            sites.append([f"{mod}.{alias.name}" for alias in node.names])
    return sites


def from_module(node: ast.ImportFrom, *, module: str, is_init: bool) -> str:
    """The absolute module a `from ... import` statement reads from.

    `from ..spec import model` in `lazytrain.planner.milp` -> `lazytrain.spec`; `from . import x`
    in the package `lazytrain.data` (its `__init__`, `is_init`) -> `lazytrain.data`.
    """
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_init else 0)
    base = ".".join(parts[:keep])
    return f"{base}.{node.module}" if node.module else base


def module_of(rel: Path, package: str) -> tuple[str, bool]:
    """(dotted module name, whether it is a package `__init__`) of a file given by its path
    relative to the package directory: `planner/milp.py` -> (`lazytrain.planner.milp`, False),
    `data/__init__.py` -> (`lazytrain.data`, True)."""
    module = ".".join((package, *rel.with_suffix("").parts))
    is_init = rel.name == "__init__.py"
    return (module.removesuffix(".__init__") if is_init else module), is_init


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
        module, is_init = module_of(rel, package)
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


def strongly_connected(succ: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected groups of two or more nodes of a directed graph, each sorted, in
    sorted order (Tarjan's algorithm). `succ` maps every node to its successors."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth <= node count: a few hundred modules
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

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return sorted(groups)


def cycle_groups(graph: Graph) -> list[list[str]]:
    """The strongly connected groups of two or more nodes, each sorted, in sorted order.

    Every import cycle between packages lies inside one group; a graph without cycles has none.
    """
    return strongly_connected(_successors(graph))


def shortest_cycle_in(succ: dict[str, list[str]], start: str) -> list[str]:
    """The shortest cycle through `start` as a node list that ends where it begins, or [].

    Breadth-first over `succ` in its order (sorted successors give a deterministic answer).
    """
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


def shortest_cycle(graph: Graph, start: str) -> list[str]:
    """The shortest cycle between packages through `start`, or [] (see `shortest_cycle_in`)."""
    return shortest_cycle_in(_successors(graph), start)


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


@dataclass(kw_only=True)
class FunctionImport:
    """One import that runs inside a function: where it is, what it says and why.

    `where` is `path:line` with the path relative to the package directory; `reason` is the
    text after `# lazy:` on the import's first line, or NO_REASON.
    """

    where: str
    text: str
    reason: str


@dataclass(kw_only=True)
class FileGraph:
    """The module-level import graph of one package directory.

    `succ` maps every module (dotted name) to the sorted modules it imports; `sites` maps an
    edge (importer, imported) to the `path:line` of its first import; `function_imports` lists
    every function-level import in path and line order.
    """

    succ: dict[str, list[str]] = field(default_factory=dict)
    sites: dict[tuple[str, str], str] = field(default_factory=dict)
    function_imports: list[FunctionImport] = field(default_factory=list)


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _is_import_call(node: ast.AST) -> bool:
    """`importlib.import_module(...)`, `import_module(...)` or `__import__(...)`."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return (func.attr == "import_module" and isinstance(func.value, ast.Name)
                and func.value.id == "importlib")
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def runtime_imports(tree: ast.Module) -> list[tuple[ast.AST, bool]]:
    """(node, inside a function) for every import statement and import call of a file that
    can run, in line order.

    The body of `if TYPE_CHECKING:` never runs and is skipped (its `else:` is kept). A
    function's decorators and default values run where the function is defined; only its body
    (and a lambda's) is inside the function.
    """
    out: list[tuple[ast.AST, bool]] = []
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, inside = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)) or _is_import_call(node):
            out.append((node, inside))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack += [(child, inside) for child in node.orelse]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            body = node.body if isinstance(node.body, list) else [node.body]
            outer = [child for child in ast.iter_child_nodes(node)
                     if not any(child is b for b in body)]
            stack += [(child, inside) for child in outer] + [(child, True) for child in body]
        else:
            stack += [(child, inside) for child in ast.iter_child_nodes(node)]
    return sorted(out, key=lambda item: (item[0].lineno, item[0].col_offset))


def _longest_module(name: str, modules: set[str]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def imported_modules(node: ast.AST, *, module: str, is_init: bool,
                     modules: set[str]) -> set[str]:
    """The modules of `modules` an import statement or import call names.

    `import a.b` -> `a.b`; `from a import b` -> `a.b` when that is a module, else `a`;
    `import_module("a.b")` -> `a.b` (a name that is not a string constant names nothing).
    """
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = from_module(node, module=module, is_init=is_init)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                 for alias in node.names]
    else:
        arg = node.args[0] if node.args else None
        is_name = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
        names = [arg.value] if is_name and not arg.value.startswith(".") else []
    found = {_longest_module(name, modules) for name in names}
    return {m for m in found if m is not None and m != module}


def _comments(text: str) -> dict[int, str]:
    """Line number -> the comment on that line (tokenize: a `#` inside a string is none)."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return {tok.start[0]: tok.string for tok in tokens if tok.type == tokenize.COMMENT}


def reason_of(comment: str) -> str:
    """The reason of a `# lazy: <reason>` comment, or NO_REASON."""
    match = LAZY_REASON.search(comment)
    return match.group("reason") if match else NO_REASON


def build_file_graph(package_dir: Path) -> FileGraph:
    """Read every `.py` file under `package_dir`: its module graph and function-level imports.

    Raises:
        FileNotFoundError: `package_dir` has no `__init__.py`.
        SyntaxError: a file does not parse (names the file).
    """
    if not (package_dir / "__init__.py").is_file():
        raise FileNotFoundError(f"{package_dir}: no __init__.py; pass --root a package directory")
    package = package_dir.name
    files = sorted(package_dir.rglob("*.py"))
    modules = {module_of(p.relative_to(package_dir), package)[0] for p in files}
    graph = FileGraph(succ={m: [] for m in sorted(modules)})
    for path in files:
        rel = path.relative_to(package_dir)
        module, is_init = module_of(rel, package)
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        comments = _comments(text)
        targets: set[str] = set()
        for node, inside in runtime_imports(tree):
            where = f"{rel}:{node.lineno}"
            if inside:
                reason = reason_of(comments.get(node.lineno, ""))
                graph.function_imports.append(
                    FunctionImport(where=where, text=ast.unparse(node), reason=reason))
            for dst in sorted(imported_modules(node, module=module, is_init=is_init,
                                               modules=modules)):
                graph.sites.setdefault((module, dst), where)
                targets.add(dst)
        graph.succ[module] = sorted(targets)
    return graph


def file_cycles(graph: FileGraph) -> list[list[str]]:
    """One shortest cycle per strongly connected group of modules, through the group's first
    module (sorted), ending where it begins."""
    return [shortest_cycle_in(graph.succ, group[0]) for group in strongly_connected(graph.succ)]


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


def format_text(graph: Graph, package_dir: Path, *, max_lines: int = MAX_LINES,
                files: FileGraph | None = None) -> str:
    """The plain-text report: package edges and cycles, file cycles, function-level imports,
    long files, then the four summary lines. `files` defaults to `build_file_graph`."""
    files = build_file_graph(package_dir) if files is None else files
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
    groups = strongly_connected(files.succ)
    lines += ["", f"file-level import cycles: {len(groups) or 'none'}"]
    for group in groups:
        cyc = shortest_cycle_in(files.succ, group[0])
        sites = ", ".join(files.sites[(a, b)] for a, b in zip(cyc, cyc[1:]))
        lines.append(f"  {' -> '.join(cyc)}   ({sites})")
        if len(group) > len(cyc) - 1:
            lines.append(f"    the group of {len(group)}: {', '.join(group)}")
    lazy = files.function_imports
    lines += ["", f"function-level imports: {len(lazy)} (limit {FUNCTION_IMPORT_LIMIT})"]
    lines += [f"  {imp.where}  {imp.text}   [{imp.reason}]" for imp in lazy]
    long = long_files(package_dir, max_lines=max_lines)
    lines += ["", f"files over {max_lines} lines: {len(long) or 'none'}"]
    lines += [f"  {path}: {count}" for path, count in long]
    lines += ["", f"package cycles: {len(found)}", f"file cycles: {len(groups)}",
              f"function-level imports: {len(lazy)} (limit {FUNCTION_IMPORT_LIMIT})",
              f"files over {max_lines} lines: {len(long)}"]
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
        files = None if args.dot else build_file_graph(args.root)
    except (FileNotFoundError, SyntaxError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = (format_dot(graph) if files is None
           else format_text(graph, args.root, max_lines=args.max_lines, files=files))
    sys.stdout.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
