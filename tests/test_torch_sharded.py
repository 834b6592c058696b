"""reduce_scatter and all_gather of backend "passing" (passing.torch.sharded) in real rank
processes against a software aggregator behind a PS-only controller, compared with gloo's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")

from cluster import netns  # noqa: E402
from cluster.local import LocalServices, collect, launch_ranks, start_controller  # noqa: E402
from passing.torch.network import GATHER_GROUP  # noqa: E402
from tests.cluster import service_popen  # noqa: E402
from tests.keys import ask  # noqa: E402
from tests.test_torch_backend import services  # noqa: E402, F401  (the fixture)
from tests.zygote import torch_ranks, torch_ranks_in  # noqa: E402

WORKER = [sys.executable, "-m", "tests.torch_sharded_worker"]


def run(services, scenario: str, servers: int, ranks: int, *args: str, timeout: float = 240,  # noqa: F811
        **env: str) -> list[dict]:
    procs = launch_ranks([*WORKER, scenario, *args], servers, ranks,
                         {"PASSING_CONTROLLER": services.controller, "PASSING_TIMEOUT": "20", **env},
                         popen_for_server=torch_ranks)
    outcomes = collect(procs, timeout)
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    return [report for _, report, _ in outcomes]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("servers,ranks", [(2, 1), (2, 2), (3, 2)])
def test_sharded_collectives_equal_gloo(services, servers, ranks):  # noqa: F811
    for r in run(services, "collectives", servers, ranks, "0", "1", "1000"):
        assert r["mode"] == "ps" and r["servers"] == servers
        for c in r["checks"]:
            assert c["streamed"] or c["empty"], f"not through PASSING: {c}"
            if c["want_exact"]:
                assert c["exact"], f"not bit for bit: {c}"
            else:  # the quantisation of a float sum, well within this for these sizes
                assert c["error"] <= 1e-5 * max(1.0, c["scale"]), c


@pytest.mark.timeout(300)
@pytest.mark.parametrize("servers,ranks", [(2, 1), (2, 2)])
def test_an_all_gather_completes_while_the_reduce_scatter_before_it_is_stalled(tmp_path, servers, ranks):
    """The lanes overlap: with the PS of the reduce lanes stopped (SIGSTOP; no failover), an all_gather
    issued after a reduce_scatter completes, right, with the reduce_scatter still pending; once the PS
    goes on, the reduce_scatter completes right too. With one lane per group the all_gather would wait
    behind the reduce_scatter and the ranks would never report it gathered."""
    marker = tmp_path / "overlap"
    # four PS: the controller spreads groups over them by job id, so each of the (at most) four groups
    # (the reduce and gather lanes of each local index) has a PS of its own
    with LocalServices(ps=4, popen=service_popen) as four:
        procs = launch_ranks([*WORKER, "overlap", "3000"], servers, ranks,
                             {"PASSING_CONTROLLER": four.controller, "PASSING_TIMEOUT": "60",
                              "PASSING_FAILOVER_AFTER": "0", "PASSING_TEST_MARKER": str(marker)},
                             popen_for_server=torch_ranks)
        stopped = []
        try:
            wait_for(marker.with_suffix(".joined"), procs)
            jobs = ask(four.controller, "status")["jobs"]
            reduce_ps = {j["aggregator"] for j in jobs if j["group"] < GATHER_GROUP}
            gather_ps = {j["aggregator"] for j in jobs if j["group"] >= GATHER_GROUP}
            assert len(jobs) == 2 * ranks and not reduce_ps & gather_ps, f"lanes share a PS: {jobs}"
            data = [p["data"] for p in four.endpoints]
            for address in reduce_ps:
                stopped.append(four.procs[data.index(address)])
                os.kill(stopped[-1].pid, signal.SIGSTOP)
            marker.with_suffix(".stopped").touch()
            wait_for(marker.with_suffix(".gathered"), procs)
            for proc in stopped:
                os.kill(proc.pid, signal.SIGCONT)
            stopped = []
            outcomes = collect(procs, 120)
        finally:
            for proc in stopped:
                os.kill(proc.pid, signal.SIGCONT)
            for p in procs:
                if p.poll() is None:
                    p.kill()
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
        assert report["mode"] == "ps" and report["gathered_right"], report
        assert report["scatter_pending_when_gathered"], report  # it could not have finished: its PS was stopped
        assert report["reduced_error"] <= 1e-3, report


def wait_for(path, procs, seconds: float = 120) -> None:
    """Until ``path`` exists; fails at once, with their errors, if a rank ends first."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            ended = [(r, rc, err) for r, (rc, _, err) in enumerate(collect(procs, 5)) if rc]
            pytest.fail(f"the ranks did not reach {path.name}:\n" + "\n".join(
                f"rank {r} ({rc}): {err[-6000:]}" for r, rc, err in ended))
        time.sleep(0.02)


@pytest.mark.timeout(300)
def test_keep_on_gloo_keeps_them_there(services):  # noqa: F811
    for r in run(services, "collectives", 2, 1, "100", PASSING_KEEP_ON_GLOO="reduce_scatter,all_gather"):
        for c in r["checks"]:
            assert not c["streamed"], c
            assert c["exact"], c  # gloo's own answers


