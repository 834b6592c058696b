"""Training survives the loss of its aggregator (docs/reliability.md): DDP over backend "passing"
in 2 servers x 2 rank processes, the software aggregator SIGKILLed mid-training. With a second
PS the groups move to it; with none left, the process groups carry on over gloo. Either way the
ranks' parameters stay identical at every check and the training ends as a fault-free one does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")
pytest.importorskip("sklearn", reason="scikit-learn is not installed (pip install -e 'host[test]')")
pytestmark = pytest.mark.slow  # the fault campaign's training rows: an 8-epoch training each (make test-all)

from cluster import netns  # noqa: E402
from cluster.local import LocalServices, collect, launch_ranks, start_controller  # noqa: E402
from tests.cluster import service_popen  # noqa: E402
from tests.keys import ask  # noqa: E402
from tests.test_torch_backend import WORKER  # noqa: E402
from tests.zygote import torch_ranks, torch_ranks_in  # noqa: E402

EPOCHS = 8


@pytest.fixture(scope="module")
def gloo_reports() -> list[dict]:
    """Each rank's report of the fault-free reference, the same training on gloo (2 servers x 2
    ranks): the same for every test of the module, so it runs once."""
    procs = launch_ranks([*WORKER, "ddp_gloo", str(EPOCHS)], 2, 2, {"PASSING_CONTROLLER": ""},
                         popen_for_server=torch_ranks)
    outcomes = collect(procs, 300)
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"gloo rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    return [report["gloo"] for _, report, _ in outcomes]


def restart_controller(services: LocalServices) -> None:
    """SIGKILL the controller, and 2 s later start it again on the same topology and store."""
    controller = services.procs[-1]
    os.kill(controller.pid, signal.SIGKILL)
    controller.wait(10)
    time.sleep(2.0)  # the groups' heartbeats find nobody meanwhile; their data path does not need it
    workdir = Path(services._tmp.name)
    topology = json.loads((workdir / "topology.json").read_text())
    services.procs[-1], _ = start_controller(topology, workdir, services.controller, popen=services.popen)


def train_through_a_kill(ps: int, tmp_path: Path, victim: str = "ps") -> tuple[list[dict], float]:
    """Start the training, SIGKILL PS 0 (or restart the controller) once rank 0 is past its fifth
    step (DDP's set-up is behind it: tests/test_torch_sharded_failover.py strikes there); returns each
    rank's report and when the kill came (time.time())."""
    marker = tmp_path / "training"
    with LocalServices(ps=ps, popen=service_popen) as services:
        procs = launch_ranks([*WORKER, "ddp_fault", str(EPOCHS)], 2, 2,
                             {"PASSING_CONTROLLER": services.controller, "PASSING_TIMEOUT": "60",
                              "PASSING_FAILOVER_AFTER": "1", "PASSING_TEST_MARKER": str(marker),
                              "PYTHONFAULTHANDLER": "1"}, popen_for_server=torch_ranks)
        try:
            while not marker.exists():  # rank 0 is past its fifth training step
                assert all(p.poll() is None for p in procs), "a rank died before the kill"
                time.sleep(0.1)
            killed_at = time.time()
            if victim == "ps":
                os.kill(services.procs[0].pid, signal.SIGKILL)
            else:
                restart_controller(services)
                jobs = ask(services.controller, "status")["jobs"]
                # reconciled from its store: all four groups still there (2 local indices x all_reduce and gather lane)
                assert len(jobs) == 4, jobs
            outcomes = collect(procs, 600)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    return [report for _, report, _ in outcomes], killed_at


def check_training(reports: list[dict], gloo: list[dict]) -> None:
    """Each rank's training through the fault against the same rank's on gloo."""
    seconds = [round(r["passing"]["seconds"], 1) for r in reports]
    print(f"passing run with the kill: {seconds} s per rank; gloo run: {gloo[0]['seconds']:.1f} s")
    assert len(reports) == len(gloo)
    for r, g in zip(reports, gloo, strict=True):
        p = r["passing"]
        assert p["divergence"] == 0.0, "ranks' parameters differ"
        assert p["steps"] == g["steps"]
        assert abs(p["loss"] - g["loss"]) <= 0.01 * g["loss"], (p["loss"], g["loss"])
        assert abs(p["accuracy"] - g["accuracy"]) <= 0.01 and p["accuracy"] >= 0.9


@pytest.mark.timeout(600)
def test_ps_killed_mid_training_the_groups_move_to_the_second_ps(tmp_path, gloo_reports):
    reports, killed_at = train_through_a_kill(2, tmp_path)
    check_training(reports, gloo_reports)
    assert all(r["passing"]["started"] < killed_at < r["passing"]["ended"] for r in reports), "not mid-training"
    assert any(r["moves"] >= 1 for r in reports)  # PS 0 served at least one of the two groups
    assert not any(r["on_gloo"] for r in reports)


@pytest.mark.timeout(600)
def test_ps_killed_mid_training_with_none_left_the_groups_carry_on_over_gloo(tmp_path, gloo_reports):
    reports, killed_at = train_through_a_kill(1, tmp_path)
    check_training(reports, gloo_reports)
    assert all(r["passing"]["started"] < killed_at < r["passing"]["ended"] for r in reports), "not mid-training"
    assert all(r["on_gloo"] for r in reports)


@pytest.mark.timeout(600)
def test_controller_killed_and_restarted_mid_training_changes_nothing(tmp_path, gloo_reports):
    reports, killed_at = train_through_a_kill(1, tmp_path, victim="controller")
    check_training(reports, gloo_reports)
    assert all(r["passing"]["started"] < killed_at < r["passing"]["ended"] for r in reports), "not mid-training"
    assert all(r["moves"] == 0 and not r["on_gloo"] for r in reports)


@pytest.mark.timeout(600)
def test_ps_killed_mid_training_across_network_namespaces(tmp_path, gloo_reports):
    """The first row of docs/reliability.md as deployed: 2 servers x 2 ranks, two PS hosts and the
    controller's host, each a network namespace around one bridge; PS 0 SIGKILLed mid-training."""
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    names = ["server0", "server1", "ps0", "ps1", "ctl"]
    marker = tmp_path / "training"
    with netns.EmulatedNetwork(names) as net:
        ip = {n: net.hosts[n].ip for n in names}
        ps = []
        for n in ("ps0", "ps1"):
            argv = [sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen", f"{ip[n]}:9877",
                    "--control", f"tcp://{ip[n]}:9878"]
            proc = net.popen(n, argv, stdout=subprocess.PIPE, text=True)
            assert proc.stdout.readline(), f"the aggregator in {n} did not start"
            ps.append(proc)
        controller = f"tcp://{ip['ctl']}:9090"
        topology = {"ps": [{"data": f"{ip[n]}:9877", "control": f"tcp://{ip[n]}:9878"} for n in ("ps0", "ps1")]}
        start_controller(topology, tmp_path, controller, popen=lambda argv, **kw: net.popen("ctl", argv, **kw))
        servers = ["server0", "server1"]
        procs = launch_ranks([*WORKER, "ddp_fault", str(EPOCHS)], 2, 2,
                             {"PASSING_CONTROLLER": controller, "PASSING_TIMEOUT": "60", "PASSING_FAILOVER_AFTER": "1",
                              "PASSING_TEST_MARKER": str(marker)},
                             popen_for_server=torch_ranks_in([net.hosts[n].namespace for n in servers]),
                             env_for_server=lambda s: {"GLOO_SOCKET_IFNAME": "eth0"},
                             master_host=ip["server0"])
        while not marker.exists():  # rank 0 is past its fifth training step
            assert all(p.poll() is None for p in procs), "a rank died before the kill"
            time.sleep(0.1)
        ps[0].kill()  # `ip netns exec` execs the aggregator: this is its SIGKILL
        killed_at = time.time()
        outcomes = collect(procs, 600)
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    reports = [report for _, report, _ in outcomes]
    check_training(reports, gloo_reports)
    assert all(r["passing"]["started"] < killed_at < r["passing"]["ended"] for r in reports), "not mid-training"
    assert any(r["moves"] >= 1 for r in reports) and not any(r["on_gloo"] for r in reports)
