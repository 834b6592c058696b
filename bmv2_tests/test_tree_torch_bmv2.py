"""DDP on backend "passing" through a tree whose rack1 leaf is the BMv2 switch (issue 48): rack1 is h1 and h2 on
the switch, rack2 h3 and h4 under a PS leaf, a PS root, and a spare PS (test_tree_controller_bmv2's fabric),
four servers of one rank each. The training ends as the same training on gloo does; then, in a second
training, the BMv2 leaf is SIGKILLed mid-training, the controller moves the group to a tree with the spare PS
in rack1's place, and the training still ends as gloo's.

A switch that dies takes its links down, so every host, the PSs and the controller also meet on a
management network (test_failover_bmv2.ManagementNetwork, all hosts as its servers): host routes carry
torch's store, gloo and the PSs' traffic over it, while rack1's aggregation traffic (to the switch's
aggregation address) crosses the switch, and the switch leaf's partials reach the root through it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")
pytest.importorskip("sklearn", reason="scikit-learn is not installed (pip install -e 'host[test]')")

from cluster.local import collect, launch_ranks  # noqa: E402
from tests.test_torch_failover import check_training  # noqa: E402

from .test_e2e_bmv2 import CONTROLLER  # noqa: E402
from .test_failover_bmv2 import ManagementNetwork  # noqa: E402
from .test_tree_controller_bmv2 import EXTRA, HOSTS, PS, tree_services  # noqa: E402

pytestmark = pytest.mark.slow  # two DDP trainings through BMv2 and a gloo one: make test-all's

WORKER = [sys.executable, "-m", "tests.torch_worker"]
SERVERS = [f"h{i + 1}" for i in range(HOSTS)]
# BMv2 adds ~1 k packets/s: 3 epochs (66 steps) of an MLP 32 wide (53 packets an allreduce) keep a training to a
# minute or two, long enough for a move (about 3 s) after the fifth step
EPOCHS, HIDDEN = 3, 32


@pytest.fixture(scope="module")
def network():
    from .network import Bmv2Network

    net = Bmv2Network(HOSTS, extra=EXTRA)
    hosts = [*SERVERS, *PS]
    mgmt = ManagementNetwork(net, hosts, servers=tuple(hosts))
    yield net
    mgmt.close([net.net.get(h).IP() for h in hosts])
    net.stop()


def ranks(network, scenario: list[str], env: dict[str, str]) -> list:
    return launch_ranks([*WORKER, *scenario], HOSTS, 1, env,
                        popen_for_server=lambda s: network.net.get(SERVERS[s]).popen,
                        env_for_server=lambda s: {"GLOO_SOCKET_IFNAME": f"{SERVERS[s]}-eth0"},
                        master_host=network.net.get("h1").IP())


def completed(outcomes: list) -> list[dict]:
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    return [report for _, report, _ in outcomes]


@pytest.fixture(scope="module")
def controller(network, pipeline, tmp_path_factory):
    with tree_services(network, pipeline, tmp_path_factory.mktemp("controller")) as c:
        yield c


@pytest.fixture(scope="module")
def gloo_reports(network):
    return [r["gloo"] for r in completed(collect(ranks(network, ["ddp_gloo", str(EPOCHS), str(HIDDEN)],
                                                          {"PASSING_CONTROLLER": ""}), 300))]


def rack1_controls(controller) -> set[str]:
    """Where rack1's node of each placed tree is (the backend's groups: a group idle at a move moves when it is
    next used)."""
    return {n["control"] for j in controller.ctl("status")["jobs"] for n in j.get("tree", []) if n["name"] == "rack1"}


def ended_ranks(procs: list) -> str:
    """Each rank that has ended: its exit status and the end of its stderr (why it ended before the test was done)."""
    return "\n".join(f"rank {rank} ended ({p.returncode}):\n{p.communicate()[1][-3000:]}"
                     for rank, p in enumerate(procs) if p.poll() is not None)


def train(network, tmp_path, hold: Path | None = None) -> list:
    """The training on "passing"; ``hold``: the ranks wait at its last step until the test makes that file
    (tests/torch_worker.py, PASSING_TEST_HOLD), so that the test sees a move while the training still runs."""
    env = {"PASSING_CONTROLLER": CONTROLLER, "PASSING_POOL": "16", "PASSING_TIMEOUT": "60",
           "PASSING_FAILOVER_AFTER": "1", "PASSING_TEST_MARKER": str(tmp_path / "training")}
    if hold is not None:
        env["PASSING_TEST_HOLD"] = str(hold)
    return ranks(network, ["ddp_fault", str(EPOCHS), "training", str(HIDDEN)], env)


@pytest.mark.timeout(900)
def test_ddp_through_a_bmv2_leaf_trains_as_on_gloo(network, controller, gloo_reports, tmp_path):
    before = controller.ctl("stats")["switch_totals"]
    reports = completed(collect(train(network, tmp_path), 600))
    check_training(reports, gloo_reports)
    assert all(r["mode"] == "tree" and r["moves"] == 0 and not r["on_gloo"] for r in reports), reports
    after = controller.ctl("stats")["switch_totals"]
    assert after["completed"] > before["completed"], (before, after)  # rack1's rounds completed at the switch
    assert after["rejected"] == before["rejected"] and after["malformed"] == before["malformed"], (before, after)


@pytest.mark.timeout(900)
def test_ddp_survives_the_bmv2_leaf_killed_mid_training(network, controller, gloo_reports, tmp_path):
    """Last in the file: the switch stays dead. The ranks hold at the last step until the move is seen: on the
    spare PS the rest of a training may take less than a poll of the controller."""
    marker, hold = tmp_path / "training", tmp_path / "checked"
    procs = train(network, tmp_path, hold)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():  # rank 0 is past its fifth step
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                f"the training did not start\n{ended_ranks(procs)}"
            time.sleep(0.05)
        assert "switch" in rack1_controls(controller)
        network.switch.process.kill()
        killed = time.monotonic()
        spare = f"tcp://{PS['ps3']}:9878"  # the spare in rack1's place
        while spare not in (controls := rack1_controls(controller)):
            assert time.monotonic() - killed < 120 and all(p.poll() is None for p in procs), \
                f"the training's group did not move off the dead switch: rack1 at {controls}\n{ended_ranks(procs)}"
            time.sleep(0.1)
        moved = time.monotonic() - killed
    finally:
        hold.touch()  # the training may end now
    reports = completed(collect(procs, 600))
    print(f"BMv2 leaf killed past step 5: the group moved {moved:.1f} s later")
    check_training(reports, gloo_reports)
    assert all(r["mode"] == "tree" and not r["on_gloo"] for r in reports), reports
    assert any(r["moves"] >= 1 for r in reports), reports
    switch = next(a for a in controller.ctl("status")["aggregators"] if a["aggregator"] == "switch")
    assert switch["state"] == "down", switch
