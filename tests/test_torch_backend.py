"""backend "passing" in real rank processes: s servers × n ranks on loopback, a software
aggregator behind a PS-only controller (cluster.local). The ranks are started with
torchrun's variables (and once by torchrun itself, once with explicit arguments)."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")

from cluster.local import BIN, REPO, LocalServices, collect, free_tcp_port, launch_ranks  # noqa: E402
from tests.cluster import service_popen  # noqa: E402
from tests.zygote import torch_ranks  # noqa: E402

WORKER = [sys.executable, "-m", "tests.torch_worker"]


@pytest.fixture(scope="module")
def services():
    with LocalServices(popen=service_popen) as s:  # forked from a process that imported passing already
        yield s


def run(services, scenario: str, servers: int, ranks: int, *args: str, timeout: float = 240,
        **env: str) -> list[dict]:
    procs = launch_ranks([*WORKER, scenario, *args], servers, ranks,
                         {"PASSING_CONTROLLER": services.controller, "PASSING_TIMEOUT": "20", **env},
                         popen_for_server=torch_ranks)  # forked from a process that imported torch already
    outcomes = collect(procs, timeout)
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    return [report for _, report, _ in outcomes]


SIZES = ("1", "4099", str(2 * 1024 * 1024))  # up to 8 MiB of float32


@pytest.mark.timeout(300)
@pytest.mark.parametrize("servers,ranks", [(1, 1), (1, 4), (2, 1), (2, 2), (2, 4), (4, 2)])
def test_all_reduce_equals_gloo_within_the_scale_bound(services, servers, ranks):
    explicit = ("--explicit",) if (servers, ranks) == (1, 4) else ()
    reports = run(services, "allreduce", servers, ranks, *SIZES, *explicit)
    for r in reports:
        assert (r["servers"], r["ranks_per_server"]) == (servers, ranks)
        assert len(r["checks"]) == len(SIZES) * 4  # sync/async × SUM/AVG
        assert r["mode"] == ("in-host" if servers == 1 else "ps"), r["mode"]
        assert r["in_host"] == ("SharedMemoryInHost" if servers > 1 and ranks > 1 else None), r["in_host"]
        for c in r["checks"]:
            # one server: the in-host stage is the whole all_reduce, gloo's own, bit for bit
            assert c["streamed"] == (servers > 1), f"{c}: streamed through PASSING or not"
            assert c["identical"], f"ranks disagree: {c}"
            assert c["error"] <= c["bound"], c
            if servers == 1:
                assert c["identical_to_gloo"], c


@pytest.mark.slow  # 4 s of four rank processes (make test-all)
@pytest.mark.timeout(300)
def test_all_reduce_over_two_streams_equals_gloo_within_the_scale_bound(services):
    """PASSING_STREAMS=2: each rank's group striped over two streams, a job each at the controller's PS."""
    reports = run(services, "allreduce", 2, 2, *SIZES, PASSING_STREAMS="2")
    for r in reports:
        assert r["streams"] == 2 and r["mode"] == "ps", r
        assert len(r["checks"]) == len(SIZES) * 4
        for c in r["checks"]:
            assert c["streamed"] and c["identical"], c
            assert c["error"] <= c["bound"], c


@pytest.mark.timeout(300)
def test_torchrun_launch(services):
    """Two torchrun invocations (one per server) of 2 ranks each."""
    port = free_tcp_port()
    env = {"PASSING_CONTROLLER": services.controller, "PASSING_TIMEOUT": "20", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    import os

    procs = [subprocess.Popen(
        [str(BIN / "torchrun"), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "tests.torch_worker", "allreduce", "1000"],
        cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in range(2)]
    for node, p in enumerate(procs):
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, f"torchrun node {node}:\n{err[-3000:]}"
        reports = [line for line in out.splitlines() if line.startswith("{")]
        assert len(reports) == 2  # one per local rank
        assert all('"streamed": false' not in line and '"servers": 2' in line for line in reports)


@pytest.mark.timeout(300)
def test_bytes_per_server_in_host_vs_flat(services):
    """PASSING: a server sends about K bytes per allreduce; flat (every rank a worker): n·K."""
    size, ranks = 256 * 1024, 2
    k = size * 4
    for scheme, expect in (("passing", k), ("switchml", ranks * k)):
        reports = run(services, "bytes", 2, ranks, str(size), PASSING_SCHEME=scheme)
        per_server = [sum(r["bytes_sent"] for r in reports if r["server"] == s) for s in (0, 1)]
        for sent in per_server:
            # header (16 B per 256 B payload) and one MAX round: at most ~7 % above K
            assert expect <= sent <= 1.08 * expect + 4096, (scheme, per_server, expect)


@pytest.mark.timeout(300)
def test_other_ops_dtypes_and_collectives_fall_back_to_gloo(services):
    """Every other collective gives gloo's answer, and 3 000 back to back finish (a deadlock with
    gloo's worker thread stopped them before backend.py called gloo from Python)."""
    world = 4
    for r in run(services, "fallback", 2, 2, timeout=120):
        assert r["int64_sum"] == [sum(range(1, world + 1))] * 5
        assert r["float64_max"] == [world - 1.0] * 3
        assert r["float32_max"] == [world - 1.0] * 4
        assert r["broadcast"] == [world - 1.0] * 2
        assert r["all_gather"] == [float(i) for i in range(world)]
        assert r["all_gather_single"] == [float(i) for i in range(world)]
        rank = r["rank"]
        assert r["reduce_scatter_single"] == [float(sum(rank + q for q in range(world)))]  # chunk `rank` of each
        assert r["reduce_scatter"] == [float(sum(q + rank for q in range(world)))]
        assert r["reduce_at_0"] == ([float(sum(range(world)))] if rank == 0 else None)
        assert r["gather_at_0"] == ([2.0 * q for q in range(world)] if rank == 0 else None)
        assert r["scatter"] == [3.0 * rank]
        assert r["all_to_all_single"] == [rank + 10.0 * q for q in range(world)]
        assert r["from_peer"] == [float(rank ^ 1)]
        assert r["coalesced_all_gather"] == [[float(q + k) for q in range(world)] for k in (0, 1)]
        assert r["coalesced_reduce_scatter"] == [[float(world * rank * (k + 1))] for k in (0, 1)]
        assert r["back_to_back"] == [[world - 1.0] * 4, [float(1499 % world)] * 2]


