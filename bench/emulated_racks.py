"""Emulated racks (issue 47): a job across racks, on leaf uplinks not oversubscribed and oversubscribed 2:1
and 4:1, and the latency-bound case; rack-ordered ring, hierarchical ring, PS and PASSING's tree beside the
cost model (bench/cost_model.py, predict_racks and predict_latency).

    sudo .venv/bin/python bench/emulated_racks.py --quick   # 4 racks x 2 servers, 1:1 2:1 4:1; 32 servers
    sudo .venv/bin/python bench/emulated_racks.py --racks 4 --per-rack 2 --oversubscription 1 4 --no-latency

The cluster (cluster/netns.RackNetwork): racks of servers (one namespace each, one rank each) on links of B
to their rack's leaf namespace (a bridge), each leaf on an uplink of per_rack x B / oversubscription to the
spine namespace (a bridge), and a "ps" namespace on a link of B to the spine. Every link is rate-limited
with tbf both ways. Aggregators are software aggregators at the switch kind's lanes (64: a Tofino's): one
in each leaf namespace at its bridge's address (a rack's leaf: a PS leaf, no link of its own to cross),
one in the spine namespace (the tree's root: a PS root), one in the "ps" namespace (the flat PS). Two
controllers in the spine: one with the fabric (scheme passing becomes a tree across the racks: PS leaves
and a PS root), one with the flat PS alone (scheme ps). Schemes (one rank a server):

* ring: gloo's all_reduce (backend passing, scheme ring), ranks numbered rack by rack;
* hring: the hierarchical ring on gloo (bench/emulated_racks_worker.py): reduce_scatter in the rack,
  all_reduce across racks, all_gather in the rack;
* ps: every server's gradient to the flat PS;
* tree: PASSING through the racks' leaves and the spine's root (a run whose group was not placed as a
  tree fails: no figure says tree that was not one).

The latency-bound case: one rack size of many servers (--latency-servers, default 32: 4 racks x 8), small
tensors, ring against tree, with the probes the model takes: a ring of two servers (its per-step time) and
one aggregator's round trip (two servers of one rack: a flat group on their leaf). Scale: --factor divides
the paper's 10 Gbit/s and ResNet50's gradient (default 100: 100 Mbit/s, 255 570 float32) as
bench/emulated.py does. Writes bench/results/emulated-racks[-quick].{json,md}; every run records the
machine's load (uptime) as it ended: the ranks, aggregators and the kernel's links share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

import cost_model  # noqa: E402
from emulated_cluster import cpu_pressure_us, pool_for, tbf_sizes  # noqa: E402
from emulated_report import RESULTS  # noqa: E402
from emulated_run import MODELS, wait_all  # noqa: E402

from cluster import netns  # noqa: E402
from cluster.local import ensure_keys, launch_ranks  # noqa: E402
from cluster.racks import fabric_topology, start_aggregator_in, start_spine_controller  # noqa: E402
from passing_controller.topology import CHIP_LANES  # noqa: E402

WORKER = BENCH / "emulated_racks_worker.py"


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


class RackCluster:
    """The namespaces, the aggregators (a leaf per rack, the root, the flat PS) and the two controllers."""

    def __init__(self, racks: int, per_rack: int, rate_mbit: float, oversubscription: float, workdir: Path,
                 nice: int, lanes: int) -> None:
        self.racks, self.per_rack, self.rate_mbit, self.lanes, self.nice = racks, per_rack, rate_mbit, lanes, nice
        self.net = netns.RackNetwork(racks, per_rack, rate_mbit, per_rack * rate_mbit / oversubscription, ["ps"])
        try:
            self.net.set_rate(rate_mbit, *tbf_sizes(rate_mbit, lanes))
            self.set_oversubscription(oversubscription)
            self.servers = [f"r{k}s{i}" for k in range(racks) for i in range(per_rack)]
            self.aggregators: dict[str, dict[str, str]] = {}
            for name, where, ip in [*((f"leaf{k}", f"leaf{k}", self.net.leaves[f"leaf{k}"].ip) for k in range(racks)),
                                    ("root", "switch", self.net.switch.ip), ("ps", "ps", self.net.hosts["ps"].ip)]:
                _, self.aggregators[name] = start_aggregator_in(self.popen, where, ip,
                                                                f"ipc://{workdir}/{name}-aggregator.ipc",
                                                                ["--max-lanes", str(lanes)])
            tree = fabric_topology(self.net, [self.aggregators[f"leaf{k}"] for k in range(racks)],
                                   self.aggregators["root"])
            self.controllers = {}
            for port, name, topology in ((9090, "tree", tree), (9091, "ps", {"ps": [self.aggregators["ps"]]})):
                (workdir / name).mkdir()
                _, self.controllers[name] = start_spine_controller(self.net, topology, workdir / name, port)
        except BaseException:
            self.net.stop()
            raise

    def set_oversubscription(self, oversubscription: float) -> None:
        self.oversubscription = oversubscription
        self.uplink_mbit = self.per_rack * self.rate_mbit / oversubscription
        burst, _ = tbf_sizes(self.uplink_mbit, self.lanes)  # the queue: as a server link's, windows fit in it
        self.net.set_uplink_rate(self.uplink_mbit, burst, tbf_sizes(self.rate_mbit, self.lanes)[1])

    def popen(self, where: str, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        return self.net.popen(where, ["nice", "-n", str(self.nice), *argv], **kwargs)

    def counters(self) -> dict[str, Any]:
        """Bytes through each tbf (by "namespace dev"), the tbf and UDP receive buffer drops, CPU pressure."""
        sent, drops, rcvbuf = {}, 0, 0
        for ns in self.net._namespaces:
            shown = _ns_run(ns, "tc", "-s", "qdisc", "show")
            for dev, count, dropped in re.findall(
                    r"qdisc tbf \S+ dev (\S+) .*?\n\s*Sent (\d+) bytes \d+ pkt \(dropped (\d+)", shown):
                sent[f"{ns.rsplit('-', 1)[1]} {dev}"] = int(count)
                drops += int(dropped)
            snmp = [ln.split() for ln in _ns_run(ns, "cat", "/proc/net/snmp").splitlines() if ln.startswith("Udp:")]
            rcvbuf += int(dict(zip(snmp[0][1:], snmp[1][1:]))["RcvbufErrors"])
        return {"sent": sent, "tbf_drops": drops, "udp_rcvbuf_drops": rcvbuf, "cpu_waiting_us": cpu_pressure_us(),
                "time": time.perf_counter()}

    def stop(self) -> None:
        self.net.stop()


def _ns_run(ns: str, *argv: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, check=True).stdout


def run(cluster: RackCluster, scheme: str, servers: list[str], elements: int, iterations: int,
        extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """One scheme on ``servers`` (one rank each, in that order): the slowest rank's median all_reduce, the
    links' bytes and drops over the run, the load."""
    env = {"PASSING_SCHEME": {"tree": "passing"}.get(scheme, scheme), "GLOO_SOCKET_IFNAME": "eth0",
           "PASSING_CONTROLLER": cluster.controllers["ps" if scheme == "ps" else "tree"],
           "PASSING_POOL": str(pool_for(cluster.rate_mbit, cluster.lanes)),
           "PASSING_RACK_SIZE": str(min(cluster.per_rack, len(servers))), **(extra_env or {})}
    argv = [sys.executable, str(WORKER), "--iterations", str(iterations), "--workload", f"w={elements}"]
    started, before = time.perf_counter(), cluster.counters()
    procs = launch_ranks(argv, len(servers), 1, env,
                         popen_for_server=lambda s: lambda a, **kw: cluster.popen(servers[s], a, **kw),
                         env_for_server=lambda s: {"PASSING_HOST": cluster.net.hosts[servers[s]].ip},
                         master_host=cluster.net.hosts[servers[0]].ip)
    outcomes = wait_all(procs, 300 + 2 * len(servers))
    after = cluster.counters()
    head = {"scheme": scheme, "servers": len(servers), "oversubscription": cluster.oversubscription,
            "rate_mbit": cluster.rate_mbit, "uplink_mbit": cluster.uplink_mbit, "elements": elements,
            "wall_s": time.perf_counter() - started, "uptime": uptime(),
            "loadavg": open("/proc/loadavg").read().split()[:3]}
    lines = []
    for rank, (code, out, err) in enumerate(outcomes):
        found = [ln for ln in out.splitlines() if ln.startswith("{")]
        if code != 0 or not found:
            return {**head, "failed": True, "error": f"rank {rank} exited {code}: " + err.strip()[-1500:]}
        lines.append(json.loads(found[-1]))
    if scheme == "tree" and len({s[:s.index("s")] for s in servers}) > 1 and lines[0]["mode"] != "tree":
        return {**head, "failed": True, "error": f"not placed as a tree: {lines[0]['mode']}, {lines[0]['reason']}"}
    moved = {k: v - before["sent"].get(k, 0) for k, v in after["sent"].items()}
    per = [r["workloads"]["w"] for r in lines]
    return {**head, "mode": lines[0]["mode"], "reason": lines[0]["reason"],
            "measured_s": max(w["median_s"] for w in per), "min_s": max(min(w["seconds"]) for w in per),
            "seconds": [w["seconds"] for w in per], "fixed_s": max(r["fixed_s"] for r in lines),
            "retransmissions": sum(w["transport"].get("retransmissions", 0) for w in per),
            "tbf_drops": after["tbf_drops"] - before["tbf_drops"],
            "udp_rcvbuf_drops": after["udp_rcvbuf_drops"] - before["udp_rcvbuf_drops"],
            "cpu_pressure": (after["cpu_waiting_us"] - before["cpu_waiting_us"]) / 1e6
            / (after["time"] - before["time"]),
            # busiest uplink (leaf side: toward the spine) and busiest server link (server side: toward its
            # leaf), bytes per all_reduce of the run (a warm-up, the timed ones, the probes' few bytes)
            "uplink_bytes": max(v for k, v in moved.items() if k.endswith(" uplink")) / (iterations + 1),
            "server_link_bytes": max(v for k, v in moved.items() if k.endswith(" eth0") and not
                                     k.startswith("ps ")) / (iterations + 1),
            "ps_link_bytes": moved.get("ps eth0", 0) / (iterations + 1)}


