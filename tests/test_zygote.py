"""The test harness's zygote (tests/zygote.py) stands in for subprocess.Popen: the same argv,
output, exit codes and signals as a process started afresh (the environment: every torch rank
reads its RANK from it)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.zygote import CLI_PRELOAD, shared


@pytest.fixture(scope="module")
def popen():
    return shared(CLI_PRELOAD).popen


def test_argv_output_and_exit_code_are_the_childs_own(popen):
    p = popen([sys.executable, "-m", "passing.cli", "nonsense"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
              text=True)
    out, err = p.communicate(timeout=10)
    assert (p.returncode, out) == (2, "") and err.startswith("usage: python -m passing.cli")
    p = popen([sys.executable, "-m", "passing.cli", "allreduce", "--help"], stdout=subprocess.PIPE,
              stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=10)
    assert p.returncode == 0 and out.startswith("usage: passing-allreduce") and err == ""


def test_a_signal_ends_it_as_a_popen_shows_it(popen):
    p = popen([sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen", "127.0.0.1:0", "--control",
               "none"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with pytest.raises(subprocess.TimeoutExpired):  # it serves until told otherwise
        p.wait(0.5)
    assert p.poll() is None
    p.send_signal(signal.SIGKILL)
    assert p.wait(10) == -signal.SIGKILL
    p.communicate(timeout=1)