@pytest.mark.timeout(300)
def test_dead_peer_gives_an_error_from_wait(services):
    # the heartbeats' verdict (about 5 s: failover_after's default) must win over the timeout on a
    # loaded machine too: with a 4 s timeout it raced it, and lost now and then
    timeout = 20.0
    procs = launch_ranks([*WORKER, "dead_peer", "3"], 2, 2,
                         {"PASSING_CONTROLLER": services.controller, "PASSING_TIMEOUT": str(timeout)},
                         popen_for_server=torch_ranks)
    outcomes = collect(procs, 120)
    assert outcomes[3][1] == {"victim": True}
    for rank, (rc, report, stderr) in enumerate(outcomes[:3]):
        assert rc == 0 and report is not None, f"rank {rank}:\n{stderr[-3000:]}"
        assert report["error"], f"rank {rank} got no error"
        assert report["seconds"] < timeout + 15, report
    # the ranks of the other server lose no local peer: their error is PASSING's own, which names
    # the peer whose heartbeats stopped (failover is on by default) and comes well before the timeout
    for r in (0, 1):
        error = outcomes[r][1]["error"]
        assert "GroupFailed" in error and "worker 1 (no heartbeat)" in error, error
        assert outcomes[r][1]["seconds"] < timeout, outcomes[r][1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("servers,ranks", [(1, 1), (1, 3), (2, 2), (1, 8)])
def test_nan_and_inf_give_gloos_ieee_sums(services, servers, ranks):
    """A NaN or an infinity in some rank's gradient is no error: the same classes as gloo element by
    element (NaN, +inf, -inf), the finite elements summed as usual; float16 and bfloat16 too."""
    for r in run(services, "nonfinite", servers, ranks):
        for c in r["checks"]:
            assert c["streamed"] == (servers > 1), f"{c}: streamed through PASSING or not (one server: gloo's)"
            assert c["same_class"], c
            assert c["error"] <= c["tolerance"], c


@pytest.mark.timeout(300)
def test_gradscaler_runs_through_its_overflowing_first_steps(services):
    """torch.amp.GradScaler starts with a huge scale: the first steps' gradients are inf, the steps
    are skipped and the scale lowered; then training goes on, as on gloo."""
    for r in run(services, "gradscaler", 2, 2, "30"):
        passing_run, gloo_run = r["passing"], r["gloo"]
        assert passing_run["skipped"] >= 1 and passing_run["skipped"] == gloo_run["skipped"]
        assert passing_run["scale"] == gloo_run["scale"]
        for a, b in zip(passing_run["params"], gloo_run["params"]):
            assert abs(a - b) <= 1e-3 * max(1.0, abs(b)), (passing_run["params"], gloo_run["params"])
