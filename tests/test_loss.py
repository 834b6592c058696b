"""Loss, duplication and reordering in both directions: results identical to a clean run."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cluster import LocalCluster

SIZE = 40_000  # 625 packets per worker


@pytest.fixture(scope="module")
def clean_results(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("clean"), workers=3, pool=64, engine="numpy")  # the specification
    try:
        yield c.results(SIZE), c.results(SIZE, dtype="int32")
    finally:
        c.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("loss", [0.01, 0.05, 0.20])
@pytest.mark.parametrize("engine", ["native", "numpy"])
def test_loss_both_directions(tmp_path, clean_results, loss, engine):
    c = LocalCluster(tmp_path, workers=3, pool=64, engine=engine, aggregator_args=[
        "--drop-ingress", str(loss), "--drop-egress", str(loss), "--seed", "7"])
    try:
        floats = c.results(SIZE, extra=["--timeout", "60"])
        ints = c.results(SIZE, dtype="int32", extra=["--timeout", "60"])
        stats = c.stats()
    finally:
        c.close()
    clean_floats, clean_ints = clean_results
    for r in floats:
        assert np.array_equal(r, clean_floats[0])
    for r in ints:
        assert np.array_equal(r, clean_ints[0])
    injected = stats["injected"]
    assert injected["ingress_dropped"] > 0 and injected["egress_dropped"] > 0
    assert stats["totals"]["duplicate"] + stats["totals"]["duplicate_answered"] > 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["native", "numpy"])
def test_duplication_and_reordering(tmp_path, clean_results, engine):
    c = LocalCluster(tmp_path, workers=3, pool=64, engine=engine, aggregator_args=[
        "--duplicate", "0.2", "--reorder", "--drop-ingress", "0.02", "--drop-egress", "0.02", "--seed", "3"])
    try:
        floats = c.results(SIZE)
        stats = c.stats()
    finally:
        c.close()
    for r in floats:
        assert np.array_equal(r, clean_results[0][0])
    assert stats["injected"]["ingress_duplicated"] > 0 and stats["injected"]["egress_duplicated"] > 0
    # a duplicated DATA packet is never added twice: every round took exactly one packet per worker
    assert stats["totals"]["aggregated"] == 3 * stats["totals"]["completed"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["native", "numpy"])
def test_loss_injected_at_the_hosts(tmp_path, clean_results, engine):
    """The host agent's own impairment (used where the aggregator is a switch)."""
    c = LocalCluster(tmp_path, workers=3, pool=64, engine=engine)
    try:
        floats = c.results(SIZE, extra=["--drop", "0.1", "--timeout", "60"])
        stats = c.stats()
    finally:
        c.close()
    for r in floats:
        assert np.array_equal(r, clean_results[0][0])
    assert stats["totals"]["duplicate"] + stats["totals"]["duplicate_answered"] > 0
