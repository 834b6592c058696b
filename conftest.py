"""The whole suite's control-plane keys (docs/security.md): one key directory made for the test
session, found by every process the tests start through $PASSING_KEYS, and a job secret for
the workers that join through a controller ($PASSING_JOB_SECRET).

And the `slow` marker's note: `make test` runs ``pytest -m "not slow"``; the summary then says
how many slow tests (soaks, campaigns) it left out and how to run them."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import pytest


def pytest_configure(config):
    from passing_controller.keys import keygen

    directory = Path(tempfile.mkdtemp(prefix="passing-test-keys-"))
    keygen(directory / "keys")
    config._passing_keys = directory
    os.environ["PASSING_KEYS"] = str(directory / "keys")
    os.environ.setdefault("PASSING_JOB_SECRET", os.urandom(16).hex())


# Modules that take longest, scheduled first (a stable sort, so each module keeps its own order): the two
# xdist workers then end together instead of one of them running a long torch module alone at the end.
LONG_FIRST = ("bmv2_tests/", "tests/test_torch_", "tests/test_control_security.py", "tests/test_native_engine.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        return next((i for i, prefix in enumerate(LONG_FIRST) if item.nodeid.startswith(prefix)), len(LONG_FIRST))

    items.sort(key=rank)


def pytest_itemcollected(item):
    """Groups for pytest-xdist's loadgroup (the Makefile runs two workers): a module's tests stay on one
    worker, so its module-scoped services start once, and the BMv2 suite is one group, one Mininet at a time.
    Marked as each item is collected: xdist reads the groups in its own pytest_collection_modifyitems."""
    group = "bmv2" if item.nodeid.startswith("bmv2_tests/") else item.nodeid.split("::")[0]
    item.add_marker(pytest.mark.xdist_group(group))


def pytest_deselected(items):
    if items:
        config = items[0].config
        config._passing_slow_deselected = getattr(config, "_passing_slow_deselected", 0) + sum(
            1 for item in items if item.get_closest_marker("slow"))


@pytest.hookimpl(trylast=True)  # after the durations, next to pytest's own summary
def pytest_terminal_summary(terminalreporter, config):
    count = getattr(config, "_passing_slow_deselected", 0)
    if count:
        terminalreporter.write_line(f"{count} slow tests (soaks, campaigns) not run: `make test-all` runs everything "
                                    "(CI does), `pytest -m slow` only them", yellow=True)


def pytest_sessionfinish(session, exitstatus):
    session.config._passing_exitstatus = int(exitstatus)
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: the note is the controller's to print
        session.config.workeroutput["slow_deselected"] = getattr(session.config, "_passing_slow_deselected", 0)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: every worker collected (and left out) the same slow tests."""
    count = getattr(node, "workeroutput", {}).get("slow_deselected", 0)
    node.config._passing_slow_deselected = max(getattr(node.config, "_passing_slow_deselected", 0), count)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    directory = getattr(config, "_passing_keys", None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
    # A test that failed half-way can leave a server thread running, and the interpreter would wait for
    # it forever at exit (CI once hung there for its whole limit). Name the threads and leave with the
    # session's own status: the failure that leaked them is already reported.
    leaked = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if leaked:
        sys.stderr.write(f"conftest: {len(leaked)} thread(s) still running at exit, not waited for: "
                         f"{', '.join(t.name for t in leaked)}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(getattr(config, "_passing_exitstatus", 1))
