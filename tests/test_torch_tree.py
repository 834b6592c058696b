"""backend "passing" across racks: rank processes on four servers of two racks (each server its own 127.x
address, so that the controller's fabric places them; tests/test_controller_tree.Services: a PS leaf per
rack, a PS root, the real controller). The controller places the group as a tree and the backend's
all_reduce gives gloo's result within the bound for the whole job's servers; its reduce_scatter and
all_gather (every form, FSDP2's training included) give gloo's, the servers named by their numbers in the job."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")

from cluster.local import collect, launch_ranks  # noqa: E402
from tests.test_controller_tree import Services, assert_freed, host_ip  # noqa: E402
from tests.zygote import torch_ranks  # noqa: E402


@pytest.mark.slow  # ~20 s: four torch ranks and five services
@pytest.mark.timeout(240)
def test_torch_all_reduce_across_two_racks_equals_gloo(tmp_path):
    services = Services(tmp_path)
    try:
        procs = launch_ranks([sys.executable, "-m", "tests.torch_worker", "allreduce", "1", "4099"], 4, 1,
                             {"PASSING_CONTROLLER": services.endpoint, "PASSING_TIMEOUT": "20"},
                             popen_for_server=torch_ranks,
                             env_for_server=lambda s: {"PASSING_HOST": host_ip(s % 2, s // 2)})
        outcomes = collect(procs, 180)
        for rank, (rc, report, stderr) in enumerate(outcomes):
            assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
            assert report["mode"] == "tree" and "a tree across racks" in report["reason"], report["reason"]
            assert report["servers"] == 4 and report["stream"]
            for c in report["checks"]:
                assert c["streamed"] and c["identical"] and c["error"] <= c["bound"], c
        assert_freed(services.ready)
    finally:
        services.stop()


def run_across_racks(tmp_path, module: str, args: list[str], servers: int, ranks: int, timeout: float) -> list[dict]:
    """``module``'s scenario on ``servers`` servers of ``ranks`` ranks, server s in rack s % 2 (interleaved,
    so a server's number in the job differs from its index), the tree of tests.test_controller_tree.Services."""
    services = Services(tmp_path)
    try:
        procs = launch_ranks([sys.executable, "-m", module, *args], servers, ranks,
                             {"PASSING_CONTROLLER": services.endpoint, "PASSING_TIMEOUT": "20"},
                             popen_for_server=torch_ranks,
                             env_for_server=lambda s: {"PASSING_HOST": host_ip(s % 2, s // 2)})
        outcomes = collect(procs, timeout)
        for rank, (rc, report, stderr) in enumerate(outcomes):
            assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
        assert_freed(services.ready)
        return [report for _, report, _ in outcomes]
    finally:
        services.stop()


@pytest.mark.slow  # ~45 s: four torch ranks (two servers of two ranks: the in-host stage too) and five services
@pytest.mark.timeout(300)
@pytest.mark.parametrize("servers,ranks", [(4, 1), (2, 2)])
def test_torch_reduce_scatter_and_all_gather_across_two_racks_equal_gloo(tmp_path, servers, ranks):
    """reduce_scatter_tensor, all_gather_into_tensor and their list and coalesced forms through the tree,
    each rank's answer against gloo's: bit for bit for the gathers, within the quantisation for the sums."""
    for r in run_across_racks(tmp_path, "tests.torch_sharded_worker", ["collectives", "0", "1", "300"], servers,
                              ranks, 240):
        assert r["mode"] == "tree" and r["servers"] == servers
        for c in r["checks"]:
            assert c["streamed"] or c["empty"], f"not through PASSING: {c}"
            if c["want_exact"]:
                assert c["exact"], f"not bit for bit: {c}"
            else:
                assert c["error"] <= 1e-5 * max(1.0, c["scale"]), c


@pytest.mark.slow  # ~70 s: four torch ranks training twice (passing, gloo) and five services
@pytest.mark.timeout(400)
def test_fsdp2_fully_shard_across_two_racks_trains_as_on_gloo(tmp_path):
    from tests.test_torch_sharded import check_fsdp_reports

    check_fsdp_reports(run_across_racks(tmp_path, "tests.torch_sharded_worker", ["fsdp", "15", "0.3"], 4, 1, 360),
                       mode="tree")


@pytest.mark.slow  # ~70 s: forty torch ranks and five services
@pytest.mark.timeout(600)
def test_forty_servers_across_two_racks_equal_gloo(tmp_path):
    """More than one aggregator's 32 servers: 40 single-rank servers, 20 per rack, one group at the controller
    placed as a tree of 40 (owners: at most 128); reduce_scatter and all_gather (every form) equal gloo's."""
    reports = run_across_racks(tmp_path, "tests.torch_sharded_worker", ["collectives", "5"], 40, 1, 500)
    for r in reports:
        assert r["mode"] == "tree" and r["servers"] == 40
        for c in r["checks"]:
            assert c["streamed"] or c["empty"], f"not through PASSING: {c}"
            assert c["exact"] if c["want_exact"] else c["error"] <= 1e-5 * max(1.0, c["scale"]), c
