"""Check the product's import graph: no import circles, no import against the layers.

setup.cfg's `package_dir` installs each top-level role folder as `rollflash.<folder>`
(`learner/step/batch.py` is `rollflash.learner.step.batch`); this script reads that mapping (as
scripts/typecheck.py does), parses every product file with the stdlib `ast` and draws an edge for
each `import rollflash...` / `from rollflash... import ...` (relative imports resolved), at module
level, inside a function or under `if TYPE_CHECKING:` alike: a lazy import only moves a circle to
run time, and a module that names another's type for its parameters depends on it as much (a
Protocol or the typed part it reads breaks such a circle). An import of a name from a package is
an edge to that package's `__init__`; an import of a module is an edge to the module.

The layers (MAY_IMPORT): which folders each top-level folder may import. Run by `make lint` and by
tests/unit/test_import_graph.py; prints one line per circle or breach and exits 1 if any.

    .venv/bin/python scripts/import_graph.py
"""

from __future__ import annotations

import ast
import configparser
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "rollflash"

# Each folder and the other folders it may import: the "may import" column of docs/ARCHITECTURE.md.
# Every folder may import the namespace's own modules (rollflash/: the errors, the HTTP guard),
# which import no folder; nothing but rollctl/ imports rollctl/, the commands.
MAY_IMPORT: dict[str, tuple[tuple[str, ...], str]] = {
    "algos": ((), "pure tensor math: torch only"),
    "envs": ((), "tasks and rewards: the stdlib, no torch"),
    "broker": ((), "the process boundary every side imports"),
    "generators": (("envs", "broker"), "never the learner: they meet only through broker/"),
    "learner": (
        ("algos", "broker", "envs"),
        "never the generators: they meet only through broker/",
    ),
    "rollctl": (("algos", "envs", "broker", "generators", "learner"), "the commands"),
    PACKAGE: ((), "importable by every folder"),
}


def package_dirs(setup_cfg: Path) -> dict[str, Path]:
    """`rollflash.<folder>` -> its folder, as setup.cfg's `package_dir` maps them."""
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg)
    root = setup_cfg.parent
    dirs = {PACKAGE: root / PACKAGE}
    for line in cfg["options"]["package_dir"].strip().splitlines():
        module, _, folder = (part.strip() for part in line.partition("="))
        dirs[module] = root / folder
    return dirs


def modules(dirs: dict[str, Path]) -> dict[str, Path]:
    """Every product module's installed name -> its file (a package's name -> its __init__.py)."""
    found = {}
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int


def _named(module: str, known: dict[str, Path]) -> str | None:
    """The product module `module` is, or the nearest package above it that is one."""
    while module and module not in known:
        module = module.rpartition(".")[0]
    return module or None


def _targets(node: ast.Import | ast.ImportFrom, name: str, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's package (a package's __init__ is its own)
        package = name if known[name].name == "__init__.py" else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    # `from pkg import mod` imports the module pkg.mod; `from pkg import name` runs pkg's __init__
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def edges(known: dict[str, Path]) -> list[Edge]:
    """Every import of a product module by a product module."""
    found = []
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _targets(node, name, known):
                resolved = _named(target, known) if target.startswith(PACKAGE) else None
                if resolved is not None and resolved != name and resolved != PACKAGE:
                    found.append(Edge(name, resolved, node.lineno))
    return found


def circles(found: list[Edge]) -> list[list[str]]:
    """Each group of modules that import each other, directly or not (Tarjan's strongly
    connected components), as one shortest circle through its first member."""
    graph: dict[str, set[str]] = {}
    for e in found:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                groups.append(_shortest_circle(sorted(group), graph))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def _shortest_circle(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path from group[0] back to itself inside the group (breadth first)."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{group} is not a circle")


def _folder(module: str, dirs: dict[str, Path]) -> str:
    """The role folder `module` is in (`rollflash` for the namespace's own modules)."""
    folder = ".".join(module.split(".")[:2])
    return folder.split(".")[1] if folder in dirs and folder != PACKAGE else PACKAGE


def breaches(found: list[Edge], known: dict[str, Path], dirs: dict[str, Path]) -> list[str]:
    """One line per import of a folder that MAY_IMPORT does not allow."""
    out = []
    for e in found:
        src, dst = _folder(e.source, dirs), _folder(e.target, dirs)
        allowed, why = MAY_IMPORT.get(src, ((), "a folder the layers do not name"))
        if src != dst and dst != PACKAGE and dst not in allowed:
            may = ", ".join(f"{f}/" for f in allowed) or "no other folder"
            out.append(
                f"{known[e.source]}:{e.line}: {e.source} imports {e.target} "
                f"({src}/ may import {may}: {why})"
            )
    return out


def problems(setup_cfg: Path) -> list[str]:
    """Every circle and every breach of the layers in the tree setup.cfg describes."""
    dirs = package_dirs(setup_cfg)
    known = modules(dirs)
    found = edges(known)
    lines = ["import circle: " + " -> ".join(circle) for circle in circles(found)]
    return lines + breaches(found, known, dirs)


def main() -> int:
    found = problems(ROOT / "setup.cfg")
    for line in found:
        print(line)
    if found:
        print(f"import_graph: {len(found)} problems", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
