"""Real multi-process runs on loopback: aggregator processes plus worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cluster import local
from passing import launch
from passing.aggregator.control_channel import ControlClient
from passing.cli import worker_inputs
from passing.launch import free_udp_ports
from tests.zygote import CLI_PRELOAD, ForkedProcess, shared


def service_popen(argv: list[str], **kwargs: Any) -> ForkedProcess:
    """A service (`passing-aggregator serve`, `passing-controller`) forked from a process that
    imported passing and passing_controller already (tests/zygote.py): a fresh interpreter spent
    about 0.3 s of CPU on its imports, and the suite starts over a hundred services. Its stdout is
    read while it runs (the ready line)."""
    return shared(CLI_PRELOAD).popen(argv, live_stdout=True, **kwargs)


def start_aggregator(extra: list[str] | None = None, host: str = "127.0.0.1") -> tuple[ForkedProcess, dict]:
    """``passing.launch.start_aggregator``, forked."""
    return launch.start_aggregator(extra, host, popen=service_popen)


def start_controller(topology: dict[str, Any], workdir: Path, listen: str, extra: Sequence[str] = ()
                     ) -> tuple[ForkedProcess, dict[str, Any]]:
    """``cluster.local.start_controller``, forked."""
    return local.start_controller(topology, workdir, listen, extra, popen=service_popen)


def run_threads(work: Callable[[int], object], count: int, timeout: float = 60) -> list:
    """work(0..count-1), each in its own thread; each one's return value or exception."""
    out: list = [None] * count

    def run(i: int) -> None:
        try:
            out[i] = work(i)
        except Exception as e:  # handed to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out


@dataclass
class WorkerOutcome:
    returncode: int
    report: dict
    stderr: str
    result: np.ndarray | None
    seconds: float


@dataclass
class LocalCluster:
    """``shards`` aggregators and one job of ``workers`` worker processes."""

    tmp: Path
    workers: int
    shards: int = 1
    pool: int = 64
    lanes: int = 64
    aggregator_args: list[str] = field(default_factory=list)
    job: int = 1
    engine: str = "auto"  # of the workers and the aggregators: native, numpy or auto

    def __post_init__(self) -> None:
        self.aggregators = []
        for i in range(self.shards):
            args = [a.replace("{shard}", str(i)) for a in self.aggregator_args]
            proc, ready = start_aggregator(["--lanes", str(self.lanes), "--engine", self.engine, *args])
            self.aggregators.append((proc, ready))
        self.worker_addresses = [f"127.0.0.1:{p}" for p in free_udp_ports(self.workers)]
        self.admitted = False
        self.generation = -1

    def admit(self) -> None:
        """A fresh allocation (the next generation): new worker processes start their psn streams at 0 again."""
        self.generation += 1
        for shard in range(self.shards):
            if self.admitted:
                self.control(shard).request("remove_job", job=self.job)
            self.control(shard).request("add_job", job={"job": self.job, "pool": self.pool,
                                                        "generation": self.generation,
                                                        "workers": self.worker_addresses})
        self.admitted = True

    def control(self, shard: int = 0) -> ControlClient:
        return ControlClient(self.aggregators[shard][1]["control"])

    def stats(self, shard: int = 0) -> dict:
        return self.control(shard).request("stats")

    def start_worker(self, worker: int, size: int, dtype: str = "float32", seed: int = 0, extra: list[str] = ()
                     ) -> ForkedProcess:
        cmd = [sys.executable, "-m", "passing.cli", "allreduce", "--job", str(self.job),
               "--generation", str(self.generation), "--worker", str(worker),
               "--workers", str(self.workers), "--bind", self.worker_addresses[worker], "--pool", str(self.pool),
               "--lanes", str(self.lanes), "--size", str(size), "--dtype", dtype, "--seed", str(seed),
               "--out", str(self.tmp / f"result-{worker}.npy"), "--no-check", "--engine", self.engine, *extra]
        for _, ready in self.aggregators:
            cmd += ["--aggregator", ready["data"]]
        # forked from a process that imported passing already: a test starts many workers
        return shared(CLI_PRELOAD).popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, size: int, dtype: str = "float32", seed: int = 0, extra: list[str] = (),
            timeout: float = 240) -> list[WorkerOutcome]:
        for w in range(self.workers):
            (self.tmp / f"result-{w}.npy").unlink(missing_ok=True)
        self.admit()
        start = time.monotonic()
        procs = [self.start_worker(w, size, dtype, seed, list(extra)) for w in range(self.workers)]
        outcomes = []
        for w, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise
            path = self.tmp / f"result-{w}.npy"
            outcomes.append(WorkerOutcome(
                returncode=proc.returncode,
                report=json.loads(out.splitlines()[-1]) if out.strip() else {},
                stderr=err,
                result=np.load(path) if path.exists() else None,
                seconds=time.monotonic() - start,
            ))
        return outcomes

    def results(self, size: int, dtype: str = "float32", seed: int = 0, extra: list[str] = ()) -> list[np.ndarray]:
        """Run and insist that every worker succeeded."""
        outcomes = self.run(size, dtype, seed, extra)
        for w, o in enumerate(outcomes):
            assert o.returncode == 0 and o.result is not None, f"worker {w} failed: {o.stderr}"
        return [o.result for o in outcomes]

    def inputs(self, size: int, dtype: str = "float32", seed: int = 0) -> list[np.ndarray]:
        return [worker_inputs(seed, w, size, dtype) for w in range(self.workers)]

    def close(self) -> None:
        for proc, _ in self.aggregators:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
