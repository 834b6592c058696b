"""backend "passing" with no controller configured: rank 0 runs an embedded controller and
software aggregator; with torchrun on one machine and across network namespaces. A configured
controller that does not answer is still an error (never a silent fallback)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")

from cluster import netns  # noqa: E402
from cluster.local import BIN, REPO, collect, free_tcp_port, launch_ranks  # noqa: E402

WORKER = [sys.executable, "-m", "tests.torch_worker"]
ANNOUNCEMENT = "no controller configured (PASSING_CONTROLLER unset, no pg_options.controller)"


def without_controller(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != "PASSING_CONTROLLER"}


def clean_env() -> dict[str, str]:
    return {**without_controller(dict(os.environ)), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
            "PASSING_TIMEOUT": "20", "PASSING_REPORT_INTERVAL": "0.2"}


def check_embedded(reports: list[dict], address: str) -> None:
    assert len(reports) == 4
    for r in reports:
        assert r["sum_ok"] and r["embedded_mode"] and r["mode"] == "ps", r
        assert "embedded controller in rank 0" in r["reason"], r
        assert r["controller"].startswith(f"tcp://{address}:"), r
    rank0 = next(r for r in reports if r["rank"] == 0)
    assert rank0["reported_calls"] == 1, rank0  # every rank's periodic report reached the controller
    assert rank0["port_free"] and rank0["threads_left"] == [], rank0  # stopped with the process group


@pytest.mark.timeout(180)
def test_torchrun_standalone_needs_nothing_else():
    """`torchrun --standalone --nproc-per-node 4 train.py`, nothing configured."""
    proc = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4", "-m", "tests.torch_worker",
                           "embedded"], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [__import__("json").loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    check_embedded(reports, "127.0.0.1")
    assert proc.stderr.count(ANNOUNCEMENT) == 1, proc.stderr[-3000:]  # said once, by rank 0


@pytest.mark.timeout(180)
def test_across_network_namespaces():
    """2 servers × 2 ranks, each server a network namespace: the others reach rank 0 at its server's address."""
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    servers = ["server0", "server1"]
    with netns.EmulatedNetwork(servers) as net:
        procs = launch_ranks([*WORKER, "embedded"], 2, 2, {"PASSING_TIMEOUT": "20", "PASSING_REPORT_INTERVAL": "0.2"},
                             popen_for_server=lambda s: lambda argv, env, **kw: net.popen(
                                 servers[s], argv, env=without_controller(env), **kw),
                             env_for_server=lambda s: {"GLOO_SOCKET_IFNAME": "eth0"},
                             master_host=net.hosts["server0"].ip)
        outcomes = collect(procs, 150)
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    reports = [report for _, report, _ in outcomes]
    check_embedded(reports, net.hosts["server0"].ip)
    assert {r["host"] for r in reports} == {net.hosts[s].ip for s in servers}


@pytest.mark.timeout(120)
def test_a_configured_controller_that_does_not_answer_is_an_error():
    silent = f"tcp://127.0.0.1:{free_tcp_port()}"
    procs = launch_ranks([*WORKER, "embedded"], 1, 1, {"PASSING_CONTROLLER": silent, "PASSING_JOIN_TIMEOUT": "1"})
    [(rc, report, stderr)] = collect(procs, 100)
    assert rc != 0 and report is None
    assert f"controller {silent} did not answer 'join'" in stderr, stderr[-3000:]
    assert ANNOUNCEMENT not in stderr
