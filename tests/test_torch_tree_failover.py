"""DDP and FSDP2 across two racks survive a leaf and the root being struck (docs/reliability.md): four
servers of one rank each, two per rack (each server its own 127.x address; tests/test_controller_tree.Services:
a PS leaf per rack, a PS root, spare PSs, the real controller), backend "passing" placed as a tree. DDP: rack
0's leaf is SIGKILLed past rank 0's fifth step; once the controller has moved the training's group off it,
the root is SIGKILLed too; each time the group moves to a tree with a spare in the lost node's place, and
the training ends as the same training on gloo does: the ranks' parameters identical at every check, loss
and accuracy as gloo's. FSDP2: a leaf killed, or the root hung, mid-step; every step's loss is gloo's.
tests/test_torch_tree_netns.py runs both across racks in network namespaces, as deployed."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")
pytest.importorskip("sklearn", reason="scikit-learn is not installed (pip install -e 'host[test]')")

from cluster.local import collect, launch_ranks  # noqa: E402
from tests.keys import ask  # noqa: E402
from tests.test_controller_tree import Services, host_ip  # noqa: E402
from tests.test_torch_failover import check_training  # noqa: E402
from tests.zygote import torch_ranks  # noqa: E402

WORKER = [sys.executable, "-m", "tests.torch_worker"]
EPOCHS, SERVERS = 24, 4  # long enough for two moves (each about 3 s) after the fifth step


def why_it_ended(stderr: str) -> str:
    """A rank's stderr where it says why it ended: from faulthandler's "Fatal Python error" (its threads' stacks;
    the list of extension modules after them is cut) when it crashed, else the tail."""
    fatal = stderr.find("Fatal Python error")
    if fatal < 0:
        return stderr[-3000:]
    modules = stderr.find("Extension modules:", fatal)
    return stderr[fatal:modules if modules > 0 else None][:8000]


def running(procs: list) -> bool:
    """True while every rank runs; a rank that ended says why."""
    for rank, p in enumerate(procs):
        if p.poll() is not None:
            raise AssertionError(f"rank {rank} ended ({p.returncode}) too soon:\n{why_it_ended(p.communicate()[1])}")
    return True


def on_node(control: str, endpoint: str) -> bool:
    """Whether some group has a node of its tree on the PS of ``control``."""
    return any(n["control"] == control for j in ask(endpoint, "status")["jobs"] for n in j.get("tree", []))


def check_ddp_across_racks(outcomes: list, gloo: list, kills: list[float], moved: list[float], trees: list[dict],
                           nodes: list[str], where: str) -> None:
    """The DDP training with a leaf and then the root killed (here and in network namespaces): every rank
    ended with gloo's training, both kills mid-training, each rank on the tree that moved twice (``nodes``:
    the final tree's node addresses, the spares in the leaf's and the root's places)."""
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    reports = [report for _, report, _ in outcomes]
    started = reports[0]["passing"]["started"]
    print(f"{where}kills at {kills[0] - started:.1f} s and {kills[1] - started:.1f} s of the training; the groups "
          f"moved {moved[0] - kills[0]:.1f} s and {moved[1] - kills[1]:.1f} s after each")
    check_training(reports, [report["gloo"] for _, report, _ in gloo])
    assert all(r["passing"]["started"] < kills[0] < kills[1] < r["passing"]["ended"] for r in reports), \
        "not mid-training"
    assert all(r["mode"] == "tree" and r["moves"] >= 2 and not r["on_gloo"] for r in reports), reports
    # the group that moved twice (a group idle meanwhile, as the lane of all_gathers, moves when it is used)
    assert any([n["data"] for n in j["tree"]] == nodes for j in trees), trees


