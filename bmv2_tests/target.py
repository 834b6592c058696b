"""The scenario-table target on BMv2: real hosts, real packets, P4Runtime for admission and counters."""

from __future__ import annotations

import json
import time

from passing import wire
from passing_controller import admission, counters, result_rewrite
from passing_controller.allocation import Allocation, Worker
from passing_controller.session import Switch
from passing_controller.topology import Host
from tests.conformance.runner import Origin
from tests.conformance.scenarios import Job

from .network import AGGREGATION_IP, Bmv2Network


class Bmv2Target:
    """Each (job, worker) origin is a UDP socket in one of the hosts, round robin over all
    hosts but the last; the last host is the stranger that no job admits."""

    lanes = wire.DEFAULT_LANES

    def __init__(self, network: Bmv2Network, switch: Switch) -> None:
        self.network, self.switch = network, switch
        self.workers_hosts = network.hosts[:-1]
        self.stranger = network.hosts[-1]
        self.origins: dict[str, tuple[Host, int]] = {}
        self.allocations: dict[int, Allocation] = {}
        self.baseline = self._totals()
        self.sent = 0
        self.collected = 0
        # The counters as last read, while nothing was sent since: a read costs BMv2 about 50 ms per
        # counter (one per cell of its 1024), and a step's counters before are the last one's after.
        self._counters: dict[str, int] | None = dict(self.baseline)

    def _origin(self, origin: Origin) -> tuple[str, Host, int]:
        key = json.dumps(origin)
        if key not in self.origins:
            info = self.stranger if origin == "stranger" else self.workers_hosts[
                sum(1 for k in self.origins if k != '"stranger"') % len(self.workers_hosts)]
            host = Host(info.name, info.mac, info.ip, info.port)
            port = 20000 + len(self.origins)
            self.network.agent(info.name).call(op="bind", key=key, port=port)
            self.origins[key] = (host, port)
        host, port = self.origins[key]
        return key, host, port

    def admit(self, job: Job) -> None:
        workers = []
        for w in range(job.workers):
            _, host, port = self._origin((job.job, w))
            workers.append(Worker(w, host, port))
        a = Allocation(job.job, job.generation, job.base, job.pool, tuple(workers))
        admission.install(self.switch, a)
        result_rewrite.install(self.switch, a)
        self.allocations[job.job] = a

    def remove(self, job: int) -> None:
        a = self.allocations.pop(job)
        admission.remove(self.switch, a)
        result_rewrite.remove(self.switch, a)

    def send(self, origin: Origin, payload: bytes) -> None:
        key, host, _ = self._origin(origin)
        self.network.agent(host.name).call(op="send", key=key, to=f"{AGGREGATION_IP}:{wire.UDP_PORT}",
                                           payload=payload.hex())
        self.sent += 1
        self._counters = None

    def collect(self) -> list[tuple[Origin, bytes]]:
        deadline = time.monotonic() + 10
        while True:  # the switch's ingress has seen everything sent (the two counters that tell)
            seen = sum(sum(self.switch.read_counter(f"PassingIngress.{name}").values()) - self.baseline[name]
                       for name in ("received", "malformed"))
            if seen >= self.sent:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("BMv2 did not process what was sent")
            time.sleep(0.01)
        got: list[tuple[Origin, bytes]] = []
        emitted, last = -1, None
        while time.monotonic() < deadline:  # every RESULT the egress emitted has arrived
            for agent in self.network.agents.values():
                for key, payload, _src in agent.call(op="drain")["received"]:
                    origin = json.loads(key)
                    got.append((tuple(origin) if isinstance(origin, list) else origin, bytes.fromhex(payload)))
            total = sum(self.switch.read_counter("PassingEgress.results_sent").values())
            emitted = total - self.baseline["results_sent"] - self.collected
            if total == last and len(got) >= emitted:  # the egress count is settled and all arrived
                break
            last = total
            time.sleep(0.02)
        self.collected += len(got)
        return got

    def counters(self) -> dict[str, int]:
        if self._counters is None:
            self._counters = self._totals()
        return dict(self._counters)

    def _totals(self) -> dict[str, int]:
        return counters.totals(self.switch)
