"""End to end on loopback: worker processes, a real aggregator process, real UDP."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from passing.cli import float_error_bound
from tests.cluster import LocalCluster

MIB16 = 4 * 1024 * 1024  # float32 elements in 16 MiB


@pytest.fixture
def cluster_factory(tmp_path):
    made = []

    def make(**kwargs) -> LocalCluster:
        c = LocalCluster(tmp_path, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def check_float(cluster: LocalCluster, results: list[np.ndarray], size: int, op: str = "sum") -> None:
    inputs = cluster.inputs(size)
    expected = np.sum(inputs, axis=0, dtype=np.float64)
    if op == "avg":
        expected /= cluster.workers
    bound = float_error_bound(inputs, expected, op)
    for r in results:
        assert r.dtype == np.float32 and r.shape == (size,)
        assert np.array_equal(r, results[0]), "workers disagree"
        assert np.max(np.abs(r - expected)) <= bound


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "workers,size",
    [(2, 1), (2, 1000), (2, MIB16), (4, 1), (4, 100_003), (4, MIB16 // 4), (8, 1), (8, 65_537), (8, MIB16)],
)
def test_float_sum(cluster_factory, workers, size):
    c = cluster_factory(workers=workers, pool=256)
    check_float(c, c.results(size), size)


@pytest.mark.timeout(120)
def test_int32_sum_is_exact(cluster_factory):
    c = cluster_factory(workers=4)
    results = c.results(100_000, dtype="int32")
    expected = np.sum(c.inputs(100_000, "int32"), axis=0, dtype=np.int64)
    for r in results:
        assert r.dtype == np.int32
        assert np.array_equal(r, expected)


@pytest.mark.timeout(120)
def test_average(cluster_factory):
    c = cluster_factory(workers=4)
    check_float(c, c.results(10_000, extra=["--op", "avg"]), 10_000, op="avg")


@pytest.mark.timeout(120)
def test_several_aggregators_split_the_stream(cluster_factory):
    """Three shards, each its own aggregator process, pool and psn stream."""
    c = cluster_factory(workers=3, shards=3, pool=32)
    size = 50_000
    check_float(c, c.results(size), size)
    received = [c.stats(s)["totals"]["aggregated"] for s in range(3)]
    packets = -(-size // 64)
    # every shard carried about a third of the packets (plus one MAX round each), from each worker
    assert all(abs(r - 3 * (packets / 3 + 1)) <= 3 * 2 for r in received), received


@pytest.mark.timeout(120)
def test_fixed_scale(cluster_factory):
    c = cluster_factory(workers=2)
    size = 5000
    results = c.results(size, extra=["--scale", "1e6"])
    expected = np.sum(c.inputs(size), axis=0, dtype=np.float64)
    for r in results:
        assert np.max(np.abs(r - expected)) <= 2 * 0.5 / 1e6 + np.max(np.abs(expected)) * 2.0**-23


@pytest.mark.timeout(120)
def test_fixed_scale_overflow_is_an_error_on_every_worker(cluster_factory):
    c = cluster_factory(workers=2)
    outcomes = c.run(5000, extra=["--scale", "1e9"])  # |x| reaches 100: 1e11 does not fit int32
    for o in outcomes:
        assert o.returncode == 1
        assert "overflowed int32" in o.stderr


@pytest.mark.timeout(120)
def test_until_keeps_every_worker_calling_until_the_file_appears_and_they_agree(cluster_factory, tmp_path):
    """`passing-allreduce --until FILE`: past its --iterations the job goes on until the file
    exists (a test's job outlives its fault, whatever the machine's speed), and the workers agree
    on when to stop: every one makes the same calls, however late each sees the file."""
    c = cluster_factory(workers=3)
    size, done = 1000, tmp_path / "attack-over"
    c.admit()
    procs = [c.start_worker(w, size, extra=["--iterations", "2", "--until", str(done)]) for w in range(3)]
    per_call = -(-size // 64) + 1  # rounds of one call: its packets and its MAX round
    while c.stats()["totals"]["completed"] < 10 * per_call:  # well past the 2 iterations
        assert all(p.poll() is None for p in procs), "a worker stopped before the file appeared"
        time.sleep(0.05)
    done.touch()
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        reports.append(json.loads(out.splitlines()[-1]))
    assert len({r["calls"] for r in reports}) == 1 and reports[0]["calls"] > 2, reports  # same calls, past --iterations
    check_float(c, [np.load(tmp_path / f"result-{w}.npy") for w in range(3)], size)
