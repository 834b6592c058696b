"""backend "passing" across racks: rank processes on four servers of two racks (each server its own 127.x
address, so that the controller's fabric places them; tests/test_controller_tree.Services: a PS leaf per
rack, a PS root, the real controller). The controller places the group as a tree and the backend's
all_reduce gives gloo's result within the bound for the whole job's servers."""

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
