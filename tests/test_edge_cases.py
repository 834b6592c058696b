"""Edge cases of the streaming engine, with the aggregator and the workers as threads of this process."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from passing import Group
from passing.aggregator.control_channel import job_from_json
from passing.aggregator.server import SoftwareAggregator
from passing.launch import free_udp_ports
from tests.cluster import run_threads


@pytest.fixture(params=["native", "numpy"])
def engine(request) -> str:
    """Every edge case runs on both engines, the aggregator's and the host's alike."""
    return request.param


def allreduce_all(inputs: list[np.ndarray], shards: int = 1, pool: int = 8, engine: str = "auto",
                  out_is_input: bool = False, op: str = "sum", **group_args) -> list:
    """Run one allreduce per input, each in its own worker thread; returns results or exceptions."""
    workers = len(inputs)
    ports = free_udp_ports(workers)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    aggregators = [
        SoftwareAggregator(listen=("127.0.0.1", 0), control=None, engine=engine,
                           jobs=[job_from_json({"job": 1, "pool": pool, "workers": addresses})])
        for _ in range(shards)
    ]
    servers = [threading.Thread(target=a.serve) for a in aggregators]
    for t in servers:
        t.start()

    def work(w: int) -> np.ndarray:
        with Group(1, w, workers, [a.address for a in aggregators], pool=pool, bind=addresses[w],
                   timeout=10, engine=engine, **group_args) as g:
            return g.allreduce(inputs[w], op=op, out=inputs[w] if out_is_input else None)

    results = run_threads(work, workers)
    for a in aggregators:
        a.stop()
    for t in servers:
        t.join(10)
    return results


@pytest.mark.timeout(60)
def test_zero_shards_skip_their_sum_round(engine):
    """Two aggregators; the first block is zero on every worker, the second is not."""
    a = np.r_[np.zeros(640), np.arange(640)].astype(np.float32)
    results = allreduce_all([a, 2 * a], shards=2, engine=engine)
    for r in results:
        assert np.array_equal(r, 3 * a)


@pytest.mark.timeout(60)
def test_all_zero_input(engine):
    results = allreduce_all([np.zeros(100, np.float32)] * 2, shards=2, engine=engine)
    for r in results:
        assert np.array_equal(r, np.zeros(100, np.float32))


@pytest.mark.timeout(60)
def test_more_aggregators_than_packets(engine):
    x = np.arange(10, dtype=np.float32)
    for r in allreduce_all([x, x, x], shards=3, engine=engine):
        assert np.array_equal(r, 3 * x)


@pytest.mark.timeout(60)
def test_shape_and_dtype_are_kept(engine):
    x = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    for r in allreduce_all([x, -x, x], engine=engine):
        assert r.shape == (2, 3, 4) and r.dtype == np.int32
        assert np.array_equal(r, x)


@pytest.mark.timeout(60)
def test_int32_overflow_raises_on_every_worker(engine):
    x = np.full(70, 2**30, np.int32)
    results = allreduce_all([x, x], engine=engine)
    assert all(isinstance(r, OverflowError) for r in results), results


@pytest.mark.timeout(60)
def test_an_int32_sum_at_the_bound_counts_as_saturated(engine):
    """Tofino saturates without a flag, so the host reads a lane at ±bound as overflow."""
    x = np.zeros(70, np.int32)
    x[3] = np.iinfo(np.int32).max
    results = allreduce_all([x, np.zeros(70, np.int32)], engine=engine)
    assert all(isinstance(r, OverflowError) for r in results), results
    x[3] = np.iinfo(np.int32).max - 1  # one below: exact
    results = allreduce_all([x, np.zeros(70, np.int32)], engine=engine)
    assert all(np.array_equal(r, x) for r in results), results


@pytest.mark.timeout(60)
def test_fixed_scale_overflow_can_fall_back_to_auto(engine):
    x = np.linspace(-50, 50, 300).astype(np.float32)
    results = allreduce_all([x, x], scale=1e8, on_overflow="auto", engine=engine)
    for r in results:
        assert np.max(np.abs(r - 2 * x)) < 1e-5


@pytest.mark.timeout(60)
def test_many_calls_wrap_the_slot_sets(engine):
    """Several calls in a row on a tiny pool: psns run on across calls and sets alternate."""
    ports = free_udp_ports(2)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, engine=engine,
                             jobs=[job_from_json({"job": 1, "pool": 3, "workers": addresses})])
    server = threading.Thread(target=agg.serve)
    server.start()

    def work(w: int) -> list[np.ndarray]:
        with Group(1, w, 2, [agg.address], pool=3, bind=addresses[w], timeout=10, engine=engine) as g:
            return [g.allreduce(np.full(100 + i, w + i, np.int32)) for i in range(20)]

    out = run_threads(work, 2)
    agg.stop()
    server.join(10)
    for w in range(2):
        assert isinstance(out[w], list) and len(out[w]) == 20, out[w]
        for i, r in enumerate(out[w]):
            assert np.array_equal(r, np.full(100 + i, 1 + 2 * i, np.int32))


@pytest.mark.timeout(60)
def test_the_result_goes_to_out_even_when_out_is_the_input(engine):
    x = np.arange(1000, dtype=np.float32)
    inputs = [x.copy(), x.copy()]
    results = allreduce_all(inputs, engine=engine, out_is_input=True)
    for r, buffer in zip(results, inputs):
        assert r is buffer and np.array_equal(r, 2 * x)
