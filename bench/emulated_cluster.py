"""bench/emulated.py's cluster: server namespaces and a "ps" namespace behind rate-limited links, the emulated
switch (a software aggregator in the switch namespace, at the lanes of the switch kind it stands for) and the
PS, each with a PS-only controller; the window each link gets (pool_for); the aggregators' load and the
cluster's drops and CPU pressure while a run goes on. Run through bench/emulated.py or bench/fsdp_comm.py (the
repository and bench/ on the path)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cost_model

from cluster import netns
from cluster.local import start_controller
from passing.aggregator.control_channel import ControlClient
from passing_controller.topology import CHIP_LANES

SWITCH_LABEL = "software aggregator in the switch namespace"
# The switch kinds the emulated switch may stand for (hardware; BMv2 cannot keep up, BMV2_NOTE) and their names
SWITCH_KINDS = {"tofino": "Tofino", "tofino2": "Tofino 2"}
DEFAULT_SWITCH_KIND = "tofino"
PS_LABEL = "software aggregator in the ps namespace (the PS, behind its rate-limited link)"
BMV2_NOTE = ("BMv2, measured here at ~0.8 kpps of aggregation (bench/results/bmv2.json), cannot sustain "
             "these packet rates, so the switch is emulated by the software aggregator")


def switch_kind_label(kind: str) -> str:
    """What the emulated switch is, said with every figure."""
    return (f"emulated {SWITCH_KINDS[kind]} ({kind}, {CHIP_LANES[kind]} lanes): a software aggregator at that "
            "lane count, nothing more")

MAX_WINDOWS = 16  # most windows that share one link: flat schemes at 4x4 on the PS link
QUEUE_BUDGET_S = 0.5  # pool is sized so that MAX_WINDOWS full windows queue for about this long


def aggregator_of(scheme: str) -> str | None:
    """Which of the cluster's aggregators serves ``scheme`` (None: gloo's ring, no aggregator)."""
    return {"passing": "switch", "switchml": "switch", "ps": "ps", "psring": "ps"}.get(scheme)


def pool_for(rate_mbit: float, lanes: int = cost_model.LANES) -> int:
    """Packets in flight per worker at this link rate: the power of two (16..256 packets of 64
    lanes, as many bytes of ``lanes``) nearest to what keeps the fullest link's queue near
    QUEUE_BUDGET_S. A stream silent for 1 s (its wait before a probe on a loss-free path)
    resends, so a longer queue would make it resend packets that are only waiting; a much
    smaller pool would let the window, not the link, set the pace. The bound is of bytes, so a
    switch kind of wider packets keeps the same bytes in flight (128 lanes: 128 packets at the
    10 Gbit/s-equivalent): with 256 of them, twice the bytes, the relays of FSDP's all_gathers
    queued the reduce_scatter's RESULTs on the downlinks for twice as long (docs/benchmarks.md)."""
    link_pps = rate_mbit * 1e6 / (8 * cost_model.frame(lanes))
    most = 256.0 * cost_model.LANES / lanes
    return 1 << round(math.log2(max(16.0, min(most, QUEUE_BUDGET_S * link_pps / MAX_WINDOWS))))


def tbf_sizes(rate_mbit: float, lanes: int = cost_model.LANES) -> tuple[int, int]:
    """(bucket, queue) bytes of a link's tbf at ``rate_mbit`` (Cluster.set_rate says why these)."""
    burst = max(3100, int(rate_mbit * 1e6 / 8 * 0.002))
    return burst, max(4 * MAX_WINDOWS * pool_for(rate_mbit, lanes) * cost_model.frame(lanes), 256 * 1024)


