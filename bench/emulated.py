"""Emulated-cluster benchmark (issue 5): the schemes of docs/torch.md on rate-limited links, vs the cost model.

    sudo .venv/bin/python bench/emulated.py --quick     # 2x2 and 4x2, 10G-equivalent, ResNet50 (~2 min)
    sudo .venv/bin/python bench/emulated.py             # 2x2 2x4 4x2 4x4, both bandwidths, ResNet50 + VGG19
    sudo .venv/bin/python bench/emulated.py --quick --switch-kind tofino2   # the switch's packets: 72 lanes

Needs root (network namespaces) and matplotlib for the plots (`pip install matplotlib`).

The cluster (cluster/netns.py): server namespaces s0..s7 and a "ps" namespace, each on one
veth link to a bridge in the switch namespace, every link rate-limited (tbf) to B Mbit/s
each way. The switch is emulated by a software aggregator in the switch namespace (the
bridge's own address, behind no rate limit: it *is* the switch) with a PS-only
controller whose PS entry is that aggregator: schemes passing and switchml use it. The
parameter server is a second software aggregator in the "ps" namespace, behind its
rate-limited link, with a second PS-only controller: schemes ps and psring use it.
Every run starts s × n ranks (bench/emulated_worker.py) in the server namespaces.

Switch kind (--switch-kind, default tofino): the lane count of the P4 program the emulated switch
stands for (passing_controller.topology.CHIP_LANES: tofino 64, tofino2 72). Both software
aggregators take packets of that many lanes and no more, and the cost model counts them: an
emulated Tofino 2 is a software aggregator at a Tofino 2 program's lane count, nothing more (no
pipeline, no recirculation, no switch buffer). Every progress line and results file names it.

Scaling: the paper's 10 Gbit/s and 1 Gbit/s links and its gradient sizes are both
divided by --factor (default 100: 100 and 10 Mbit/s, ResNet50 -> 255 570 float32), so
every network time is the full-scale time (the model's network term is exactly the same
number); fixed per-call costs and the in-host stage do not scale and are reported
separately. Why 100: on this 2-core machine with the native data path, every run of the
full set at factor 100 is within 0.74-1.17 of the model (ps, psring, switchml: 0.95-1.07;
below 1 where the model adds the one-packet and in-host probes in full) with no drops and
the aggregator under 40 % of a core; factor 50 (200 Mbit/s) still held in the quick set
(0.98-1.06), but at factor 20 (500 Mbit/s) passing took 1.4-1.9x its link time in three
of five runs, with CPU pressure near 90 % and round trips longer than the ~1 ms that a
256-packet window covers at that rate: the machine, not the link, set the pace. (The
numpy path needed factor 1000.) Every run reports the aggregator's packet
rate and CPU, the CPU pressure (PSI) and the drops, so a reader can check that neither
the aggregator nor the machine set the pace.

Writes bench/results/emulated.{json,md} and emulated-{time,efficiency,scaling}.png
(--quick: emulated-quick.*; a switch kind other than tofino: emulated[-quick]-<kind>.*), one
progress line per run. Everything it creates
(namespaces, processes) is removed at the end, on Ctrl-C, and after a crash by the next
run (netns.remove_stale).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

import cost_model  # noqa: E402

from cluster import netns  # noqa: E402
from cluster.local import ensure_keys, launch_ranks, start_controller  # noqa: E402
from passing.aggregator.control_channel import ControlClient  # noqa: E402
from passing_controller.topology import CHIP_LANES  # noqa: E402

RESULTS = BENCH / "results"
WORKER = BENCH / "emulated_worker.py"

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


# Paper workloads: parameter counts of the full models (float32 gradients).
MODELS = {
    "resnet50": (25_557_032, "ResNet50 (torchvision/ImageNet variant, 25.6 M parameters)"),
    "vgg19": (20_035_018, "VGG19, CIFAR variant (conv stack + one 512x10 linear, 20.0 M parameters)"),
}
# Per-step compute on one GPU, batch 64 CIFAR-10 images: ASSUMED, not measured (no GPU here and
# torchvision does not import): forward+backward FLOPs of the CIFAR variants at ~10 TFLOP/s effective
# on a V100-class GPU (ResNet50 on 32x32 inputs ~1.3 GMAC/image, VGG19 ~0.4 GMAC/image).
COMPUTE_S = {"resnet50": 0.050, "vgg19": 0.020}
BATCH_PER_GPU = 64
EPOCH_IMAGES = 50_000
PAPER_GBIT = {"10G": 10.0, "1G": 1.0}
CONFIGS = ((2, 2), (2, 4), (4, 2), (4, 4))
SCALING_SERVERS = (2, 4, 8)
MAX_WINDOWS = 16  # most windows that share one link: flat schemes at 4x4 on the PS link
QUEUE_BUDGET_S = 0.5  # pool is sized so that MAX_WINDOWS full windows queue for about this long


# ---- the emulated cluster -------------------------------------------------------------------


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
        burst = max(3100, int(rate_mbit * 1e6 / 8 * 0.002))
        limit = max(4 * MAX_WINDOWS * pool_for(rate_mbit, self.lanes) * cost_model.frame(self.lanes), 256 * 1024)
        self.net.set_rate(rate_mbit, burst, limit)
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


# ---- one run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bandwidth:
    label: str  # "10G" / "1G": the paper's link it stands for
    rate_mbit: float
    lanes: int = cost_model.LANES  # the switch kind's packets

    @property
    def pool(self) -> int:
        return pool_for(self.rate_mbit, self.lanes)


def aggregator_of(scheme: str) -> str | None:
    return {"passing": "switch", "switchml": "switch", "ps": "ps", "psring": "ps"}.get(scheme)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of every rank; all are killed once ``timeout`` passes."""
    outputs: list[tuple[str, str]] = [("", "")] * len(procs)

    def drain(i: int) -> None:
        outputs[i] = procs[i].communicate()

    threads = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(procs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        for p in procs:
            p.kill()
        for t in threads:
            t.join(10)
    return [(p.returncode if p.returncode is not None else -9, *outputs[i]) for i, p in enumerate(procs)]


def run_once(cluster: Cluster, scheme: str, servers: int, ranks: int, bw: Bandwidth, workloads: dict[str, int],
             iterations: int, factor: float) -> dict[str, Any]:
    """Start s × n ranks for one scheme, collect their lines, put the model beside each measurement."""
    if cluster.rate_mbit != bw.rate_mbit:
        cluster.set_rate(bw.rate_mbit)
    agg = aggregator_of(scheme)
    controller = cluster.controllers[agg or "switch"]
    # no PASSING_RTO: nothing is lost here (the tbf queues hold every window), so the streams never see
    # evidence of loss and wait the default 1 s before a probe, longer than any queue of these runs
    env = {"PASSING_SCHEME": scheme, "PASSING_CONTROLLER": controller, "PASSING_POOL": str(bw.pool),
           "GLOO_SOCKET_IFNAME": "eth0"}
    argv = [sys.executable, str(WORKER), "--iterations", str(iterations),
            *[a for name, n in workloads.items() for a in ("--workload", f"{name}={n}")]]
    rough = sum(cost_model.predict(scheme, n, cost_model.Setup(servers, ranks, bw.rate_mbit, bw.pool,
                                                                lanes=cluster.lanes)).seconds
                for n in workloads.values())
    timeout = 240 + 6 * rough * (iterations + 3)
    started, before = time.perf_counter(), cluster.counters()
    procs = launch_ranks(argv, servers, ranks, env,
                         popen_for_server=lambda s: lambda a, **kw: cluster.popen(cluster.servers[s], a, **kw),
                         master_host=cluster.net.hosts[cluster.servers[0]].ip)
    monitor = AggregatorMonitor(**{k: cluster.aggregators[agg][k] for k in ("pid", "control")}) if agg else None
    if monitor:
        with monitor:
            outcomes = wait_all(procs, timeout)
    else:
        outcomes = wait_all(procs, timeout)
    wall = time.perf_counter() - started
    after = cluster.counters()
    span = after["time"] - before["time"]
    moved = {k: after["link_bytes"][k] - before["link_bytes"].get(k, 0) for k in after["link_bytes"]}
    health = {"tbf_drops": after["tbf_drops"] - before["tbf_drops"],
              "udp_rcvbuf_drops": after["udp_rcvbuf_drops"] - before["udp_rcvbuf_drops"],
              "cpu_pressure": (after["cpu_waiting_us"] - before["cpu_waiting_us"]) / 1e6 / span,
              "busiest_link_bytes": max(moved.values()), "link_bytes": {k: v for k, v in moved.items() if v}}
    lines = []
    for rank, (code, out, err) in enumerate(outcomes):
        found = [ln for ln in out.splitlines() if ln.startswith("{")]
        if code != 0 or not found:
            tail = "\n".join(err.strip().splitlines()[-15:])
            return {"scheme": scheme, "servers": servers, "ranks": ranks, "bandwidth": bw.label, "failed": True,
                    "error": f"rank {rank} exited {code}: {tail}", "wall_s": wall, "switch_kind": cluster.switch_kind}
        lines.append(json.loads(found[-1]))
    used = {r["lanes"] for r in lines if r["lanes"] is not None}
    if used - {cluster.lanes}:  # the controller gave other packets than the switch kind's: no figure of that kind
        return {"scheme": scheme, "servers": servers, "ranks": ranks, "bandwidth": bw.label, "failed": True,
                "error": f"ranks used {sorted(used)} lanes, the {cluster.switch_kind} switch kind {cluster.lanes}",
                "wall_s": wall, "switch_kind": cluster.switch_kind}
    fixed = max(r["fixed_s"] for r in lines)
    result: dict[str, Any] = {
        "scheme": scheme, "servers": servers, "ranks": ranks, "bandwidth": bw.label,
        "switch_kind": cluster.switch_kind, "lanes": cluster.lanes if used else None,
        "paper_gbit": PAPER_GBIT.get(bw.label), "rate_mbit": bw.rate_mbit, "pool": bw.pool,
        "aggregator": {"switch": f"{SWITCH_LABEL}: {switch_kind_label(cluster.switch_kind)}",
                       "ps": PS_LABEL}.get(agg or "", "none: gloo's ring over TCP"),
        "loadavg": open("/proc/loadavg").read().split()[:3],  # the machine's load as the run ended
        "mode": lines[0]["mode"], "reason": lines[0]["reason"], "fixed_s": fixed, "wall_s": wall, "health": health,
        "iterations": iterations, "workloads": {},
        "aggregator_load": monitor.summary() if monitor else None,
    }
    for name, elements in workloads.items():
        per_rank = [r["workloads"][name] for r in lines]
        measured = max(w["median_s"] for w in per_rank)  # the slowest rank's median: everyone waits for it
        in_host = [w["in_host_s"] for w in per_rank if w["in_host_s"] is not None]
        setup = cost_model.Setup(servers, ranks, bw.rate_mbit, bw.pool, rtt_s=max(fixed / 2, 1e-4), fixed_s=fixed,
                                 in_host_s=max(in_host) if in_host else 0.0, lanes=cluster.lanes)
        model = cost_model.predict(scheme, elements, setup)
        sent = [w["transport"].get("bytes_sent", 0) for w in per_rank]
        compute = COMPUTE_S[name]
        steps = math.ceil(EPOCH_IMAGES / (BATCH_PER_GPU * servers * ranks))
        result["workloads"][name] = {
            "elements": elements, "full_elements": MODELS[name][0], "factor": factor,
            "measured_s": measured, "min_s": max(min(w["seconds"]) for w in per_rank),
            "model_s": model.seconds, "ratio": measured / model.seconds,
            "model": model.as_dict(), "per_rank_median_s": [w["median_s"] for w in per_rank],
            "seconds": [w["seconds"] for w in per_rank], "warmup_s": max(w["warmup_s"] for w in per_rank),
            "starts": [w["starts"] for w in per_rank],  # each rank's start of each call (time.time(), one machine)
            "rank_cpu_share": max(w["cpu_s"] / (w["median_s"] * iterations) for w in per_rank),
            # how far apart the ranks started each all_reduce after the barrier (median over iterations)
            "start_skew_s": statistics.median(max(t) - min(t) for t in zip(*(w["starts"] for w in per_rank))),
            "in_host_s": max(in_host) if in_host else None,
            "retransmissions": sum(w["transport"].get("retransmissions", 0) for w in per_rank),
            "bytes_sent_per_server": [sum(sent[s * ranks:(s + 1) * ranks]) // iterations for s in range(servers)],
            "step_compute_s": compute, "steps_per_epoch": steps,
            "epoch_s": steps * (compute + measured), "epoch_model_s": steps * (compute + model.seconds),
            "scaling_efficiency": compute / (compute + measured),
        }
    # warm-up + timed all_reduces; the probes, barriers and MAX rounds add well under 1 %
    expected = sum((iterations + 1) * w["model"]["link_bytes"] for w in result["workloads"].values())
    health["link_bytes_ratio"] = health["busiest_link_bytes"] / expected
    health["rank_cpu_share"] = max(w["rank_cpu_share"] for w in result["workloads"].values())
    health["start_skew_s"] = max(w["start_skew_s"] for w in result["workloads"].values())
    if monitor:
        # Share of a core the aggregator would need with its bottleneck link(s) full, at the CPU
        # per packet of this run (an upper bound: at higher rates its batches grow and cost less each)
        line_pps = cost_model.bottleneck_packets_per_s(scheme, cost_model.Setup(servers, ranks, bw.rate_mbit,
                                                                                 lanes=cluster.lanes))
        load = result["aggregator_load"]
        load["line_rate_pps_in"], load["line_rate_cpu_share"] = line_pps, load["cpu_us_per_packet"] * line_pps / 1e6
    return result


def progress(i: int, total: int, r: dict[str, Any]) -> str:
    head = f"[{i}/{total}] {r['scheme']:8s} {r['servers']}x{r['ranks']} @{r['bandwidth']} [switch: {r['switch_kind']}]"
    if r.get("failed"):
        return f"{head}: FAILED after {r['wall_s']:.0f} s: {r['error']}"
    parts = [f"{name} {w['measured_s']:.3f} s (model {w['model_s']:.3f}, x{w['ratio']:.2f}, "
             f"{w['retransmissions']} retx)" for name, w in r["workloads"].items()]
    load, h = r["aggregator_load"], r["health"]
    agg = (f"; aggregator {load['peak_pps_in'] / 1e3:.1f} kpps in at peak, CPU {load['peak_cpu_share']:.0%} at peak "
           f"(~{load['line_rate_cpu_share']:.0%} at line rate)" if load else "")
    drops = (f"; DROPS: {h['tbf_drops']} tbf, {h['udp_rcvbuf_drops']} UDP rcvbuf"
             if h["tbf_drops"] or h["udp_rcvbuf_drops"] else "")
    lanes = f", {r['lanes']} lanes" if r["lanes"] else ""
    return (f"{head} ({r['rate_mbit']:g} Mbit/s, pool {r['pool']}{lanes}): {'; '.join(parts)}{agg}{drops}; "
            f"link bytes x{h['link_bytes_ratio']:.2f} model; CPU pressure {h['cpu_pressure']:.0%}; load "
            f"{' '.join(r['loadavg'])}; {r['wall_s']:.0f} s")


# ---- report ----------------------------------------------------------------------------------


def ok_runs(runs: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in runs if not r.get("failed") and all(r.get(k) == v for k, v in match.items())]


def lookup(runs: list[dict[str, Any]], scheme: str, servers: int, ranks: int, bw: str, name: str) -> float | None:
    found = ok_runs(runs, scheme=scheme, servers=servers, ranks=ranks, bandwidth=bw)
    return found[0]["workloads"][name]["measured_s"] if found and name in found[0]["workloads"] else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "–"


def _saved(t: float, base: float | None) -> str:
    return f"{1 - t / base:.0%}" if base else "–"


def _agg_cells(load: dict[str, float] | None) -> str:
    if not load:
        return "– | – | –"
    return f"{load['peak_pps_in'] / 1e3:.1f} | {load['peak_cpu_share']:.0%} | {load['line_rate_cpu_share']:.0%}"


def markdown(report: dict[str, Any]) -> str:
    meta, runs, scaling = report["meta"], report["runs"], report["scaling"]
    switch_kind = meta.get("switch_kind", DEFAULT_SWITCH_KIND)  # results from before switch kinds: a Tofino's
    lanes = CHIP_LANES[switch_kind]
    short = {"switch": f"switch ns (software, as {switch_kind})", "ps": "ps ns (software PS)", None: "– (gloo)"}
    out = [f"# Emulated cluster: allreduce per scheme ({'quick' if meta['quick'] else 'full'} run), "
           f"switch kind {switch_kind}", "",
           f"Switch kind: **{switch_kind_label(switch_kind)}**.", "",
           f"Aggregation: **{SWITCH_LABEL}** for passing/switchml ({BMV2_NOTE}); **{PS_LABEL}** for ps/psring.",
           "", f"- Scale factor {meta['factor']:g}: " + ", ".join(
               f"{k}bit/s -> {v:g} Mbit/s" for k, v in meta["rates_mbit"].items())
           + "; gradients " + ", ".join(f"{MODELS[k][1]} -> {v} float32" for k, v in meta["workloads"].items())
           + ". Network times therefore equal full-scale times at full bandwidth; the fixed per-call cost and the "
           "in-host stage do not scale.",
           f"- Frames: {cost_model.frame(lanes)} B per {cost_model.payload(lanes)} B of payload ({lanes} lanes, "
           f"the {switch_kind} program's, for every scheme's packets); pool (packets in flight per worker) "
           + ", ".join(f"{k}: {v}" for k, v in meta["pools"].items())
           + "; every tbf queue holds every window (no drops by design; drops are counted below).",
           f"- Time = the slowest rank's median of {meta['iterations']} timed all_reduces after one warm-up. "
           "Model = measured fixed cost (a one-packet all_reduce) + measured in-host reduce-scatter/all-gather "
           "+ the equations of bench/cost_model.py (network column).",
           f"- Epoch = ceil(50000 / (W x {BATCH_PER_GPU})) steps x (compute + allreduce), compute per step "
           + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in COMPUTE_S.items())
           + " **assumed** (not measured: no GPU here, torchvision does not import). Scaling efficiency = "
           "compute / (compute + allreduce): throughput over W x one GPU's, no overlap.",
           f"- Machine: {meta['machine']}; load average at start {' '.join(meta['loadavg_start'])}. {meta['note']}",
           "", "| config | link | workload | scheme | aggregated by | lanes | measured s | model s | ratio | "
           "network model s | in-host s | epoch s | scaling eff. |",
           "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        cfg = f"{r['servers']}x{r['ranks']}"
        if r.get("failed"):
            out.append(f"| {cfg} | {r['bandwidth']} | | {r['scheme']} | | | FAILED | | | | | | |")
            continue
        for name, w in r["workloads"].items():
            ih = f"{w['in_host_s']:.4f}" if w["in_host_s"] is not None else "–"
            out.append(f"| {cfg} | {r['bandwidth']} | {name} | {r['scheme']} | {short[aggregator_of(r['scheme'])]} | "
                       f"{r.get('lanes') or '–'} | {w['measured_s']:.3f} | {w['model_s']:.3f} | {w['ratio']:.2f} | "
                       f"{w['model']['network_s']:.3f} | {ih} | {w['epoch_s']:.1f} | {w['scaling_efficiency']:.0%} |")
    out += ["", f"## Ratios (measured; switch kind {switch_kind})", "", "| config | link | workload | PS / PSRing | "
            "SwitchML / PASSING | "
            "Ring / PASSING | time saved vs PS | time saved vs SwitchML |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for (s, n) in sorted({(r["servers"], r["ranks"]) for r in ok_runs(runs)}):
        for bw in meta["rates_mbit"]:
            for name in meta["workloads"]:
                t = {k: lookup(runs, k, s, n, bw, name) for k in cost_model.SCHEMES}
                if t["passing"] is None:
                    continue
                out.append(f"| {s}x{n} | {bw} | {name} | {_ratio(t['ps'], t['psring'])} | "
                           f"{_ratio(t['switchml'], t['passing'])} | {_ratio(t['ring'], t['passing'])} | "
                           f"{_saved(t['passing'], t['ps'])} | {_saved(t['passing'], t['switchml'])} |")
    if scaling:
        out += ["", "## Per-host scaling: ResNet50, 1 rank per server, 10G-equivalent "
                "(n = 1: passing and switchml are the same)", "",
                "| servers | scheme | aggregated by | measured s | model s | ratio |", "|---:|---|---|---:|---:|---:|"]
        for r in scaling:
            if r.get("failed"):
                out.append(f"| {r['servers']} | {r['scheme']} | | FAILED | | |")
                continue
            w = next(iter(r["workloads"].values()))
            out.append(f"| {r['servers']} | {r['scheme']} | {short[aggregator_of(r['scheme'])]} | "
                       f"{w['measured_s']:.3f} | {w['model_s']:.3f} | {w['ratio']:.2f} |")
    out += ["", "## Is anything but the links the bottleneck?", "",
            "Aggregator columns: received packets per second and share of a core in the busiest 0.5 s, and the "
            "share of a core it would need with its bottleneck link(s) full at this run's CPU per packet (an upper "
            "bound: batches grow with load). Link bytes: bytes through the busiest tbf over the model's bytes for "
            "the warm-up and timed all_reduces; the whole run's traffic, so it includes process-group set-up "
            "and teardown (gloo connections, the rendezvous store, joins: tens of kB per link). CPU pressure: "
            "share of the run in which some runnable task waited for a CPU (PSI; includes any other work on the "
            "machine). Start skew: how far apart the ranks began an all_reduce after the barrier (median); with "
            "one bottleneck per server (passing, switchml) a late server leaves the other links idle, while a "
            "shared PS link's queue absorbs it.", "",
            "| run | config | link | scheme | retx | drops (tbf / UDP) | link bytes / model | agg kpps in (peak) | "
            "agg CPU (peak) | agg CPU at line rate | rank CPU share | CPU pressure | start skew ms | fixed ms |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind, rows in (("main", runs), ("scaling", scaling)):
        for r in ok_runs(rows):
            h = r["health"]
            retx = sum(w["retransmissions"] for w in r["workloads"].values())
            out.append(f"| {kind} | {r['servers']}x{r['ranks']} | {r['bandwidth']} | {r['scheme']} | {retx} | "
                       f"{h['tbf_drops']} / {h['udp_rcvbuf_drops']} | {h['link_bytes_ratio']:.2f} | "
                       f"{_agg_cells(r['aggregator_load'])} | {h['rank_cpu_share']:.0%} | {h['cpu_pressure']:.0%} | "
                       f"{h['start_skew_s'] * 1e3:.1f} | {r['fixed_s'] * 1e3:.0f} |")
    failed = [r for r in runs + scaling if r.get("failed")]
    if failed:
        out += ["", "## Failed runs", ""] + [f"- {r['scheme']} {r['servers']}x{r['ranks']} @{r['bandwidth']}: "
                                             f"`{r['error'].splitlines()[-1] if r['error'] else ''}`" for r in failed]
    out += ["", f"Took {meta['duration_s'] / 60:.1f} min (started {meta['started']}); switch kind {switch_kind}: "
            f"{switch_kind_label(switch_kind)}."]
    return "\n".join(out) + "\n"


def plots(report: dict[str, Any], stem: str) -> list[Path]:
    """Time per scheme per configuration, scaling efficiency (paper Fig. 18/19), per-host scaling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, runs = report["meta"], ok_runs(report["runs"])
    configs = sorted({(r["servers"], r["ranks"]) for r in runs})
    panels = [(bw, name) for bw in meta["rates_mbit"] for name in meta["workloads"]]
    written = []
    for kind in ("time", "efficiency"):
        rows, cols = len(meta["rates_mbit"]), len(meta["workloads"])  # a row per link speed, a column per model
        fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
        for ax, (bw, name) in zip(axes.flat, panels):
            width = 0.8 / len(cost_model.SCHEMES)
            for k, scheme in enumerate(cost_model.SCHEMES):
                xs, ys, ms = [], [], []
                for i, (s, n) in enumerate(configs):
                    found = ok_runs(runs, scheme=scheme, servers=s, ranks=n, bandwidth=bw)
                    if found and name in found[0]["workloads"]:
                        w = found[0]["workloads"][name]
                        xs.append(i + (k - 2) * width)
                        ys.append(w["measured_s"] if kind == "time" else w["scaling_efficiency"])
                        c = w["step_compute_s"]
                        ms.append(w["model_s"] if kind == "time" else c / (c + w["model_s"]))
                ax.bar(xs, ys, width, label=scheme)
                ax.plot(xs, ms, "k_", markersize=10, label="model" if k == 0 else None)
            ax.set_xticks(range(len(configs)), [f"{s}x{n}" for s, n in configs])
            ax.set_xlabel("servers x ranks")
            ax.set_ylabel("allreduce seconds (full-scale equivalent)" if kind == "time" else "scaling efficiency")
            ax.set_title(f"{name}, {bw}bit/s link ({meta['rates_mbit'][bw]:g} Mbit/s emulated)", fontsize=9)
            if kind == "efficiency":
                ax.set_ylim(0, 1)
            ax.legend(fontsize=7)
        fig.suptitle(f"switch = {switch_kind_label(meta.get('switch_kind', DEFAULT_SWITCH_KIND))}; "
                     "PS = software aggregator in the ps namespace", fontsize=9)
        fig.tight_layout()
        path = RESULTS / f"{stem}-{kind}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if report["scaling"]:
        fig, ax = plt.subplots(figsize=(5.5, 4.2))
        for scheme in ("passing", "ps"):
            rs = ok_runs(report["scaling"], scheme=scheme)
            xs = [r["servers"] for r in rs]
            ws = [next(iter(r["workloads"].values())) for r in rs]
            line = ax.plot(xs, [w["measured_s"] for w in ws], "o-",
                           label=f"{scheme}{' (= switchml, n = 1)' if scheme == 'passing' else ''}")
            ax.plot(xs, [w["model_s"] for w in ws], "--", color=line[0].get_color(), label=f"{scheme} model")
        ax.set_xlabel("servers (1 rank each)")
        ax.set_ylabel("allreduce seconds")
        ax.set_xticks(SCALING_SERVERS)
        ax.set_title("per-host scaling, ResNet50, 10 Gbit/s-equivalent", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = RESULTS / f"{stem}-scaling.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# ---- main ------------------------------------------------------------------------------------


def interrupted(signum: int, frame: object) -> None:
    """SIGINT and SIGTERM unwind the harness, so its finally removes namespaces and processes."""
    raise KeyboardInterrupt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2x2 and 4x2, 10G-equivalent, ResNet50, 3 iterations")
    p.add_argument("--factor", type=float, default=100.0, help="divides link rates and gradient sizes")
    p.add_argument("--iterations", type=int, help="timed all_reduces per run (default 5, quick 3)")
    p.add_argument("--configs", nargs="+", help="servers x ranks, e.g. 2x2 4x4")
    p.add_argument("--schemes", nargs="+", choices=cost_model.SCHEMES)
    p.add_argument("--bandwidths", nargs="+", choices=tuple(PAPER_GBIT))
    p.add_argument("--workloads", nargs="+", choices=tuple(MODELS))
    p.add_argument("--nice", type=int, default=-10,
                   help="nice level of ranks and aggregators (below 0: ahead of other work on the machine)")
    p.add_argument("--no-scaling", action="store_true", help="skip the per-host scaling runs")
    p.add_argument("--switch-kind", choices=tuple(SWITCH_KINDS), default=DEFAULT_SWITCH_KIND,
                   help="the switch the emulated one stands for: its program's lanes for every packet "
                        "(tofino 64, tofino2 72; default %(default)s); a software aggregator at that lane count")
    args = p.parse_args()
    why = netns.available()
    if why:
        print(f"emulated: cannot make network namespaces ({why}); run as root", file=sys.stderr)
        return 2

    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs] if args.configs else (
        [(2, 2), (4, 2)] if args.quick else list(CONFIGS))
    schemes = args.schemes or list(cost_model.SCHEMES)
    lanes = CHIP_LANES[args.switch_kind]
    bandwidths = [Bandwidth(b, PAPER_GBIT[b] * 1000 / args.factor, lanes)
                  for b in (args.bandwidths or (["10G"] if args.quick else list(PAPER_GBIT)))]
    names = args.workloads or (["resnet50"] if args.quick else list(MODELS))
    workloads = {n: round(MODELS[n][0] / args.factor) for n in names}
    iterations = args.iterations or (3 if args.quick else 5)
    stem = ("emulated-quick" if args.quick else "emulated") + (
        "" if args.switch_kind == DEFAULT_SWITCH_KIND else f"-{args.switch_kind}")
    scaling_plan = [] if args.no_scaling else [(s, scheme) for s in SCALING_SERVERS for scheme in ("passing", "ps")]
    plan = [(scheme, s, n, bw) for bw in bandwidths for (s, n) in configs for scheme in schemes]
    total = len(plan) + len(scaling_plan)
    servers_needed = max([s for s, _ in configs] + ([max(SCALING_SERVERS)] if scaling_plan else []))

    RESULTS.mkdir(exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {"meta": {
        "quick": args.quick, "factor": args.factor, "iterations": iterations,
        "switch_kind": args.switch_kind, "lanes": lanes, "switch": switch_kind_label(args.switch_kind),
        "rates_mbit": {b.label: b.rate_mbit for b in bandwidths}, "pools": {b.label: b.pool for b in bandwidths},
        "workloads": workloads, "models": {n: MODELS[n][1] for n in names},
        "compute_s_assumed": {n: COMPUTE_S[n] for n in names}, "batch_per_gpu": BATCH_PER_GPU,
        "aggregator": f"{SWITCH_LABEL}, {switch_kind_label(args.switch_kind)} (passing, switchml); "
                      f"{PS_LABEL} (ps, psring)", "bmv2": BMV2_NOTE,
        "machine": f"{os.cpu_count()} cores, {platform.platform()}",
        "loadavg_start": open("/proc/loadavg").read().split()[:3], "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "note": "Ranks, aggregators and controllers share this machine's cores (and whatever else runs on it).",
    }, "runs": [], "scaling": []}

    def save() -> None:
        report["meta"]["duration_s"] = time.perf_counter() - started
        (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=1))

    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started with SIGINT ignored (a background job)
        signal.signal(sig, interrupted)
    print(f"emulated: {total} runs, {SWITCH_LABEL} as the switch: {switch_kind_label(args.switch_kind)} "
          f"({BMV2_NOTE}); factor {args.factor:g}: "
          + ", ".join(f"{b.label}bit/s -> {b.rate_mbit:g} Mbit/s (pool {b.pool})" for b in bandwidths)
          + "; " + ", ".join(f"{n} {e} float32" for n, e in workloads.items()), flush=True)
    with tempfile.TemporaryDirectory(prefix="passing-bench-") as tmp:
        cluster = Cluster(servers_needed, bandwidths[0].rate_mbit, Path(tmp), args.nice, args.switch_kind)
        try:
            done = 0
            for scheme, s, n, bw in plan:
                done += 1
                r = run_once(cluster, scheme, s, n, bw, workloads, iterations, args.factor)
                report["runs"].append(r)
                print(progress(done, total, r), flush=True)
                save()
            ten = next((b for b in bandwidths if b.label == "10G"), Bandwidth("10G", 10_000 / args.factor, lanes))
            for s, scheme in scaling_plan:
                done += 1
                r = run_once(cluster, scheme, s, 1, ten, {"resnet50": round(MODELS["resnet50"][0] / args.factor)},
                             iterations, args.factor)
                report["scaling"].append(r)
                print(progress(done, total, r), flush=True)
                save()
        except KeyboardInterrupt:
            print("emulated: interrupted; tearing down", flush=True)
            return 130
        finally:
            cluster.stop()
            save()
    (RESULTS / f"{stem}.md").write_text(markdown(report))
    try:
        written = plots(report, stem)
    except ImportError:
        written = []
        print("emulated: no plots: matplotlib is not installed (pip install matplotlib)", flush=True)
    print(markdown(report), flush=True)
    failed = [r for r in report["runs"] + report["scaling"] if r.get("failed")]
    print(f"emulated: wrote {RESULTS / (stem + '.json')}, {RESULTS / (stem + '.md')}"
          + "".join(f", {w}" for w in written) + f"; {len(failed)} failed; "
          f"{report['meta']['duration_s'] / 60:.1f} min", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    ensure_keys()
    sys.exit(main())
