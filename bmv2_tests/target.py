"""The scenario-table target on BMv2: real hosts, real packets, P4Runtime for admission and counters."""

from __future__ import annotations

import json
import time

import numpy as np

from passing import wire
from passing_controller import admission, counters, result_rewrite, tree_roles
from passing_controller.allocation import Allocation, Worker
from passing_controller.session import Switch
from passing_controller.topology import Host
from tests.conformance.runner import Origin
from tests.conformance.scenarios import Job

from .network import AGGREGATION_IP, Bmv2Network

PROBE_PORT = 19999  # every host's socket for the probes that mark the end of a step (plain L2 traffic)
PROBE = json.dumps("probe")  # its agents' key (never an origin's)


class Bmv2Target:
    """Each (job, worker) origin is a UDP socket in one of the hosts, round robin over all
    hosts but the last; the last host is the stranger that no job admits.

    Counters: a whole counter costs BMv2 a read of each of its 1024 cells (about 20 ms), a cell
    alone well under 1 ms. So a step reads only the cells its packets can touch (the job ids
    they carry, mod 1024, and ``malformed``'s one cell) over the last whole read; ``rebase``,
    after each scenario, reads every cell and names any that changed unread. Counters only
    grow, so a scenario whose steps add up and whose other cells never moved changed, at every
    step, the totals over all cells exactly as its steps say.

    The end of a step is an event, not a wait: once the ingress has counted what was sent, a
    probe goes to every host by plain L2 forwarding. BMv2 has one ingress thread, replicates in
    it, and keeps each port's egress queue and its transmit queue in order, so a probe that
    reached its host left after everything the step sent that host, every counter of the step
    counted (``collect``)."""

    lanes = wire.DEFAULT_LANES

    def __init__(self, network: Bmv2Network, switch: Switch, root: bool = False) -> None:
        """``root``: the tree scenarios' origin "root" is the host before the stranger, on its switch port as
        a leaf's uplink, receiving partials on the PASSING port (tests/conformance/tree_scenarios.py)."""
        self.network, self.switch = network, switch
        self.named = {"stranger": network.hosts[-1]} | ({"root": network.hosts[-2]} if root else {})
        self.workers_hosts = network.hosts[:-len(self.named)]
        self.origins: dict[str, tuple[Host, int]] = {}
        self.allocations: dict[int, Allocation] = {}
        self.roles: dict[int, list] = {}  # a tree job's tree_roles entries
        for info in network.hosts:
            network.agent(info.name).call(op="bind", key=PROBE, port=PROBE_PORT)
        self.probes = 0  # probe rounds sent
        self.whole = counters.read_all(switch)  # every cell, as last read
        self.indices: set[int] = set()  # the cells read since: the job ids sent, mod 1024
        self.cells = counters.read_indices(switch, self.indices)  # those cells as last read
        self.sent = 0  # packets, and RESULTs collected, since the last whole read
        self.collected = 0
        # The counters as last read, while nothing was sent since: a step's before is the last one's after.
        self._counters: dict[str, int] | None = self._totals()

    def _origin(self, origin: Origin) -> tuple[str, Host, int]:
        key = json.dumps(origin)
        if key not in self.origins:
            named = {json.dumps(n) for n in self.named}
            info = self.named[origin] if isinstance(origin, str) else self.workers_hosts[
                sum(1 for k in self.origins if k not in named) % len(self.workers_hosts)]
            host = Host(info.name, info.mac, info.ip, info.port)
            port = wire.UDP_PORT if origin == "root" else 20000 + len(self.origins)
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
        if job.role == "leaf":
            assert job.up is not None
            _, root, _ = self._origin("root")
            up = tree_roles.Uplink(job.up.job, job.up.generation, job.up.worker, root.port, root.mac, root.ip)
            self.roles[job.job] = tree_roles.install_leaf(self.switch, a, up, job.owners)
            self.indices.add(job.job % counters.MAX_JOBS)  # what comes down counts on the leaf job
        elif job.role == "root":
            self.roles[job.job] = tree_roles.install_root(self.switch, a, job.owners)

    def remove(self, job: int) -> None:
        a = self.allocations.pop(job)
        if job in self.roles:
            tree_roles.remove(self.switch, self.roles.pop(job))
        admission.remove(self.switch, a)
        result_rewrite.remove(self.switch, a)

    def send(self, origin: Origin, payload: bytes) -> None:
        if len(payload) >= wire.HEADER_SIZE:  # the cell of its job id (a shorter one is malformed)
            job = int(np.frombuffer(payload[:wire.HEADER_SIZE], wire.HEADER_DTYPE)["job"][0])
            self.indices.add(job % counters.MAX_JOBS)
        key, host, _ = self._origin(origin)
        self.network.agent(host.name).call(op="send", key=key, to=f"{AGGREGATION_IP}:{wire.UDP_PORT}",
                                           payload=payload.hex())
        self.sent += 1
        self._counters = None

    def collect(self) -> list[tuple[Origin, bytes]]:
        deadline = time.monotonic() + 10
        while True:  # the switch's ingress has seen everything sent (the two counters that tell)
            self._read_cells()
            if self._grown("received") + self._grown("malformed") >= self.sent:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("BMv2 did not process what was sent")
            time.sleep(0.01)
        self.probes += 1
        probe = f"end of step {self.probes}".encode().hex()
        hosts = self.network.hosts
        for i, info in enumerate(hosts):  # each host sends the next one (around) its probe
            to = f"{hosts[(i + 1) % len(hosts)].ip}:{PROBE_PORT}"
            self.network.agent(info.name).call(op="send", key=PROBE, to=to, payload=probe)
        got: list[tuple[Origin, bytes]] = []
        probed: set[str] = set()  # the hosts whose probe arrived
        emitted = None  # RESULTs the egress emitted in the step: known once every probe arrived
        while time.monotonic() < deadline:
            for name, agent in self.network.agents.items():
                for key, payload, _src in agent.call(op="drain")["received"]:
                    if key == PROBE:
                        if payload == probe:  # (an earlier step's probe is late: nothing to count)
                            probed.add(name)
                        continue
                    origin = json.loads(key)
                    got.append((tuple(origin) if isinstance(origin, list) else origin, bytes.fromhex(payload)))
            if emitted is None and len(probed) == len(hosts):
                self._read_cells()
                emitted = self._grown("results_sent") + self._grown("sent_up") - self.collected
            if emitted is not None and len(got) >= emitted:
                break  # the egress emitted all it will for this step, and all of it arrived
            time.sleep(0.005)
        else:
            if emitted is None:
                raise TimeoutError(f"the end-of-step probes reached only {sorted(probed)} of {len(hosts)} hosts")
            # RESULTs counted and never delivered: what came is compared with what the step expects
        self.collected += len(got)
        return got

    def counters(self) -> dict[str, int]:
        if self._counters is None:
            self._read_cells()
            self._counters = self._totals()
        return dict(self._counters)

    def rebase(self) -> dict[str, list[int]]:
        """Read every cell; returns, by counter, the indices that changed since they were last read
        (a cell no step read, or one that moved after the last step); from here on, counts start again."""
        whole = counters.read_all(self.switch)
        changed = {}
        for name, per_index in whole.items():
            known = {**self.whole[name], **self.cells[name]}
            moved = sorted(i for i in per_index.keys() | known.keys() if per_index.get(i, 0) != known.get(i, 0))
            if moved:
                changed[name] = moved
        self.whole, self.indices = whole, set()
        self.cells = counters.read_indices(self.switch, self.indices)
        self.sent = self.collected = 0
        self._counters = self._totals()
        return changed

    def _read_cells(self) -> None:
        self.cells = counters.read_indices(self.switch, self.indices)

    def _grown(self, name: str) -> int:
        """How much counter ``name`` grew since the last whole read, over the cells read (0: a counter the
        program lacks)."""
        if name not in self.cells:
            return 0
        return sum(n - self.whole[name].get(i, 0) for i, n in self.cells[name].items())

    def _totals(self) -> dict[str, int]:
        """Every counter summed over its cells: the cells read, over the last whole read."""
        return {name: sum({**per_index, **self.cells[name]}.values()) for name, per_index in self.whole.items()}