def cpu_pressure_us() -> int:
    """Microseconds in which some runnable task waited for a CPU (PSI), 0 where the kernel has no PSI."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(re.search(r"total=(\d+)", f.readline()).group(1))
    except (OSError, AttributeError):
        return 0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class AggregatorMonitor:
    """Samples an aggregator's CPU time and packet counters while a run goes on."""

    def __init__(self, pid: int, control: str, period: float = 0.5) -> None:
        self.pid, self.client, self.period = pid, ControlClient(control, timeout=5.0), period
        self.samples: list[tuple[float, float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        transport = self.client.request("stats")["transport"]
        self.samples.append((time.perf_counter(), cpu_seconds(self.pid), transport["packets_received"],
                             transport["packets_sent"]))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._sample()
            except (OSError, ValueError):  # an aggregator that died fails the run; the monitor just stops
                return

    def __enter__(self) -> AggregatorMonitor:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def summary(self) -> dict[str, float]:
        (t0, c0, r0, s0), (t1, c1, r1, s1) = self.samples[0], self.samples[-1]
        windows = list(zip(self.samples, self.samples[1:]))
        peak_in = max(((b[2] - a[2]) / (b[0] - a[0]) for a, b in windows), default=0.0)
        peak_out = max(((b[3] - a[3]) / (b[0] - a[0]) for a, b in windows), default=0.0)
        peak_cpu = max(((b[1] - a[1]) / (b[0] - a[0]) for a, b in windows), default=0.0)
        return {"seconds": t1 - t0, "cpu_s": c1 - c0, "cpu_share": (c1 - c0) / (t1 - t0),
                "peak_cpu_share": peak_cpu, "packets_in": r1 - r0, "packets_out": s1 - s0,
                "peak_pps_in": peak_in, "peak_pps_out": peak_out,
                "cpu_us_per_packet": (c1 - c0) / max(r1 - r0, 1) * 1e6}


class Cluster:
    """The namespaces, the two aggregators and their two controllers, for the whole benchmark."""

    def __init__(self, servers: int, rate_mbit: float, workdir: Path, nice: int = 0,
                 switch_kind: str = DEFAULT_SWITCH_KIND) -> None:
        self.nice = nice
        self.switch_kind, self.lanes = switch_kind, CHIP_LANES[switch_kind]
        self.servers = [f"s{i}" for i in range(servers)]
        hosts = [*self.servers, "ps"]
        self.net = netns.EmulatedNetwork(hosts, {h: rate_mbit for h in hosts})
        try:
            self.set_rate(rate_mbit)
            sw, ps = self.net.switch.ip, self.net.hosts["ps"].ip
            in_switch: Callable[..., subprocess.Popen] = lambda argv, **kw: self.net.popen("switch", argv, **kw)
            self.aggregators: dict[str, dict[str, Any]] = {}
            # ipc:// control sockets: the harness, in the root namespace, reads their counters through them.
            # Both take the switch kind's packet size only (its program's lanes): the schemes are compared, and
            # modelled, with the packets of that switch, where a PS alone would take MTU-sized ones
            # (docs/control.md); the PS-only controllers give every group the most the aggregator takes
            for name, where, ip in (("switch", "switch", sw), ("ps", "ps", ps)):
                control = f"ipc://{workdir}/{name}-aggregator.ipc"
                proc = self.popen(where, [sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen",
                                          f"{ip}:9877", "--control", control, "--max-lanes", str(self.lanes)],
                                  stdout=subprocess.PIPE, text=True)
                if not proc.stdout.readline():
                    raise RuntimeError(f"the {name} aggregator did not start")
                self.aggregators[name] = {"pid": proc.pid, "control": control, "data": f"{ip}:9877"}
            self.controllers: dict[str, str] = {}
            for port, name in ((9090, "switch"), (9091, "ps")):
                endpoint = f"tcp://{sw}:{port}"
                (workdir / name).mkdir()
                topology = {"ps": [{"data": self.aggregators[name]["data"],
                                    "control": self.aggregators[name]["control"]}]}
                start_controller(topology, workdir / name, endpoint, popen=in_switch)
                self.controllers[name] = endpoint
        except BaseException:
            self.net.stop()
            raise

    def set_rate(self, rate_mbit: float) -> None:
        """Every tbf in the cluster to ``rate_mbit``, with a small bucket and a queue that holds every window.

        EmulatedNetwork's bucket (at least 64 KiB) would let the first 64 KiB of every
        all_reduce through at once, a sizeable share of a scaled-down gradient; 2 ms of
        traffic is enough for the timer. The queue must hold MAX_WINDOWS full windows
        without a tail drop, as a switch buffer of that size would.
        """
        self.net.set_rate(rate_mbit, *tbf_sizes(rate_mbit, self.lanes))
        self.rate_mbit = rate_mbit

    def popen(self, where: str, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """``argv`` in host ``where`` at the benchmark's nice level (`nice` execs: the pid stays the program's)."""
        return self.net.popen(where, ["nice", "-n", str(self.nice), *argv], **kwargs)

    def namespaces(self) -> list[str]:
        return [self.net.switch.namespace, *(h.namespace for h in self.net.hosts.values())]

    def counters(self) -> dict[str, Any]:
        """Cluster-wide counters: packets dropped by the tbf queues and by full UDP receive
        buffers, bytes sent through each tbf (one link direction each), CPU pressure."""
        tbf, rcvbuf, link_bytes = 0, 0, {}
        names = list(self.net.hosts)
        for ns in self.namespaces():
            shown = _ns_run(ns, "tc", "-s", "qdisc", "show")
            for dev, sent, dropped in re.findall(
                    r"qdisc tbf \S+ dev (\S+) .*?\n\s*Sent (\d+) bytes \d+ pkt \(dropped (\d+)", shown):
                # a host's eth0 sends toward the switch; the switch's veth <tag>s<i> toward host i
                where = (f"{names[int(dev.rsplit('s', 1)[1])]} down" if ns == self.net.switch.namespace
                         else f"{ns.rsplit('-', 1)[1]} up")
                link_bytes[where] = int(sent)
                tbf += int(dropped)
            snmp = [ln.split() for ln in _ns_run(ns, "cat", "/proc/net/snmp").splitlines() if ln.startswith("Udp:")]
            rcvbuf += int(dict(zip(snmp[0][1:], snmp[1][1:]))["RcvbufErrors"])
        return {"tbf_drops": tbf, "udp_rcvbuf_drops": rcvbuf, "link_bytes": link_bytes,
                "cpu_waiting_us": cpu_pressure_us(), "time": time.perf_counter()}

    def stop(self) -> None:
        self.net.stop()


def _ns_run(ns: str, *argv: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, check=True).stdout
