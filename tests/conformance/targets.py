"""Targets for the scenario runner that need no switch: the pure engine and the UDP aggregator."""

from __future__ import annotations

import socket
import subprocess
import time

import numpy as np

from passing import launch, wire
from passing.aggregator.control_channel import ControlClient
from passing.aggregator.engine import JobSpec, Uplink
from passing.aggregator.native_engine import make_engine
from passing.transport import pack_address
from tests.cluster import start_aggregator

from .runner import Origin
from .scenarios import Job

STRANGER = "stranger"
ROOT = "root"  # a leaf's root (tree_scenarios.py)


class EngineTarget:
    """The pure state machine, the numpy or the native engine; origins are small integers."""

    def __init__(self, slots: int = 64, lanes: int = 8, engine: str = "numpy") -> None:
        self.lanes = lanes
        self.engine = make_engine(slots, lanes, engine=engine)
        self.origins: dict[Origin, int] = {STRANGER: 10_000}
        self.outbox: list[tuple[Origin, bytes]] = []

    def _origin(self, key: Origin) -> int:
        return self.origins.setdefault(key, len(self.origins))

    def admit(self, job: Job) -> None:
        sources = [self._origin((job.job, w)) for w in range(job.workers)]
        up = job.up and Uplink(job.up.job, job.up.generation, job.up.worker, self._origin(ROOT))
        self.engine.add_job(JobSpec(job.job, job.base, job.pool, sources, generation=job.generation, lanes=job.lanes,
                                    role=job.role, owners=None if job.owners is None else list(job.owners), up=up))

    def remove(self, job: int) -> None:
        self.engine.remove_job(job)

    def send(self, origin: Origin, payload: bytes) -> None:
        raw = np.frombuffer(payload, dtype=np.uint8)
        size = wire.packet_size(self.lanes)
        batch = np.zeros(1, wire.packet_dtype(self.lanes))
        batch.view(np.uint8)[: min(size, raw.size)] = raw[:size]
        out = self.engine.process(batch, np.array([self._origin(origin)]), np.array([raw.size]))
        by_id = {v: k for k, v in self.origins.items()}
        self.outbox += [(by_id[int(d)], p.tobytes()[:n]) for d, p, n in zip(out.dest, out.packets, out.lengths)]

    def collect(self) -> list[tuple[Origin, bytes]]:
        out, self.outbox = self.outbox, []
        return out

    def counters(self) -> dict[str, int]:
        return self.engine.counters()


class UdpAggregatorTarget:
    """A real `passing-aggregator serve` process; every (job, worker) a real UDP socket.

    ``namespace``: the aggregator runs in that network namespace at ``aggregator_host`` (tests/test_xdp.py: over
    AF_XDP on its veth), the sockets are bound to ``host`` (this process's namespace's address)."""

    def __init__(self, lanes: int = 8, extra_args: list[str] | None = None, engine: str = "numpy",
                 host: str = "127.0.0.1", namespace: str | None = None, aggregator_host: str = "127.0.0.1") -> None:
        self.lanes, self.host = lanes, host
        args = ["--lanes", str(lanes), "--slots", "64", "--engine", engine, *(extra_args or [])]
        if namespace is None:
            self.proc, ready = start_aggregator(args)
        else:
            self.proc, ready = launch.start_aggregator(
                args, aggregator_host, popen=lambda cmd, **kw: subprocess.Popen(["ip", "netns", "exec", namespace,
                                                                                   *cmd], **kw))
        assert ready["engine"] == engine
        self.io = ready.get("io")
        self.control = ControlClient(ready["control"])
        host, port = ready["data"].rsplit(":", 1)
        self.aggregator = (host, int(port))
        self.sockets: dict[Origin, socket.socket] = {}
        self.sent = self.looked_at()

    def looked_at(self) -> int:
        """Datagrams the aggregator has processed: the PASSING packets (received) and the rest (malformed)."""
        totals = self.counters_raw()["totals"]
        return totals["received"] + totals["malformed"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        for s in self.sockets.values():
            s.close()

    def _socket(self, key: Origin) -> socket.socket:
        if key not in self.sockets:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((self.host, 0))
            s.setblocking(False)
            self.sockets[key] = s
        return self.sockets[key]

    def admit(self, job: Job) -> None:
        workers = ["{}:{}".format(*self._socket((job.job, w)).getsockname()) for w in range(job.workers)]
        obj = {"job": job.job, "base": job.base, "pool": job.pool, "workers": workers, "generation": job.generation,
               "lanes": job.lanes}
        if job.role != "flat":  # a tree's job (docs/protocol.md, control channel)
            obj.update(role=job.role, owners=None if job.owners is None else list(job.owners))
        if job.up is not None:
            obj["up"] = {"job": job.up.job, "generation": job.up.generation, "worker": job.up.worker,
                         "root": "{}:{}".format(*self._socket(ROOT).getsockname())}
        self.control.request("add_job", job=obj)

    def remove(self, job: int) -> None:
        self.control.request("remove_job", job=job)

    def send(self, origin: Origin, payload: bytes) -> None:
        self._socket(origin).sendto(payload, self.aggregator)
        self.sent += 1

    def collect(self) -> list[tuple[Origin, bytes]]:
        deadline = time.monotonic() + 5
        while self.looked_at() < self.sent:  # processed, so answers are queued
            if time.monotonic() > deadline:
                raise TimeoutError("the aggregator did not process what was sent")
            time.sleep(0.001)
        out = []
        for key, s in self.sockets.items():
            while True:
                try:
                    data, src = s.recvfrom(65536)
                except BlockingIOError:
                    break
                assert pack_address(*src) == pack_address(*self.aggregator), f"RESULT from {src}"
                out.append((key, data))
        return out

    def counters_raw(self) -> dict:
        return self.control.request("stats")

    def counters(self) -> dict[str, int]:
        return self.counters_raw()["totals"]

