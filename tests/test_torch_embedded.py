"""backend "passing" with no controller configured. Nothing else set: no aggregator, the network
stage is gloo among each local rank's peers (mode "ring"), on loopback and across network
namespaces. PASSING_EMBEDDED=ps: rank 0 runs an embedded controller and software aggregator;
with torchrun on one machine and across network namespaces. A configured controller that
does not answer is still an error (never a silent fallback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")

from cluster import netns  # noqa: E402
from cluster.local import BIN, REPO, collect, free_tcp_port, launch_ranks  # noqa: E402
from tests.zygote import torch_ranks, torch_ranks_in  # noqa: E402

WORKER = [sys.executable, "-m", "tests.torch_worker"]
ANNOUNCEMENT = "no controller configured (PASSING_CONTROLLER unset, no pg_options.controller)"
RING = "nothing configured (no PASSING_CONTROLLER or pg_options.controller, PASSING_EMBEDDED off)"
SIZES = ("1", "4099", str(2 * 1024 * 1024))  # up to 8 MiB of float32


def without_controller(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != "PASSING_CONTROLLER"}


def launch_in_namespaces(net: netns.EmulatedNetwork, argv: list[str], env: dict[str, str]) -> list:
    """2 ranks on each of the network's two servers, forked in its namespace from a process that imported torch
    already, with no controller configured; gloo on the servers' links."""
    servers = list(net.hosts)
    fork_in = torch_ranks_in([net.hosts[n].namespace for n in servers])
    return launch_ranks(argv, len(servers), 2, env,
                        popen_for_server=lambda s: lambda argv, env, **kw: fork_in(s)(
                            argv, env=without_controller(env), **kw),
                        env_for_server=lambda s: {"GLOO_SOCKET_IFNAME": "eth0"},
                        master_host=net.hosts[servers[0]].ip)


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


def torchrun_standalone(ranks: int, scenario: str, **env: str) -> tuple[list[dict], str]:
    proc = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(ranks), "-m",
                           "tests.torch_worker", scenario], cwd=REPO, env={**clean_env(), **env}, capture_output=True,
                          text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], proc.stderr


