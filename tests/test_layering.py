"""The import layering of docs/architecture.md, checked on the source: every graphopt import
(top-level, inside functions, type-only) goes to the module's own group or to a group its row
allows, and no two modules import each other through any chain."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"tests", "examples", "build", "docs", ".venv", "__pycache__"}


def layers() -> list[tuple[list[str], list[str]]]:
    """(the group's module prefixes, the prefixes it may import) per row of the Layers table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        rows.append((re.findall(r"`([\w.]+)`", cells[0]), re.findall(r"`([\w.]+)`", cells[2])))
    return rows


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if SKIP & set(rel.parts):
            continue
        parts = ["graphopt", *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The graphopt modules ``name`` imports anywhere in its file."""
    out = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
                break
    return out


def group_of(module: str, rows) -> int:
    """The row whose prefix matches ``module`` most closely."""
    best, length = -1, -1
    for i, (members, _) in enumerate(rows):
        for m in members:
            if (module == m or module.startswith(m + ".")) and len(m) > length:
                best, length = i, len(m)
    return best


def under(module: str, prefixes: list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def test_the_table_names_every_module():
    rows = layers()
    assert len(rows) >= 8
    unplaced = [m for m in modules() if group_of(m, rows) < 0]
    assert not unplaced, f"modules in no group of docs/architecture.md: {unplaced}"


def against_the_layers(edges: dict[str, set[str]], rows) -> list[str]:
    """The imports in ``edges`` that the table's rows do not allow."""
    wrong = []
    for name, targets in edges.items():
        own = group_of(name, rows)
        _, allowed = rows[own]
        for t in sorted(targets):
            if group_of(t, rows) != own and not under(t, allowed):
                wrong.append(f"{name} imports {t}")
    return wrong


def test_every_import_follows_the_layers():
    wrong = against_the_layers(graph(), layers())
    assert not wrong, "imports against docs/architecture.md:\n" + "\n".join(wrong)


def test_an_import_against_the_layers_is_found(tmp_path):
    """The checker itself: the IR importing the bundle writer or the command line, lazily inside
    a function, is named; the rewrite engine importing the IR is not."""
    bad = tmp_path / "ir.py"
    lazy = "def f():\n    from graphopt.targets import bundle\n    from ...cli import app\n"
    bad.write_text(lazy)
    known = set(modules())
    edges = {"graphopt.opt.graph.ir": imports("graphopt.opt.graph.ir", bad, known)}
    edges["graphopt.opt.rewrite.engine"] = {"graphopt.opt.graph.ir"}
    assert against_the_layers(edges, layers()) == [
        "graphopt.opt.graph.ir imports graphopt.cli",
        "graphopt.opt.graph.ir imports graphopt.targets.bundle",
    ]


def test_no_import_circles():
    edges = graph()
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_core_does_not_reach_out():
    """The core's own promise, whatever the table says: no import of passes, rules, targets or
    the command line from opt."""
    out = [
        f"{name} imports {t}"
        for name, targets in graph().items()
        if under(name, ["graphopt.opt"])
        for t in targets
        if not under(t, ["graphopt.opt"]) and t != "graphopt"
    ]
    assert not out, out
