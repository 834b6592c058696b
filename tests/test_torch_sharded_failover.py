"""Every collective survives its aggregator (docs/reliability.md): FSDP2 and DDP over backend "passing",
2 servers x 2 rank processes, a real controller with two PS (or one), the PS SIGKILLed or SIGSTOPped at
a chosen point: during start-up, before a forward (its all_gathers), before a backward (its
reduce_scatters, and the all_gathers of resharded layers). With a second PS the groups move to it; with
none left they carry on over gloo. Either way the training is the fault-free one's (gloo's losses)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")
pytest.importorskip("sklearn", reason="scikit-learn is not installed (pip install -e 'host[test]')")
pytestmark = pytest.mark.slow  # the fault campaign's sharded rows (make test-all)

from cluster.local import LocalServices, collect, launch_ranks  # noqa: E402
from tests.cluster import service_popen  # noqa: E402
from tests.test_torch_backend import WORKER as DDP_WORKER  # noqa: E402
from tests.test_torch_failover import check_training, gloo_reports  # noqa: E402, F401  (the fixture)
from tests.test_torch_sharded import WORKER as SHARDED_WORKER  # noqa: E402
from tests.test_torch_sharded import check_fsdp_reports, wait_for  # noqa: E402
from tests.zygote import torch_ranks  # noqa: E402

STEPS, LR = "15", "0.3"


def run_through_a_strike(argv: list[str], ps: int, tmp_path: Path, how: str) -> list[dict]:
    """Start the ranks; once rank 0 says it is at the point (PASSING_TEST_MARKER), strike PS 0 with
    ``how`` (SIGKILL, or SIGSTOP: a hung aggregator), then let rank 0 go on; each rank's report."""
    marker = tmp_path / "strike"
    with LocalServices(ps=ps, popen=service_popen) as services:
        victim = services.procs[0]
        procs = launch_ranks(argv, 2, 2, {"PASSING_CONTROLLER": services.controller, "PASSING_TIMEOUT": "60",
                                          "PASSING_FAILOVER_AFTER": "1", "PASSING_TEST_MARKER": str(marker)},
                             popen_for_server=torch_ranks)
        try:
            wait_for(marker, procs, 300)
            os.kill(victim.pid, getattr(signal, how))
            marker.with_suffix(".done").touch()
            outcomes = collect(procs, 600)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            if how == "SIGSTOP" and victim.poll() is None:
                os.kill(victim.pid, signal.SIGCONT)  # so that the services' shutdown can end it
    failed = [f"rank {rank} ({rc}):\n{stderr[-2500:]}" for rank, (rc, report, stderr) in enumerate(outcomes)
              if rc != 0 or report is None]
    assert not failed, "\n".join(failed)
    return [report for _, report, _ in outcomes]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("phase,step", [("startup", -1), ("forward", 3), ("backward", 3)])
def test_fsdp2_with_its_ps_struck_moves_and_trains_as_on_gloo(tmp_path, phase, step, how):
    reports = run_through_a_strike([*SHARDED_WORKER, "fsdp_fault", STEPS, LR, phase, str(step)], 2, tmp_path, how)
    seconds = max(r["passing"]["seconds"] for r in reports), max(r["gloo"]["seconds"] for r in reports)
    print(f"FSDP2, PS 0 {how} at {phase}: {seconds[0]:.1f} s for {STEPS} steps (gloo, fault-free: {seconds[1]:.1f} s); "
          f"moves {[r['moves'] for r in reports]}")
    check_fsdp_reports(reports)
    assert any(r["moves"] >= 1 for r in reports), "PS 0 served neither group: the test proves nothing"
    assert not any(r["on_gloo"] for r in reports)


@pytest.mark.timeout(600)
def test_fsdp2_with_the_last_ps_killed_carries_on_over_gloo(tmp_path):
    reports = run_through_a_strike([*SHARDED_WORKER, "fsdp_fault", STEPS, LR, "backward", "3"], 1, tmp_path,
                                   "SIGKILL")
    print(f"FSDP2, the last PS killed: {max(r['passing']['seconds'] for r in reports):.1f} s for {STEPS} steps")
    for r in reports:
        p, g = r["passing"], r["gloo"]
        assert r["on_gloo"], "the group did not carry on over gloo"
        for a, b in zip(p["losses"], g["losses"], strict=True):
            assert abs(a - b) <= 1e-3 * max(abs(b), 1e-3), (p["losses"], g["losses"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ps", [2, 1])
def test_ddp_with_its_ps_killed_during_its_construction(tmp_path, ps, gloo_reports):  # noqa: F811
    """DistributedDataParallel(...)'s parameter check is an all_gather through the aggregator: with PS 0
    killed just before it, the groups move (or, with no PS left, carry on over gloo) and the training
    equals the fault-free one (before issue 36 the run hung)."""
    reports = run_through_a_strike([*DDP_WORKER, "ddp_fault", "8", "startup"], ps, tmp_path, "SIGKILL")
    check_training(reports, gloo_reports)
    if ps == 2:
        assert any(r["moves"] >= 1 for r in reports) and not any(r["on_gloo"] for r in reports)
    else:
        assert all(r["on_gloo"] for r in reports)
