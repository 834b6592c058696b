"""The shape of the Python code (issue 49): the host package (passing, with its subpackages) and the controller
package form no import cycle, each controller module imports on its own, and no module of host/, controller/,
protocol/, bench/ or p4/ passes 500 lines (a longer one holds several concerns: split it by them, as the host
package was split).

The import graph counts every import of a module of the package: at the top, inside a function (a lazy
import such as switch.connect's of the session) and under TYPE_CHECKING, since a cycle through any of them
ties the modules together all the same. ``from package import name`` is an edge to the module ``name`` where
there is one (``from .. import wire``), else to the package itself (its ``__init__``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.local import REPO

PACKAGES = {"passing": REPO / "host" / "passing", "passing_controller": REPO / "controller" / "passing_controller"}
MAX_LINES = 500
SIZED = ("host", "controller", "protocol", "bench", "p4")  # where no Python module passes MAX_LINES


def modules(package: str) -> dict[str, Path]:
    """Every module of ``package`` by its dotted name (a package's ``__init__`` by the package's)."""
    root = PACKAGES[package]
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports, anywhere in it."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]  # its package
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            source = here[:len(here) - node.level + 1] if node.level else []
            source += node.module.split(".") if node.module else []
            submodules = {".".join([*source, alias.name]) for alias in node.names} & known
            out |= submodules or {".".join(source)}
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
    return (out & known) - {name}


def graph(package: str) -> dict[str, set[str]]:
    found = modules(package)
    return {name: imported(name, path, set(found)) for name, path in found.items()}


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


def test_the_graph_sees_every_kind_of_import():
    controller, host = graph("passing_controller"), graph("passing")
    assert "passing_controller.session" in controller["passing_controller.switch"]  # lazy, in a function
    assert "passing_controller.p4runtime" in controller["passing_controller.session"]
    assert "passing.wire" in host["passing.aggregator.engine"]  # from .. import wire
    assert "passing.aggregator.server" in host["passing.cli"]  # from .aggregator.server import ...
    assert "passing.torch.backend" in host["passing.torch"]  # a package's __init__ and its own modules
    assert "passing" not in host["passing.aggregator.engine"]  # importing a sibling is no edge to the package


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_the_package_has_no_import_cycle(package):
    found = cycle(graph(package))
    assert found is None, " -> ".join(found or [])


def test_every_controller_module_imports_on_its_own():
    """Each module first in a fresh interpreter, as a user's program would import it."""
    package = "passing_controller"
    names = sorted(name for name in modules(package) if name != package)
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n" \
           f"    for m in [m for m in sys.modules if m.startswith({package!r})]:\n" \
           "        del sys.modules[m]\n" \
           "    importlib.import_module(name)\n"
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def python_files() -> list[Path]:
    """The Python files of SIZED that git tracks, or would (new ones, not ignored)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *SIZED],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / name for name in listed if name.endswith(".py") and (REPO / name).is_file()]


def test_no_module_passes_500_lines():
    files = python_files()
    assert any(f.match("host/passing/torch/*.py") for f in files) and any(f.match("bench/*.py") for f in files)
    long = {str(f.relative_to(REPO)): n for f in files if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules past {MAX_LINES} lines (split them by concern): {long}"