@pytest.mark.timeout(300)
@pytest.mark.parametrize("servers,ranks", [(2, 1), (2, 2)])
def test_after_a_failover_to_gloo_the_network_stage_is_gloo(services, servers, ranks):  # noqa: F811
    """Once the group's all_reduce carries on over gloo (no aggregator left), so do reduce_scatter
    and all_gather's network stage, with the same answers and nothing on the wire."""
    for r in run(services, "on_gloo", servers, ranks, "1", "1000"):
        for c in r["checks"]:
            assert not c["streamed"], c
            if c["want_exact"]:
                assert c["exact"], c
            else:
                assert c["error"] <= 1e-5 * max(1.0, c["scale"]), c


@pytest.mark.timeout(400)
@pytest.mark.parametrize("servers,ranks", [(2, 1), (2, 2)])
def test_fsdp2_fully_shard_trains_as_on_gloo(services, servers, ranks):  # noqa: F811
    check_fsdp_reports(run(services, "fsdp", servers, ranks, "15", "0.3", timeout=360))


def check_fsdp_reports(reports: list[dict], mode: str = "ps") -> None:
    """Each rank's FSDP training on "passing" went through the aggregator (``mode``) and had gloo's losses."""
    for r in reports:
        p, g = r["passing"], r["gloo"]
        assert r["mode"] == mode and p["streamed"], f"FSDP's collectives did not go through PASSING: {r}"
        assert not g["streamed"]
        assert p["losses"][-1] < 0.8 * p["losses"][0], p["losses"]  # it trains
        for a, b in zip(p["losses"], g["losses"]):
            assert abs(a - b) <= 1e-3 * max(abs(b), 1e-3), (p["losses"], g["losses"])


@pytest.mark.timeout(400)
def test_fsdp2_across_network_namespaces_trains_as_on_gloo(tmp_path):
    """2 servers x 2 ranks, each server a network namespace, the PS and the controller in namespaces of their
    own: FSDP2's reduce_scatter and all_gather cross the servers' links to the PS, gloo's over the same links."""
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    names = ["server0", "server1", "ps", "ctl"]
    with netns.EmulatedNetwork(names) as net:
        ip = {n: net.hosts[n].ip for n in names}
        ps = net.popen("ps", [sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen",
                              f"{ip['ps']}:9877", "--control", f"tcp://{ip['ps']}:9878"],
                       stdout=subprocess.PIPE, text=True)
        assert ps.stdout.readline(), "the aggregator did not start"
        controller = f"tcp://{ip['ctl']}:9090"
        start_controller({"ps": [{"data": f"{ip['ps']}:9877", "control": f"tcp://{ip['ps']}:9878"}]}, tmp_path,
                         controller, popen=lambda argv, **kw: net.popen("ctl", argv, **kw))
        servers = ["server0", "server1"]
        procs = launch_ranks([*WORKER, "fsdp", "15", "0.3"], 2, 2,
                             {"PASSING_CONTROLLER": controller, "PASSING_TIMEOUT": "30"},
                             popen_for_server=torch_ranks_in([net.hosts[n].namespace for n in servers]),
                             env_for_server=lambda s: {"GLOO_SOCKET_IFNAME": "eth0"}, master_host=ip["server0"])
        outcomes = collect(procs, 360)
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    check_fsdp_reports([report for _, report, _ in outcomes])


@pytest.mark.timeout(400)
def test_hsdp_trains_as_on_gloo(services):  # noqa: F811
    """HSDP (fully_shard over a replicate x shard mesh of "passing" subgroups) on 4 single-rank servers:
    the shard groups' reduce_scatter and all_gather and the replicate groups' all_reduce all go through
    PASSING, and the losses are gloo's."""
    for r in run(services, "hsdp", 4, 1, "10", "0.3", timeout=360):
        p, g = r["passing"], r["gloo"]
        assert p["shard_streamed"] and p["replicate_streamed"], p  # reduce_scatter/all_gather; all_reduce
        assert not g["shard_streamed"] and not g["replicate_streamed"]
        assert p["losses"][-1] < 0.8 * p["losses"][0], p["losses"]
        for a, b in zip(p["losses"], g["losses"]):
            assert abs(a - b) <= 1e-3 * max(abs(b), 1e-3), (p["losses"], g["losses"])


def test_keep_on_gloo_option_parses_and_refuses_unknown_names():
    from passing.torch import OptionError, Options

    assert Options().resolve({}).keep_on_gloo == ()
    assert Options().resolve({"PASSING_KEEP_ON_GLOO": "reduce_scatter, all_gather"}).keep_on_gloo == (
        "reduce_scatter", "all_gather")
    assert Options(keep_on_gloo=["all_gather"]).resolve({}).keep_on_gloo == ("all_gather",)
    with pytest.raises(OptionError, match="keep_on_gloo"):
        Options(keep_on_gloo="all_reduce").resolve({})