def bandwidth_rows(cluster: RackCluster, schemes: list[str], oversubs: list[float], elements: int,
                   iterations: int, report: dict, save) -> None:
    for o in oversubs:
        cluster.set_oversubscription(o)
        for scheme in schemes:
            r = run(cluster, scheme, cluster.servers, elements, iterations)
            if not r.get("failed"):
                setup = cost_model.Racks(cluster.racks, cluster.per_rack, cluster.rate_mbit, cluster.uplink_mbit,
                                         pool_for(cluster.rate_mbit, cluster.lanes), max(r["fixed_s"] / 2, 1e-4),
                                         r["fixed_s"], cluster.lanes)
                model = cost_model.predict_racks(scheme, elements, setup)
                r.update(model_s=model.seconds, ratio=r["measured_s"] / model.seconds, model=model.as_dict())
            report["bandwidth"].append(r)
            print(line(r), flush=True)
            save()


def latency_rows(cluster: RackCluster, elements: list[int], iterations: int, report: dict, save) -> None:
    """Ring against tree on every server, small tensors; the probes on two servers of one rack."""
    pair = cluster.servers[:2]
    fixed = {"PASSING_SCALE": "1e6"}  # a fixed scale: no MAX round, a call is one round trip through the tree
    for n in elements:
        probes = {s: run(cluster, s, pair, n, iterations, fixed) for s in ("ring", "tree")}
        for scheme in ("ring", "tree"):
            r = run(cluster, scheme, cluster.servers, n, iterations, fixed)
            p = probes[scheme]
            r["probe"] = {k: p.get(k) for k in ("measured_s", "mode", "failed", "error")}
            if not (r.get("failed") or p.get("failed")):
                # the ring's two servers take 2 steps; one aggregator's round trip is the pair's flat call
                unit = p["measured_s"] / cost_model.ring_steps(2) if scheme == "ring" else p["measured_s"]
                r["model_s"] = cost_model.predict_latency(scheme, len(cluster.servers), unit, unit)
                r["ratio"] = r["measured_s"] / r["model_s"]
                r["steps"] = cost_model.ring_steps(len(cluster.servers)) if scheme == "ring" else 1
            report["latency"].append(r)
            print(line(r), flush=True)
            save()


