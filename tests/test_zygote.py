"""The test harness's zygote (tests/zygote.py) stands in for subprocess.Popen: the same argv,
output, exit codes and signals as a process started afresh (the environment: every torch rank
reads its RANK from it); a console script run as its entry point, a service's stdout read while it
runs, a child put in a network namespace."""

from __future__ import annotations

import json
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


def test_a_console_script_runs_as_its_entry_point(popen, tmp_path):
    from cluster.local import BIN

    p = popen([str(BIN / "passing-controller"), "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=10)
    assert p.returncode == 0 and out.startswith("usage: passing-controller")
    p = popen([str(BIN / "passing-ctl"), "--keys", str(tmp_path / "k"), "keygen"], stdout=subprocess.PIPE,
              stderr=subprocess.PIPE, text=True)
    p.communicate(timeout=10)
    assert p.returncode == 0 and (tmp_path / "k" / "worker.key_secret").exists()


def test_a_live_stdout_is_read_while_the_child_runs(popen):
    p = popen([sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen", "127.0.0.1:0", "--control",
               "none"], stdout=subprocess.PIPE, text=True, live_stdout=True)
    assert json.loads(p.stdout.readline())["event"] == "ready" and p.poll() is None
    p.terminate()
    out, err = p.communicate(timeout=10)
    assert p.returncode == 0 and json.loads(out)["event"] == "stopped" and err is None


def test_a_child_runs_in_the_network_namespace_it_is_given(popen):
    from cluster import netns

    why = netns.available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    with netns.EmulatedNetwork(["h"]) as net:
        host = net.hosts["h"]
        argv = [sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen", f"{host.ip}:0", "--control",
                "none"]
        inside = popen(argv, stdout=subprocess.PIPE, text=True, live_stdout=True, netns=host.namespace)
        assert json.loads(inside.stdout.readline())["data"].startswith(host.ip)  # the address exists there only
        inside.terminate()
        assert inside.wait(10) == 0
        outside = popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, err = outside.communicate(timeout=10)
        assert outside.returncode != 0 and "assign requested address" in err, err