def check_ring(outcomes: list[tuple[int, dict | None, str]], ranks: int, in_host: str = "SharedMemoryInHost") -> None:
    """Every rank summed right, the same bits on all, with no aggregator: nothing streamed, no
    stream, no embedded controller; the in-host stage through shared memory; with one rank per
    server, gloo's own bits. Rank 0 said why, once."""
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
        assert report["mode"] == "ring" and "PASSING_EMBEDDED=ps" in report["reason"], report["reason"]
        assert not report["stream"] and not report["embedded"], report
        assert report["in_host"] == (None if ranks == 1 else in_host), report["in_host"]
        assert len(report["checks"]) == len(SIZES) * 4  # sync/async x SUM/AVG
        for c in report["checks"]:
            assert not c["streamed"] and c["identical"] and c["error"] <= c["bound"], c
            if ranks == 1:
                assert c["identical_to_gloo"], c
    stderr = "".join(err for _, _, err in outcomes)
    assert stderr.count(RING) == 1, stderr[-3000:]
    assert ANNOUNCEMENT not in stderr, stderr[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("servers,ranks", [(2, 1), (2, 2), (4, 2), (2, 4)])
def test_nothing_configured_sums_among_the_peers_over_gloo(servers, ranks):
    """torchrun alone on several servers: no controller, no aggregator; the in-host stages around gloo among
    each local rank's peers (n x 1: the whole group's gloo all_reduce, bit for bit)."""
    procs = launch_ranks([*WORKER, "allreduce", *SIZES], servers, ranks,
                         {"PASSING_CONTROLLER": "", "PASSING_TIMEOUT": "20"}, popen_for_server=torch_ranks)
    check_ring(collect(procs, 240), ranks)


@pytest.mark.timeout(300)
def test_where_a_server_has_no_shared_memory_the_in_host_stage_is_a_ring(tmp_path):
    """2 x 2, the segment's directory missing: every rank of a server agrees on the ring over
    loopback TCP, the sums are as right, and each server's local rank 0 says why, once."""
    missing = tmp_path / "no-tmpfs-here"
    procs = launch_ranks([*WORKER, "allreduce", *SIZES], 2, 2,
                         {"PASSING_CONTROLLER": "", "PASSING_TIMEOUT": "20", "PASSING_SHARED_MEMORY": str(missing)},
                         popen_for_server=torch_ranks)
    outcomes = collect(procs, 240)
    check_ring(outcomes, 2, in_host="RingInHost")
    stderr = "".join(err for _, _, err in outcomes)
    assert stderr.count("the in-host stage goes over loopback TCP") == 2 and str(missing) in stderr, stderr[-3000:]


@pytest.mark.timeout(300)
def test_nothing_configured_across_network_namespaces():
    """2 servers x 2 ranks, each server a network namespace: the peers' gloo groups meet where gloo's own do."""
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    servers = ["server0", "server1"]
    with netns.EmulatedNetwork(servers) as net:
        procs = launch_in_namespaces(net, [*WORKER, "allreduce", *SIZES], {"PASSING_TIMEOUT": "20"})
        check_ring(collect(procs, 240), 2)


@pytest.mark.timeout(180)
def test_the_embedded_ps_is_one_option_away():
    """`PASSING_EMBEDDED=ps torchrun --standalone --nproc-per-node 4 train.py`, no controller, with a scheme
    that streams every rank (switchml): rank 0's embedded controller and aggregator serve it."""
    reports, stderr = torchrun_standalone(4, "embedded", PASSING_SCHEME="switchml", PASSING_EMBEDDED="ps")
    check_embedded(reports, "127.0.0.1")
    assert stderr.count(ANNOUNCEMENT) == 1, stderr[-3000:]  # said once, by rank 0


def forked_one_server(ranks: int, scenario: str, **env: str) -> tuple[list[dict], str]:
    """``torchrun_standalone``'s run with the environment torchrun gives its ranks on one server
    (cluster.local.rank_env), the ranks forked from a process that imported torch already."""
    procs = launch_ranks([*WORKER, scenario], 1, ranks, {"PASSING_TIMEOUT": "20", "PASSING_REPORT_INTERVAL": "0.2",
                                                         **env}, popen_for_server=torch_ranks)
    outcomes = collect(procs, 170)
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    return [report for _, report, _ in outcomes], "".join(stderr for _, _, stderr in outcomes)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scheme", ["passing", "psring"])
def test_one_server_has_no_network_stage(scheme):
    """`torchrun --standalone` with the in-host schemes: every rank is on one server, so all_reduce is
    gloo's own (bit for bit, SUM and AVG, sync and async); no controller is contacted (a configured one
    that does not answer is no error), no aggregator starts, no socket or thread of PASSING's exists, and
    rank 0 says why, once. torchrun itself launches the run without a controller; the run with one that
    does not answer has torchrun's environment, its ranks forked (a torchrun costs 6 s of imports)."""
    for launch, env in ((torchrun_standalone, {}), (forked_one_server, {
            "PASSING_CONTROLLER": f"tcp://127.0.0.1:{free_tcp_port()}", "PASSING_JOIN_TIMEOUT": "1"})):
        reports, stderr = launch(2, "one_server", PASSING_SCHEME=scheme, **env)
        assert len(reports) == 2
        for r in reports:
            assert r["mode"] == "in-host" and "one server" in r["reason"], r
            assert all(r["identical_to_gloo"]), r
            assert not r["stream"] and not r["embedded"] and r["stats"] == {} and r["threads"] == [], r
        assert stderr.count("no network stage") == 1, stderr[-3000:]  # said once, by rank 0
        assert ANNOUNCEMENT not in stderr, stderr[-3000:]


@pytest.mark.timeout(180)
def test_the_embedded_ps_across_network_namespaces():
    """PASSING_EMBEDDED=ps, 2 servers × 2 ranks, each server a network namespace: the others reach rank 0 at
    its server's address."""
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    servers = ["server0", "server1"]
    with netns.EmulatedNetwork(servers) as net:
        procs = launch_in_namespaces(net, [*WORKER, "embedded"], {"PASSING_TIMEOUT": "20",
                                                                   "PASSING_REPORT_INTERVAL": "0.2",
                                                                   "PASSING_EMBEDDED": "ps"})
        outcomes = collect(procs, 150)
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    reports = [report for _, report, _ in outcomes]
    check_embedded(reports, net.hosts["server0"].ip)
    assert {r["host"] for r in reports} == {net.hosts[s].ip for s in servers}


@pytest.mark.timeout(120)
def test_a_configured_controller_that_does_not_answer_is_an_error():
    """Not the ring, and not the embedded PS: the error, with the controller's name."""
    silent = f"tcp://127.0.0.1:{free_tcp_port()}"
    # (two servers: a job on one server has no network stage and asks no controller)
    procs = launch_ranks([*WORKER, "embedded"], 2, 1, {"PASSING_CONTROLLER": silent, "PASSING_JOIN_TIMEOUT": "1"},
                         popen_for_server=torch_ranks)  # forked from a process that imported torch already
    for rc, report, stderr in collect(procs, 100):
        assert rc != 0 and report is None
        assert f"controller {silent} did not answer 'join'" in stderr, stderr[-3000:]
    assert ANNOUNCEMENT not in stderr