def line(r: dict[str, Any]) -> str:
    head = f"{r['scheme']:6s} {r['servers']} servers, {r['oversubscription']:g}:1, {r['elements']} float32"
    if r.get("failed"):
        return f"{head}: FAILED after {r['wall_s']:.0f} s: {r['error']}"
    model = f" (model {r['model_s']:.4f}, x{r['ratio']:.2f})" if "model_s" in r else ""
    return (f"{head}: {r['measured_s']:.4f} s{model}; uplink {r['uplink_bytes'] / 1e6:.2f} MB, server link "
            f"{r['server_link_bytes'] / 1e6:.2f} MB per call; {r['retransmissions']} retx, {r['tbf_drops']} tbf "
            f"drops; mode {r['mode']}; CPU pressure {r['cpu_pressure']:.0%}; {r['uptime']}")


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    out = [f"# Emulated racks ({m['started']}, {m['machine']})", "",
           f"{m['racks']} racks x {m['per_rack']} servers, one rank each, server links {m['rate_mbit']:g} Mbit/s "
           f"(factor {m['factor']:g} of 10 Gbit/s), {m['elements']} float32 (ResNet50 / factor); software "
           f"aggregators at {m['lanes']} lanes. Load at the start: {m['uptime_start']}. **Taken under load**: "
           "ranks, aggregators and links share this machine's cores with whatever else runs.", "",
           "| uplink | scheme | measured s | model s | ratio | model's bottleneck | its MB/call: measured, model | "
           "uplink MB/call | server link MB/call | retx | drops | load (1 min) |",
           "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in report["bandwidth"]:
        if r.get("failed"):
            out.append(f"| {r['oversubscription']:g}:1 | {r['scheme']} | FAILED: {r['error'][:80]} |")
            continue
        link = r["model"]["link"]
        measured = r[{"uplink": "uplink_bytes", "server link": "server_link_bytes", "PS link": "ps_link_bytes"}[link]]
        out.append(f"| {r['oversubscription']:g}:1 ({r['uplink_mbit']:g} Mbit/s) | {r['scheme']} | "
                   f"{r['measured_s']:.3f} | {r['model_s']:.3f} | {r['ratio']:.2f} | {link} | {measured / 1e6:.2f}, "
                   f"{r['model']['link_bytes'] / 1e6:.2f} | {r['uplink_bytes'] / 1e6:.2f} | "
                   f"{r['server_link_bytes'] / 1e6:.2f} | {r['retransmissions']} | "
                   f"{r['tbf_drops'] + r['udp_rcvbuf_drops']} | {r['loadavg'][0]} |")
    if report["latency"]:
        out += ["", "Latency-bound (fixed scale: one round trip a call on the tree):", "",
                "| servers | float32 | scheme | steps | measured ms | probe on 2 servers ms | model ms | ratio | "
                "load (1 min) |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in report["latency"]:
            if r.get("failed") or "model_s" not in r:
                out.append(f"| {r['servers']} | {r['elements']} | {r['scheme']} | FAILED: "
                           f"{(r.get('error') or r['probe'].get('error') or '')[:80]} |")
                continue
            out.append(f"| {r['servers']} | {r['elements']} | {r['scheme']} | {r['steps']} | "
                       f"{1e3 * r['measured_s']:.2f} | {1e3 * r['probe']['measured_s']:.2f} | {1e3 * r['model_s']:.2f} "
                       f"| {r['ratio']:.2f} | {r['loadavg'][0]} |")
    return "\n".join(out) + "\n"


def interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 iterations, one small latency size")
    p.add_argument("--racks", type=int, default=4)
    p.add_argument("--per-rack", type=int, default=2)
    p.add_argument("--oversubscription", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    p.add_argument("--schemes", nargs="+", choices=cost_model.RACK_SCHEMES, default=list(cost_model.RACK_SCHEMES))
    p.add_argument("--factor", type=float, default=100.0, help="divides the 10 Gbit/s links and ResNet50's size")
    p.add_argument("--iterations", type=int, help="timed all_reduces per run (default 5, quick 3)")
    p.add_argument("--latency-racks", type=int, default=4)
    p.add_argument("--latency-per-rack", type=int, default=8)
    p.add_argument("--latency-elements", type=int, nargs="+", help="float32 per call (default 64 256; quick 64)")
    p.add_argument("--no-latency", action="store_true")
    p.add_argument("--no-bandwidth", action="store_true")
    p.add_argument("--nice", type=int, default=-10)
    p.add_argument("--stem", help="results file names (default emulated-racks, quick: emulated-racks-quick)")
    args = p.parse_args()
    why = netns.available()
    if why:
        print(f"emulated_racks: cannot make network namespaces ({why}); run as root", file=sys.stderr)
        return 2
    lanes = CHIP_LANES["tofino"]
    rate, elements = 10_000 / args.factor, round(MODELS["resnet50"][0] / args.factor)
    iterations = args.iterations or (3 if args.quick else 5)
    stem = args.stem or "emulated-racks" + ("-quick" if args.quick else "")
    report: dict[str, Any] = {"meta": {
        "racks": args.racks, "per_rack": args.per_rack, "rate_mbit": rate, "factor": args.factor,
        "elements": elements, "lanes": lanes, "iterations": iterations, "machine": f"{os.cpu_count()} cores, "
        f"{platform.platform()}", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "uptime_start": uptime(),
        "note": "Taken under load: ranks, aggregators and links share the machine's cores with other work."},
        "bandwidth": [], "latency": []}
    RESULTS.mkdir(exist_ok=True)
    started = time.perf_counter()

    def save() -> None:
        report["meta"]["duration_s"] = time.perf_counter() - started
        (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=1))

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupted)
    print(f"emulated_racks: {uptime()}", flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="passing-racks-") as tmp:
            if not args.no_bandwidth:
                (Path(tmp) / "bw").mkdir()
                cluster = RackCluster(args.racks, args.per_rack, rate, args.oversubscription[0], Path(tmp) / "bw",
                                      args.nice, lanes)
                try:
                    bandwidth_rows(cluster, args.schemes, args.oversubscription, elements, iterations, report, save)
                finally:
                    cluster.stop()
            if not args.no_latency:
                (Path(tmp) / "lat").mkdir()
                cluster = RackCluster(args.latency_racks, args.latency_per_rack, rate, 1.0, Path(tmp) / "lat",
                                      args.nice, lanes)
                try:
                    sizes = args.latency_elements or ([64] if args.quick else [64, 256])
                    latency_rows(cluster, sizes, max(iterations, 10), report, save)
                finally:
                    cluster.stop()
    except KeyboardInterrupt:
        print("emulated_racks: interrupted; tearing down", flush=True)
        return 130
    finally:
        save()
    (RESULTS / f"{stem}.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    failed = [r for r in report["bandwidth"] + report["latency"] if r.get("failed")]
    print(f"emulated_racks: wrote {RESULTS / (stem + '.json')}, {RESULTS / (stem + '.md')}; {len(failed)} failed; "
          f"{report['meta']['duration_s'] / 60:.1f} min", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    ensure_keys()
    sys.exit(main())
