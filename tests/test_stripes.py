"""A group striped over several streams (passing.stripes): the same bits as one stream for every reduce kind
(float32 through its auto scale, int32, reduce_scatter's OWNER_ONLY rounds) and all_gather, under loss too; the
packets spread over the streams' jobs; how many streams a link needs."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from passing import Group, native
from passing.aggregator.control_channel import job_from_json
from passing.aggregator.server import Impairment, SoftwareAggregator
from passing.launch import free_udp_ports
from passing.stripes import default_streams

pytestmark = pytest.mark.skipif(not native.available(), reason="the native library is not built")

WORKERS, STREAMS, POOL = 2, 3, 32


def run_workers(streams: int, drop: float = 0.0) -> tuple[list[tuple[np.ndarray, ...]], dict]:
    """Each worker's outputs with ``streams`` streams (jobs 1.., one aggregator), and the aggregator's stats."""
    # distinct blocks of 8 ports (two free ports may share one): worker w's stream s binds its block's base + s
    bases = list(dict.fromkeys(p - p % 8 for p in free_udp_ports(4 * WORKERS)))[:WORKERS]
    jobs = [job_from_json({"job": 1 + s, "pool": POOL, "base": s * POOL, "generation": 0,
                           "workers": [f"127.0.0.1:{bases[w] + s}" for w in range(WORKERS)]}) for s in range(streams)]
    rng = np.random.default_rng(5)
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, jobs=jobs, engine="native",
                             ingress=Impairment(drop, rng=rng), egress=Impairment(drop, rng=rng))
    serving = threading.Thread(target=agg.serve, daemon=True)
    serving.start()
    out: list[tuple[np.ndarray, ...]] = [()] * WORKERS
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        r = np.random.default_rng(w)
        x = r.standard_normal(100_003, dtype=np.float32)
        xi = r.integers(-1000, 1000, 100_000, dtype=np.int32)
        try:
            with Group(1, w, WORKERS, ["{}:{}".format(*agg.address)], pool=POOL, bind=f"127.0.0.1:{bases[w]}",
                       engine="native", io="udp", streams=streams, rto=0.01, max_rto=0.1) as g:
                assert g.streams == streams
                out[w] = (g.allreduce(x), g.allreduce(xi), g.reduce_scatter(xi), g.allgather(x[:999]))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stats = agg.stats()
    agg.stop()
    serving.join(10)
    agg.close()
    assert not errors, errors
    return out, stats


def test_striped_streams_give_one_streams_bits():
    one, _ = run_workers(1)
    several, stats = run_workers(STREAMS)
    for a, b in zip(one, several):
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and np.array_equal(x, y)
    # every stream's job carried its part of the packets
    assert all(stats["jobs"][str(1 + s)]["aggregated"] > 0 for s in range(STREAMS))


def test_striped_streams_under_loss():
    one, _ = run_workers(1)
    lossy, stats = run_workers(STREAMS, drop=0.03)
    assert stats["injected"]["ingress_dropped"] > 0
    for a, b in zip(one, lossy):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_streams_need_the_native_engine_and_a_job_per_stream():
    (port,) = free_udp_ports(1)
    with pytest.raises(ValueError, match="streams=2"):
        Group(1, 0, 1, ["127.0.0.1:9"], bind=f"127.0.0.1:{port}", engine="numpy", streams=2)
    with pytest.raises(ValueError, match="stream_jobs names 2 jobs for 1"):
        Group(1, 0, 1, ["127.0.0.1:9"], bind=f"127.0.0.1:{port}", engine="native", streams=2, stream_jobs=[5, 6])


def test_default_streams_from_the_per_core_rate():
    assert default_streams(12.5, 64, per_core=5.0) == 3
    assert default_streams(4.0, 64, per_core=5.0) == 1
    assert default_streams(100.0, 64, per_core=5.0, most=8) == 8
    assert default_streams(12.5, 64) >= 2  # the measured 64-lane rate is below 12.5 Gbit/s
    with pytest.raises(ValueError):
        default_streams(0, 64)


def test_an_answer_must_admit_the_streams_the_caller_asked_for():
    """A controller that knows no streams answers none: a caller that asked for two is told, not given one."""
    from passing.stripes import answer_options

    answer = {"job_id": 1, "generation": 3, "streams": 3, "stream_jobs": [[7, 1], [9, 0]]}
    assert answer_options(answer, {"streams": 3})["stream_jobs"] == [(7, 1), (9, 0)]
    assert answer_options({"job_id": 1}, {}) == {}
    with pytest.raises(ValueError, match="streams=2, but the controller admitted 1"):
        answer_options({"job_id": 1}, {"streams": 2})
