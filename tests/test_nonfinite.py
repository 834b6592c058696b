"""NaN and infinities in an allreduce: IEEE float32 sums element by element, as gloo and NCCL give,
on both host engines, in auto and fixed scale modes; never an exception for data."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_edge_cases import allreduce_all


def ieee_sum(inputs: list[np.ndarray]) -> np.ndarray:
    total = inputs[0].astype(np.float64)
    with np.errstate(invalid="ignore"):
        for x in inputs[1:]:
            total = total + x.astype(np.float64)  # inf + -inf = nan; nan propagates
    return total


def check(results: list, inputs: list[np.ndarray], tolerance: float) -> None:
    expected = ieee_sum(inputs)
    for r in results:
        assert not isinstance(r, Exception), r
        assert np.array_equal(np.isnan(r), np.isnan(expected))
        assert np.array_equal(np.isposinf(r), np.isposinf(expected))
        assert np.array_equal(np.isneginf(r), np.isneginf(expected))
        finite = np.isfinite(expected)
        assert np.max(np.abs(r[finite] - expected[finite]), initial=0) <= tolerance
    for r in results[1:]:
        assert np.array_equal(r, results[0], equal_nan=True)  # every worker holds the same bits


def inputs_with(workers: int, size: int = 3000, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    xs = [rng.uniform(-2, 2, size).astype(np.float32) for _ in range(workers)]
    xs[0][::101] = np.nan
    xs[0][5::50] = np.inf
    xs[-1][5::100] = -np.inf  # meets +inf at every other one of those: NaN there, -inf elsewhere
    xs[-1][7::70] = np.inf
    return xs


@pytest.fixture(params=["native", "numpy"])
def engine(request) -> str:
    return request.param


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 3, 8])
def test_auto_scale_sums_like_ieee(engine, workers):
    xs = inputs_with(workers)
    check(allreduce_all(xs, shards=2, engine=engine), xs, tolerance=1e-5 * workers)


@pytest.mark.timeout(60)
def test_an_infinity_does_not_drive_the_scale_of_the_finite_values_to_zero(engine):
    xs = [np.full(1000, 1e-3, np.float32), np.full(1000, 2e-3, np.float32)]
    xs[0][0] = np.inf
    results = allreduce_all(xs, engine=engine)
    check(results, xs, tolerance=1e-9)


@pytest.mark.timeout(60)
def test_a_block_of_nothing_but_non_finite_values(engine):
    xs = [np.full(640, np.inf, np.float32), np.zeros(640, np.float32), np.full(640, -np.inf, np.float32)]
    check(allreduce_all(xs, shards=2, engine=engine), xs, tolerance=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_overflow", ["raise", "auto"])
def test_fixed_scale_with_non_finite_input_is_no_error(engine, on_overflow):
    xs = inputs_with(2, seed=1)
    results = allreduce_all(xs, engine=engine, scale=1e6, on_overflow=on_overflow)
    check(results, xs, tolerance=1e-5)


@pytest.mark.timeout(60)
def test_average_and_in_place(engine):
    xs = inputs_with(2, seed=2)
    expected = [x.copy() for x in xs]
    results = allreduce_all(xs, engine=engine, out_is_input=True, op="avg")
    halves = [x / 2 for x in expected]
    check(results, halves, tolerance=1e-5)
