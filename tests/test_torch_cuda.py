"""CUDA tensors through backend "passing" with NCCL's stream semantics (docs/torch.md, Limits): 2
servers x 1 rank sharing one GPU (the network stage is PASSING's, so no NCCL communicator needs a GPU
of its own), on rank 0's embedded aggregator. Where there is no GPU it skips, saying so: no machine of
this project has one, so this path is unverified until it runs where one is."""

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
def test_cuda_collectives_wait_for_the_callers_stream_and_make_the_consumer_wait():
    procs = launch_ranks([*WORKER, "cuda_streams", "20"], 2, 1,
                         {"PASSING_CONTROLLER": "", "PASSING_EMBEDDED": "ps", "PASSING_TIMEOUT": "20"},
                         popen_for_server=torch_ranks)
    outcomes = collect(procs, 240)
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
        assert report["mode"] == "ps" and report["streamed"], report
        for c in report["checks"]:
            assert abs(c["seen"] - c["expected"]) < 1e-3 and abs(c["chained"] - c["expected"]) < 1e-3, c
        assert report["spread"] == 0.0 and report["losses"][-1] < report["losses"][0], report
