"""CUDA tensors through backend "passing" with NCCL's stream semantics (docs/torch.md, Limits): 2
servers x 1 rank, and 2 x 2 (the in-host stage too), sharing one GPU, on rank 0's embedded aggregator.
NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so what PASSING does not stream (DDP's
start-up all_gather and broadcast, the in-host stage) goes to gloo: PASSING_DEVICE_BACKEND=gloo.
Where there is no GPU it skips, saying so (CI has none; it runs on a lent GPU machine)."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")
pytest.importorskip("sklearn", reason="scikit-learn is not installed (pip install -e 'host[test]')")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here: the CUDA path of backend 'passing' is untested on this machine",
                allow_module_level=True)

from cluster.local import collect, launch_ranks  # noqa: E402
from tests.zygote import torch_ranks  # noqa: E402

WORKER = [sys.executable, "-m", "tests.torch_worker"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("servers,local", [(2, 1), (2, 2)], ids=["2x1", "2x2-in-host"])
def test_cuda_collectives_wait_for_the_callers_stream_and_make_the_consumer_wait(servers: int, local: int):
    procs = launch_ranks([*WORKER, "cuda_streams", "20"], servers, local,
                         {"PASSING_CONTROLLER": "", "PASSING_EMBEDDED": "ps", "PASSING_TIMEOUT": "20",
                          "PASSING_DEVICE_BACKEND": "gloo"},
                         popen_for_server=torch_ranks)
    outcomes = collect(procs, 240)
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
        assert report["mode"] == "ps" and report["streamed"], report
        for c in report["checks"]:
            assert abs(c["seen"] - c["expected"]) < 1e-3 and abs(c["chained"] - c["expected"]) < 1e-3, c
        assert report["spread"] == 0.0 and report["losses"][-1] < report["losses"][0], report
        assert report["off_reference"] < 1e-4, report  # PASSING's scaled integer sums: ~1e-7 relative
