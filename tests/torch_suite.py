"""PyTorch's own distributed test suite against backend "passing" (or gloo, the reference).

The tests of ``torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase``,
which torch's test/distributed/test_distributed_spawn.py runs for gloo. The suite decides at import,
by the name in BACKEND, which tests a backend runs and how (hooks, futures, timeouts, gloo's error
texts are gated on "gloo"). Declared a plugin backend, "passing" would skip a third of what gloo runs;
so the suite is imported as gloo's, every test gloo runs is collected, and each rank initialises its
process group with the backend under test, ``PASSING_SUITE_BACKEND`` (passing or gloo): whatever runs
on gloo must run the same on it. The ranks are forked from this process (torch is imported once) and
sit on servers of ``PASSING_SUITE_RANKS_PER_SERVER`` ranks (PASSING_SERVER by rank: 4 ranks are 2
servers x 2).

Run by tests/test_torch_suite.py (``make test-torch-suite``), which compares the two backends:

    PASSING_SUITE_BACKEND=passing WORLD_SIZE=4 TEMP_DIR=$(mktemp -d) python -m pytest tests/torch_suite.py -k all_reduce

The other variables are torch's (WORLD_SIZE, TEMP_DIR) and the backend's (PASSING_*).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

SUITE_BACKEND = os.environ.get("PASSING_SUITE_BACKEND", "passing")
RANKS_PER_SERVER = int(os.environ.get("PASSING_SUITE_RANKS_PER_SERVER", "2"))
os.environ["BACKEND"] = "gloo"  # the suite's own choice of tests, read when it is imported

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    CUSTOM_PG_TIMEOUT,
    DistributedTest,
    TestDistBackend,
    default_pg_timeout,
)

import passing.torch  # noqa: E402, F401  (registers backend "passing")


class TestSuiteOnBackend(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        # forked, not spawned as torch's own file does: each rank saves importing torch again (seconds
        # a test on 2 cores); nothing of the backend exists in this process to be forked
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe, **kwargs) -> None:  # noqa: ANN001, ARG003
        """One rank: TestDistBackend's, with the process group of the backend under test."""
        os.environ["PASSING_SERVER"] = f"suite-server-{rank // RANKS_PER_SERVER}"
        self = cls(test_name)
        self.rank, self.file_name = rank, file_name
        timeout = timedelta(seconds=CUSTOM_PG_TIMEOUT.get(test_name, default_pg_timeout))
        dist.init_process_group(init_method=self.init_method, backend=SUITE_BACKEND,
                                world_size=int(self.world_size), rank=rank, timeout=timeout)
        self._barrier()  # every rank is initialised before a test that skips at once exits
        self.run_test(test_name, pipe)
        self._barrier()
        dist.destroy_process_group()
        sys.exit(0)
