"""Every documented make target that runs the project's code runs it with the venv's Python, set up first.

A fresh machine has no `passing` in its system Python: `make p4-mutants` once ran `python3 -m tests...` and
failed there with ModuleNotFoundError. Each target named in README.md or docs/ is dry-run (`make -n`) as on a
machine whose venv is out of date (`-W host/setup.py`), and every Python its commands start is held to the
rule: the venv's, after the set-up recipe; or another one (the Makefile's PYTHON) that runs only the standard
library (making the venv; the P4 tools' scripts, which run where PASSING need not be installed).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from cluster.local import REPO

VENV_PYTHON = ".venv/bin/python"
# an interpreter and what it runs: `-m module` or a script
PYTHON_RUN = re.compile(r"(?:^|[\s;|&(])(\S*python[0-9.]*)\s+(?:-m\s+(\S+)|(\S+\.py)\b)")


def documented_targets() -> list[str]:
    """The Makefile's targets that README.md or a page of docs/ tells the reader to run."""
    text = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    named = set(re.findall(r"\bmake ([a-z][a-z0-9-]*)", text))
    defined = set(re.findall(r"^([a-z][a-z0-9-]*):", (REPO / "Makefile").read_text(), re.MULTILINE))
    return sorted(named & defined)


def dry_run(target: str) -> list[str]:
    """The commands `make TARGET` runs where the venv is out of date (its set-up recipe included)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # under make test
    done = subprocess.run(["make", "--no-print-directory", "-n", "-W", "host/setup.py", target,
                           "PIP_FIND_LINKS_ARGS="], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"make -n {target}: {done.stderr[-2000:]}"
    return done.stdout.splitlines()


def standard_library_only(module: str | None, script: str | None) -> bool:
    """Whether ``-m module`` or ``script`` (a path in the repository) needs nothing but the standard library: a
    script's imports are the standard library's or modules beside it that need nothing more."""
    if module is not None:
        return module.split(".")[0] in sys.stdlib_module_names
    path = REPO / script
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module.split(".")[0] if node.level == 0 and node.module else ".")
    beside = {name for name in names if (path.parent / f"{name}.py").is_file()}
    return names - beside <= set(sys.stdlib_module_names) | {"__future__"} and all(
        standard_library_only(None, str((path.parent / f"{name}.py").relative_to(REPO))) for name in beside)


def violations(commands: list[str], setup: list[str]) -> list[str]:
    """The commands that break the rule (module docstring); ``setup`` is the set-up recipe's commands."""
    set_up_first = commands[:len(setup)] == setup
    out = []
    for line in commands[len(setup):] if set_up_first else commands:
        for python, module, script in PYTHON_RUN.findall(line):
            what = f"-m {module}" if module else script
            if python == VENV_PYTHON and not set_up_first:
                out.append(f"{python} {what}: the venv's Python, not set up first ($(STAMP) prerequisite)")
            elif python != VENV_PYTHON and not standard_library_only(module or None, script or None):
                out.append(f"{python} {what}: the project's code outside the venv (use $(PY))")
    return out


def test_the_rule_sees_a_system_python_running_project_code():
    """The checker itself: the failure this test is for, and what it allows."""
    setup = dry_run("setup")
    assert any(VENV_PYTHON in line for line in setup) and setup[-1].startswith("touch ")
    assert violations(["python3 -m tests.conformance.mutants"], setup)
    assert violations([f"{VENV_PYTHON} -m tests.conformance.mutants"], setup)  # no set-up before it
    assert not violations([*setup, f"{VENV_PYTHON} -m tests.conformance.mutants"], setup)
    assert not violations(["python3 p4/testgen_vectors.py check", "python3 -m venv .venv"], setup)
    assert standard_library_only(None, "p4/testgen_vectors.py")  # with the modules beside it it imports
    assert violations(["python3 bench/core.py"], setup)  # imports numpy and passing


def test_documented_targets_are_found():
    targets = documented_targets()
    assert {"demo", "test", "test-all", "p4-mutants", "p4-testgen", "p4-tofino", "sanitize"} <= set(targets)


@pytest.mark.parametrize("target", documented_targets())
def test_a_documented_target_runs_project_code_in_the_venv(target):
    assert violations(dry_run(target), dry_run("setup")) == []
