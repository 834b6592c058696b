"""DDP, PostLocalSGD and the DDP comm hook over backend "passing" (demo/train.py's loop),
in real rank processes against a software aggregator behind a PS-only controller."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")
pytest.importorskip("sklearn", reason="scikit-learn is not installed (pip install -e 'host[test]')")

from tests.test_torch_backend import run, services  # noqa: E402, F401  (the fixture)


@pytest.mark.timeout(400)
def test_ddp_keeps_ranks_identical_and_matches_gloo(services):  # noqa: F811
    for r in run(services, "ddp", 2, 2, "15", timeout=360):
        p, g = r["passing"], r["gloo"]
        assert p["steps"] >= 300 and p["checks"] >= 30
        assert p["divergence"] == 0.0, "ranks' parameters differ"
        assert abs(p["loss"] - g["loss"]) <= 0.01 * g["loss"], (p["loss"], g["loss"])
        assert p["accuracy"] >= 0.9


@pytest.mark.timeout(400)
def test_post_local_sgd_runs_and_converges(services):  # noqa: F811
    for r in run(services, "post_local_sgd", 2, 2, "8", timeout=360):
        assert r["streamed"], "no all_reduce went through PASSING"
        assert r["loss"] < 0.1 * r["history"][0], r["history"]
        assert r["accuracy"] >= 0.9


@pytest.mark.timeout(400)
def test_comm_hook_on_a_gloo_default_group(services):  # noqa: F811
    for r in run(services, "hook", 2, 1, "6", timeout=360):
        h, g = r["hook"], r["gloo"]
        assert h["bytes_sent"] > 0, "the hook did not go through PASSING"
        assert h["divergence"] == 0.0 and h["checks"] >= 10
        assert abs(h["loss"] - g["loss"]) <= 0.01 * g["loss"], (h["loss"], g["loss"])
