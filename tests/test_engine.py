"""The aggregation engine beyond the scenario table: batches, admission, counters."""

from __future__ import annotations

import numpy as np
import pytest

from passing import wire
from passing.aggregator.engine import AggregationEngine, ConfigError, JobSpec

LANES = 4


def data(job, worker, psn, values, pool, flags=0, op=wire.SUM):
    return wire.encode(type=wire.DATA, job=job, worker=worker, psn=psn, pool=pool, payload=values,
                       flags=flags, op=op, lanes=LANES)


def test_a_batch_equals_the_same_packets_one_by_one():
    """The wave split of a batch must not change any outcome, byte for byte."""
    rng = np.random.default_rng(42)
    workers, pool = 5, 3
    packets = []
    for psn in range(12):  # several rounds per slot, both sets, duplicates, stale and shuffled
        for w in rng.permutation(workers):
            packets.append(data(1, int(w), psn, rng.integers(-100, 100, LANES), pool))
            if rng.random() < 0.3:
                packets.append(data(1, int(w), max(0, psn - int(rng.integers(0, 8))), [0] * LANES, pool,
                                    flags=wire.FLAG_RETRANSMIT))
    batch = np.concatenate(packets).astype(wire.packet_dtype(LANES))
    sources = batch["hdr"]["worker"].astype(np.int64) + 100

    def engine():
        e = AggregationEngine(slots=8, lanes=LANES)
        e.add_job(JobSpec(1, 2, pool, [100 + w for w in range(workers)]))
        return e

    one = engine()
    singles = [one.process(batch[i : i + 1], sources[i : i + 1]) for i in range(len(batch))]
    whole = engine()
    out = whole.process(batch, sources)
    assert out.packets.dtype == wire.packet_dtype(LANES)  # big-endian on the wire, always
    assert sorted(zip(np.concatenate([s.dest for s in singles]).tolist(),
                      [p.tobytes() for s in singles for p in s.packets])) == \
        sorted(zip(out.dest.tolist(), [p.tobytes() for p in out.packets]))
    assert one.counters() == whole.counters()
    assert whole.counters()["completed"] == 12


def test_counters_per_job_and_totals():
    e = AggregationEngine(slots=8, lanes=LANES)
    e.add_job(JobSpec(1, 0, 2, [10, 11]))
    e.add_job(JobSpec(2, 2, 2, [20]))
    batch = np.concatenate([data(1, 0, 0, [1] * 4, 2), data(2, 0, 0, [1] * 4, 2), data(9, 0, 0, [1] * 4, 2)])
    e.process(batch, np.array([10, 20, 30]))
    assert e.counters(1)["aggregated"] == 1 and e.counters(1)["completed"] == 0
    assert e.counters(2)["completed"] == 1 and e.counters(2)["results_sent"] == 1
    assert e.counters()["rejected"] == 1 and e.counters()["received"] == 3
    with pytest.raises(ConfigError, match="not admitted"):
        e.counters(9)


def test_admission_errors():
    e = AggregationEngine(slots=8, lanes=LANES, max_jobs=2)
    with pytest.raises(ConfigError, match="workers"):
        e.add_job(JobSpec(1, 0, 2, list(range(33))))
    with pytest.raises(ConfigError, match="distinct"):
        e.add_job(JobSpec(1, 0, 2, [5, 5]))
    with pytest.raises(ConfigError, match="outside"):
        e.add_job(JobSpec(1, 6, 4, [1]))
    with pytest.raises(ConfigError, match="job id"):
        e.add_job(JobSpec(70000, 0, 1, [1]))
    e.add_job(JobSpec(1, 0, 4, [1]))
    with pytest.raises(ConfigError, match="overlaps"):
        e.add_job(JobSpec(2, 3, 2, [2]))
    e.add_job(JobSpec(2, 4, 2, [2]))
    with pytest.raises(ConfigError, match="no room"):
        e.add_job(JobSpec(3, 6, 2, [3]))
    e.remove_job(1)
    e.add_job(JobSpec(3, 0, 4, [3]))  # the range and the dense id are free again
    assert [j.job for j in e.jobs()] == [2, 3]


def test_generations_follow_each_other_per_job_id():
    e = AggregationEngine(slots=8, lanes=LANES)
    first = e.add_job(JobSpec(1, 0, 2, [1]))
    assert first.generation == 0 and first.epoch == 1 << 16
    e.remove_job(1)
    assert e.add_job(JobSpec(1, 0, 2, [1])).generation == 1
    e.remove_job(1)
    assert e.add_job(JobSpec(1, 0, 2, [1], generation=100)).generation == 100
    e.remove_job(1)
    assert e.add_job(JobSpec(1, 0, 2, [1])).generation == 101
    assert e.add_job(JobSpec(2, 2, 2, [2])).generation == 0  # its own sequence per job id
    e.remove_job(1)
    with pytest.raises(ConfigError):
        e.add_job(JobSpec(1, 0, 2, [1], generation=1 << 16))


def test_a_packet_of_another_generation_is_rejected_and_touches_nothing():
    e = AggregationEngine(slots=8, lanes=LANES)
    e.add_job(JobSpec(1, 0, 2, [10, 11], generation=5))
    late = wire.encode(type=wire.DATA, job=1, worker=0, psn=0, pool=2, payload=[7] * LANES, generation=4,
                       lanes=LANES)
    before = e.acc.copy(), e.tag.copy(), e.bitmap.copy()
    assert len(e.process(late, np.array([10]))) == 0
    assert e.counters(1)["rejected"] == 1 and e.counters(1)["aggregated"] == 0
    assert all((a == b).all() for a, b in zip(before, (e.acc, e.tag, e.bitmap)))
    ours = wire.encode(type=wire.DATA, job=1, worker=0, psn=0, pool=2, payload=[1] * LANES, generation=5,
                       lanes=LANES)
    e.process(ours, np.array([10]))
    ours["hdr"]["worker"] = 1
    out = e.process(ours, np.array([11]))
    assert len(out) == 2 and (out.packets["hdr"]["generation"] == 5).all()
    assert (out.packets["payload"] == 2).all()
