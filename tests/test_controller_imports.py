"""The controller package's modules form no import cycle, and each imports on its own.

The graph counts every import of a module of the package: at the top, inside a function (a lazy
import such as switch.connect's of the session) and under TYPE_CHECKING, since a cycle through
any of them ties the modules together all the same."""

from __future__ import annotations

import ast
import subprocess
import sys

from cluster.local import REPO

PACKAGE = "passing_controller"
SOURCE = REPO / "controller" / PACKAGE


def modules() -> list[str]:
    return sorted(p.stem for p in SOURCE.glob("*.py") if p.stem != "__init__")


def imported(module: str) -> set[str]:
    """The package's modules that ``module`` imports, anywhere in it."""
    out: set[str] = set()
    for node in ast.walk(ast.parse((SOURCE / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:  # from . import a, b
                out |= {alias.name for alias in node.names}
            elif node.level == 1:  # from .a import b
                out.add(node.module.split(".")[0])
            elif node.level == 0 and node.module and node.module.split(".")[0] == PACKAGE:
                rest = node.module.split(".")[1:]
                out |= {rest[0]} if rest else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            out |= {alias.name.split(".")[1] for alias in node.names
                    if alias.name.startswith(PACKAGE + ".")}
    return out & set(modules())


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # module -> "open" while on the path, "done" after
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)) is not None:
                return found
        path.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle():
    graph = {m: imported(m) for m in modules()}
    assert "session" in graph["switch"] and "p4runtime" in graph["session"]  # the graph sees lazy imports
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def test_every_module_imports_on_its_own():
    """Each module first in a fresh interpreter, as a user's program would import it."""
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n" \
           f"    for m in [m for m in sys.modules if m.startswith({PACKAGE!r})]:\n" \
           "        del sys.modules[m]\n" \
           f"    importlib.import_module({PACKAGE!r} + '.' + name)\n"
    done = subprocess.run([sys.executable, "-c", code, *modules()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