@pytest.mark.slow  # two DDP trainings of four ranks, seven services
@pytest.mark.timeout(600)
def test_ddp_across_two_racks_survives_a_leaf_and_the_root_killed(tmp_path):
    hosts = {"env_for_server": lambda s: {"PASSING_HOST": host_ip(s % 2, s // 2)}, "popen_for_server": torch_ranks}
    gloo = collect(launch_ranks([*WORKER, "ddp_gloo", str(EPOCHS)], SERVERS, 1, {"PASSING_CONTROLLER": ""},
                                **hosts), 300)
    for rank, (rc, report, stderr) in enumerate(gloo):
        assert rc == 0 and report is not None, f"gloo rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    services = Services(tmp_path, spares=2)
    marker, hold = tmp_path / "training", tmp_path / "checked"
    leaf, root, spares = services.ready[0]["control"], services.ready[2]["control"], services.ready[3:]
    try:
        procs = launch_ranks([*WORKER, "ddp_fault", str(EPOCHS)], SERVERS, 1,
                             {"PASSING_CONTROLLER": services.endpoint, "PASSING_TIMEOUT": "60",
                              "PASSING_FAILOVER_AFTER": "1", "PASSING_TEST_MARKER": str(marker),
                              "PASSING_TEST_HOLD": str(hold), "PYTHONFAULTHANDLER": "1"}, **hosts)
        try:
            while not marker.exists():  # rank 0 is past its fifth training step
                assert running(procs)
                time.sleep(0.05)
            assert on_node(leaf, services.endpoint)
            kills = [time.time()]
            os.kill(services.procs[0].pid, signal.SIGKILL)
            while not on_node(spares[0]["control"], services.endpoint):  # a group moved: the spare took the leaf
                assert running(procs)
                time.sleep(0.05)
            moved = [time.time()]
            assert on_node(root, services.endpoint)
            kills.append(time.time())
            os.kill(services.procs[2].pid, signal.SIGKILL)
            while not on_node(spares[1]["control"], services.endpoint):  # and the other spare the root
                assert running(procs)
                time.sleep(0.05)
            moved.append(time.time())
            trees = [j for j in ask(services.endpoint, "status")["jobs"] if j["mode"] == "tree"]
            hold.touch()  # the training may end now
            outcomes = collect(procs, 300)
        finally:
            hold.touch()
            for p in procs:
                if p.poll() is None:
                    p.kill()
        check_ddp_across_racks(outcomes, gloo, kills, moved, trees,
                               [spares[0]["data"], services.ready[1]["data"], spares[1]["data"]], "")
    finally:
        services.stop()


@pytest.mark.slow  # an FSDP2 training on passing and on gloo in four ranks, five services
@pytest.mark.timeout(600)
@pytest.mark.parametrize("node, index, how, phase", [("rack0", 0, "SIGKILL", "backward"),
                                                     ("spine", 2, "SIGSTOP", "forward")])
def test_fsdp2_across_two_racks_with_a_node_struck_trains_as_on_gloo(tmp_path, node, index, how, phase):
    """FSDP2 (`fully_shard`: reduce_scatter and all_gather across the racks, by the servers' numbers) on
    four servers of one rank, the racks interleaved; rack 0's leaf SIGKILLed before step 3's backward, or the
    root SIGSTOPped (hung) before step 3's forward: the group in flight moves to a tree with the spare in that
    node's place, and every step's loss is gloo's."""
    from tests.test_torch_sharded import WORKER as SHARDED_WORKER
    from tests.test_torch_sharded import check_fsdp_reports, wait_for

    services = Services(tmp_path, spares=1)
    marker = tmp_path / "strike"
    victim = services.procs[index]
    try:
        procs = launch_ranks([*SHARDED_WORKER, "fsdp_fault", "15", "0.3", phase, "3"], SERVERS, 1,
                             {"PASSING_CONTROLLER": services.endpoint, "PASSING_TIMEOUT": "60",
                              "PASSING_FAILOVER_AFTER": "1", "PASSING_TEST_MARKER": str(marker)},
                             env_for_server=lambda s: {"PASSING_HOST": host_ip(s % 2, s // 2)},
                             popen_for_server=torch_ranks)
        try:
            wait_for(marker, procs, 300)
            os.kill(victim.pid, getattr(signal, how))
            marker.with_suffix(".done").touch()
            while not on_node(services.ready[3]["control"], services.endpoint):  # the spare took the node
                assert running(procs)
                time.sleep(0.05)
            outcomes = collect(procs, 400)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        failed = [f"rank {rank} ({rc}):\n{stderr[-2500:]}" for rank, (rc, report, stderr) in enumerate(outcomes)
                  if rc != 0 or report is None]
        assert not failed, "\n".join(failed)
        reports = [report for _, report, _ in outcomes]
        seconds = max(r["passing"]["seconds"] for r in reports)
        print(f"FSDP2 across racks, {node} {how} before step 3's {phase}: {seconds:.1f} s for 15 steps; "
              f"moves {[r['moves'] for r in reports]}")
        check_fsdp_reports(reports, mode="tree")
        assert all(r["moves"] >= 1 and not r["on_gloo"] for r in reports), reports
    finally:
        if victim.poll() is None:
            os.kill(victim.pid, signal.SIGKILL)
        services.stop()
