"""One run of bench/emulated.py: s x n ranks of one scheme on the emulated cluster, their figures beside the
cost model's, and the cluster's health over the run; the paper's workloads and links it scales down."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cost_model
from emulated_cluster import (
    PS_LABEL,
    SWITCH_LABEL,
    AggregatorMonitor,
    Cluster,
    aggregator_of,
    pool_for,
    switch_kind_label,
)

from cluster.local import launch_ranks

WORKER = Path(__file__).resolve().parent / "emulated_worker.py"

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


@dataclass(frozen=True)
class Bandwidth:
    label: str  # "10G" / "1G": the paper's link it stands for
    rate_mbit: float
    lanes: int = cost_model.LANES  # the switch kind's packets

    @property
    def pool(self) -> int:
        return pool_for(self.rate_mbit, self.lanes)


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
