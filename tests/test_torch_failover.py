"""Training survives the loss of its aggregator (docs/reliability.md): DDP over backend "passing"
in 2 servers x 2 rank processes, the software aggregator SIGKILLed mid-training. With a second
PS the groups move to it; with none left, the process groups carry on over gloo. Either way the
ranks' parameters stay identical at every check and the training ends as a fault-free one does."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")
pytest.importorskip("sklearn", reason="scikit-learn is not installed (pip install -e 'host[test]')")

from cluster.local import LocalServices, collect, launch_ranks  # noqa: E402
from tests.test_torch_backend import WORKER  # noqa: E402

EPOCHS = 8


def train_through_a_kill(ps: int, tmp_path: Path) -> tuple[list[dict], float]:
    """Start the training, SIGKILL PS 0 once every group runs and a few steps are done; returns
    each rank's report and when the kill came (time.time())."""
    marker = tmp_path / "training"
    with LocalServices(ps=ps) as services:
        procs = launch_ranks([*WORKER, "ddp_fault", str(EPOCHS)], 2, 2,
                             {"PASSING_CONTROLLER": services.controller, "PASSING_TIMEOUT": "60",
                              "PASSING_FAILOVER_AFTER": "1", "PASSING_TEST_MARKER": str(marker),
                              "PYTHONFAULTHANDLER": "1"})
        try:
            while not marker.exists():  # rank 0 starts training
                assert all(p.poll() is None for p in procs), "a rank died before the kill"
                time.sleep(0.1)
            time.sleep(1.5)  # mid-training
            os.kill(services.procs[0].pid, signal.SIGKILL)
            killed_at = time.time()
            outcomes = collect(procs, 600)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    return [report for _, report, _ in outcomes], killed_at


def check_training(reports: list[dict]) -> None:
    seconds = [round(r["passing"]["seconds"], 1) for r in reports]
    print(f"passing run with the kill: {seconds} s per rank; gloo run: {reports[0]['gloo']['seconds']:.1f} s")
    for r in reports:
        p, g = r["passing"], r["gloo"]
        assert p["divergence"] == 0.0, "ranks' parameters differ"
        assert p["steps"] == g["steps"]
        assert abs(p["loss"] - g["loss"]) <= 0.01 * g["loss"], (p["loss"], g["loss"])
        assert abs(p["accuracy"] - g["accuracy"]) <= 0.01 and p["accuracy"] >= 0.9


@pytest.mark.timeout(600)
def test_ps_killed_mid_training_the_groups_move_to_the_second_ps(tmp_path):
    reports, killed_at = train_through_a_kill(2, tmp_path)
    check_training(reports)
    assert all(r["passing"]["started"] < killed_at < r["passing"]["ended"] for r in reports), "not mid-training"
    assert any(r["moves"] >= 1 for r in reports)  # PS 0 served at least one of the two groups
    assert not any(r["on_gloo"] for r in reports)


@pytest.mark.timeout(600)
def test_ps_killed_mid_training_with_none_left_the_groups_carry_on_over_gloo(tmp_path):
    reports, killed_at = train_through_a_kill(1, tmp_path)
    check_training(reports)
    assert all(r["passing"]["started"] < killed_at < r["passing"]["ended"] for r in reports), "not mid-training"
    assert all(r["on_gloo"] for r in reports)
