"""An FSDP step's communication on backend "passing" against gloo, in the same rank processes.

    python bench/fsdp_comm.py [--servers 4] [--ranks 2] [--params 1048576] [--iterations 7]
    sudo .venv/bin/python bench/fsdp_comm.py --emulated [--factor 100] [--configs 4x2 8x1] [--switch-kind tofino2]

FSDP2 (fully_shard, resharding after forward) moves, per step and per parameter of the model, an
all_gather in forward, an all_gather in backward and a reduce_scatter of the gradients; in backward
it issues the next layer's all_gather while the previous layer's reduce_scatter runs. Each rank
times, alternating PASSING's calls with gloo's in the same processes:

* each collective alone (``all_gather_into_tensor``, ``reduce_scatter_tensor`` of ``params``
  float32), and, in the emulated cluster, the bytes each server's link carried up and down per call
  (the byte counters of the two tbfs of its link, read by the server's local rank 0 between barriers);
* a step: the forward all_gather, then the backward all_gather and the reduce_scatter issued
  together (``async_op=True``) and both waited for: both PASSING (its all_gathers have a lane of
  their own, passing.torch.network.GatherLane) and gloo (two threads per group) overlap them.
  PASSING's UDP payload per step and server (its ranks' transport counters) against the physics.

Loopback (the default): s servers x n ranks on one machine, PASSING through a software aggregator
behind a PS-only controller (cluster.local). ``--emulated`` (root): the emulated cluster of
bench/emulated.py, every server behind a tbf-limited link (the paper's 10 Gbit/s divided by
``--factor``), PASSING through the software aggregator that stands for the switch (in the switch
namespace, no link limit of its own, the packets of ``--switch-kind``'s program: tofino 64 lanes,
the default, tofino2 64 (72 before the tree roles); an emulated Tofino 2 is a software aggregator at
that lane count, nothing more), gloo over the same links. Writes bench/results/fsdp_comm.json (loopback) or
fsdp_comm-emulated.json (fsdp_comm-emulated-<kind>.json for a switch kind other than tofino).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
UPLINK_ENV = "PASSING_BENCH_UPLINK"  # "namespace device" of the tbf that limits this server's uplink (emulated)
DOWNLINK_ENV = "PASSING_BENCH_DOWNLINK"  # and of the one on the switch's side that limits its downlink


def tbf_sent(where: str) -> int:
    """Bytes a tbf has sent: the wire's bytes, headers of every segment included (the device counters count a
    segmentation-offloaded batch's headers once)."""
    namespace, device = where.split()
    shown = subprocess.run(["ip", "netns", "exec", namespace, "tc", "-s", "qdisc", "show", "dev", device],
                           capture_output=True, text=True, check=True).stdout
    found = re.search(r"qdisc tbf .*?\n\s*Sent (\d+) bytes", shown)
    if found is None:
        raise RuntimeError(f"no tbf on {device} in {namespace}: {shown.strip()}")
    return int(found.group(1))


def link_bytes() -> tuple[int, int] | None:
    """(bytes up, bytes down) so far on this server's link, or None outside the emulated cluster."""
    up, down = os.environ.get(UPLINK_ENV), os.environ.get(DOWNLINK_ENV)
    return (tbf_sent(up), tbf_sent(down)) if up and down else None


def stamp_end(work: Any, kind: str, done: dict[str, float]) -> None:
    work.wait()
    done[kind] = time.perf_counter()


def worker(params: int, iterations: int) -> None:
    import torch
    import torch.distributed as dist

    import passing.torch  # noqa: F401  (registers backend "passing")

    dist.init_process_group("passing")
    world = dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    shard = params // world
    piece = torch.randn(shard)
    gathered = torch.empty(shard * world)
    grads = torch.randn(shard * world)
    reduced = torch.empty(shard)
    groups = (("passing", None), ("gloo", gloo))

    def collective(kind: str, group: Any, async_op: bool = False) -> Any:
        if kind == "all_gather":
            return dist.all_gather_into_tensor(gathered, piece, group=group, async_op=async_op)
        return dist.reduce_scatter_tensor(reduced, grads, group=group, async_op=async_op)

    # each collective alone: one warm-up, then timed calls after a barrier each; link bytes per call
    alone: dict[str, Any] = {}
    for name, group in groups:
        for kind in ("all_gather", "reduce_scatter"):
            collective(kind, group)
            dist.barrier(group=gloo)
            before, seconds = link_bytes(), []
            for _ in range(iterations):
                dist.barrier(group=gloo)
                start = time.perf_counter()
                collective(kind, group)
                seconds.append(time.perf_counter() - start)
            dist.barrier(group=gloo)
            after = link_bytes()
            moved = None if before is None or after is None else {
                "up": (after[0] - before[0]) / iterations, "down": (after[1] - before[1]) / iterations}
            alone[f"{name}_{kind}"] = {"median_s": statistics.median(seconds), "link_bytes_per_call": moved}

    # a step: forward all_gather; backward all_gather and reduce_scatter issued together
    steps: dict[str, list[float]] = {name: [] for name, _ in groups}
    backward_s = {name: {"all_gather": [], "reduce_scatter": []} for name, _ in groups}
    pg = dist.distributed_c10d._get_default_group()
    payload: dict[str, int] = {}  # PASSING's UDP payload over the timed steps
    for i in range(iterations + 1):  # the first of each: warm-up
        if i == 1:
            payload = pg.transport_stats()
        for name, group in groups:
            dist.barrier(group=gloo)
            start = time.perf_counter()
            collective("all_gather", group)
            backward, done = time.perf_counter(), {}
            works = [collective("all_gather", group, async_op=True), collective("reduce_scatter", group, async_op=True)]
            waiters = [threading.Thread(target=stamp_end, args=(work, kind, done))  # when each one ends
                       for kind, work in zip(("all_gather", "reduce_scatter"), works)]
            for waiter in waiters:
                waiter.start()
            for waiter in waiters:
                waiter.join()
            if i:
                end = time.perf_counter()
                steps[name].append(end - start)
                for kind in ("all_gather", "reduce_scatter"):  # from the backward's start to each one's end
                    backward_s[name][kind].append(done.get(kind, end) - backward)
    after = pg.transport_stats()
    step_payload = {"up": (after.get("bytes_sent", 0) - payload.get("bytes_sent", 0)) / iterations,
                    "down": (after.get("bytes_received", 0) - payload.get("bytes_received", 0)) / iterations}
    report = {"mode": pg.mode, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
              "lanes": {"reduce lane": pg.stream.lanes if pg.stream else None,
                        "gather lane": pg.gather_lane.network.stream.lanes if pg.gather_lane else None},
              "server": int(os.environ.get("GROUP_RANK", "0")), "alone": alone,
              "step_median_s": {k: statistics.median(v) for k, v in steps.items()}, "steps_s": steps,
              "step_payload": step_payload, "transport": after,
              "resent": {"reduce lane": pg.stream.stats.as_dict() if pg.stream else {},
                         "gather lane": pg.gather_lane.network.stream.stats.as_dict() if pg.gather_lane else {}},
              "backward_median_s": {n: {k: statistics.median(v) for k, v in b.items()} for n, b in backward_s.items()}}
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)


def physics(servers: int, size: int) -> dict[str, dict[str, float]]:
    """PASSING's payload bytes per server (docs/protocol.md, Kinds; S = the tensor's bytes, N servers, in-host
    stage first). gloo's, for comparison in docs/benchmarks.md: a ring of W ranks, those of a server adjacent,
    moves (W-1)/W S each way per all_gather and twice that per reduce_scatter (an all_reduce in gloo)."""
    n = servers
    gather = {"up": size / n, "down": size * (n - 1) / n}
    scatter = {"up": size, "down": size / n}
    return {"all_gather": gather, "reduce_scatter": scatter,  # a step: two all_gathers and a reduce_scatter
            "step": {k: 2 * gather[k] + scatter[k] for k in ("up", "down")}}


def summarize(outcomes: list[dict[str, Any]], servers: int, ranks: int, params: int) -> dict[str, Any]:
    """Medians over the ranks (each a median over its calls); link bytes per server from each local rank 0."""
    world = servers * ranks
    size = params // world * world * 4  # the gathered and reduced tensor's bytes
    alone = {}
    for key in outcomes[0]["alone"]:
        entry: dict[str, Any] = {"median_s": statistics.median(r["alone"][key]["median_s"] for r in outcomes)}
        moved = [r["alone"][key]["link_bytes_per_call"] for r in outcomes if r["local_rank"] == 0]
        if moved and moved[0] is not None:
            entry["link_up_per_server"] = statistics.median(m["up"] for m in moved)
            entry["link_down_per_server"] = statistics.median(m["down"] for m in moved)
            if key.startswith("passing_"):
                want = physics(servers, size)[key.removeprefix("passing_")]
                entry["up_over_physics"] = entry["link_up_per_server"] / want["up"]
                entry["down_over_physics"] = entry["link_down_per_server"] / want["down"]
        alone[key] = entry
    step = {name: statistics.median(r["step_median_s"][name] for r in outcomes) for name in ("passing", "gloo")}
    per_server: dict[int, dict[str, float]] = {}  # PASSING's payload per step, summed over each server's ranks
    for r in outcomes:
        mine = per_server.setdefault(r["server"], {"up": 0.0, "down": 0.0})
        for k in ("up", "down"):
            mine[k] += r["step_payload"][k]
    want = physics(servers, size)["step"]
    payload = {k: statistics.median(p[k] for p in per_server.values()) for k in ("up", "down")}
    backward = {n: {k: statistics.median(r["backward_median_s"][n][k] for r in outcomes)
                    for k in ("all_gather", "reduce_scatter")} for n in ("passing", "gloo")}
    return {"step_payload_per_server": payload, "backward_s": backward,
            "step_payload_over_physics": {k: payload[k] / want[k] for k in ("up", "down")},
            "servers": servers, "ranks": ranks, "params": params, "tensor_bytes": size, "mode": outcomes[0]["mode"],
            "alone": alone, "step_s": step, "gloo_over_passing": step["gloo"] / step["passing"],
            "retransmissions": sum(r["transport"].get("retransmissions", 0) for r in outcomes),
            "lanes": sorted({n for r in outcomes for n in r["lanes"].values() if n is not None}),
            "per_rank": [{k: r[k] for k in ("server", "local_rank", "steps_s", "resent")} for r in outcomes]}


def line(r: dict[str, Any]) -> str:
    a = r["alone"]
    where = f"switch: {r['switch']}, " if "switch" in r else ""
    text = (f"{r['servers']}x{r['ranks']}, {r['params']} float32 ({r['mode']}, {where}lanes {r['lanes']}"
            + (f", load {' '.join(r['loadavg'])}" if "loadavg" in r else "") + "): step PASSING "
            f"{r['step_s']['passing'] * 1e3:.1f} ms, gloo {r['step_s']['gloo'] * 1e3:.1f} ms, gloo / PASSING = "
            f"{r['gloo_over_passing']:.2f}; {r['retransmissions']} resent; step payload per server / physics "
            f"up {r['step_payload_over_physics']['up']:.3f}, "
            f"down {r['step_payload_over_physics']['down']:.3f}; "
            "backward: all_gather / reduce_scatter done after " + ", ".join(
                f"{n} {r['backward_s'][n]['all_gather'] * 1e3:.1f} / "
                f"{r['backward_s'][n]['reduce_scatter'] * 1e3:.1f} ms" for n in ("passing", "gloo")) + "; alone (ms): ")
    text += ", ".join(f"{k} {v['median_s'] * 1e3:.1f}" for k, v in a.items())
    if "link_up_per_server" in a["passing_all_gather"]:
        text += "; per server up/down, x S: " + ", ".join(
            f"{k} {v['link_up_per_server'] / r['tensor_bytes']:.3f}/{v['link_down_per_server'] / r['tensor_bytes']:.3f}"
            for k, v in a.items())
    return text


def check(outcomes: list[tuple[int, dict[str, Any] | None, str]]) -> list[dict[str, Any]]:
    for rank, (rc, report, stderr) in enumerate(outcomes):
        if rc != 0 or report is None:
            raise SystemExit(f"rank {rank} failed ({rc}):\n{stderr[-3000:]}")
    return [report for _, report, _ in outcomes]


def worker_argv(args: argparse.Namespace, params: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", "--params", str(params),
            "--iterations", str(args.iterations)]


def run_loopback(args: argparse.Namespace) -> dict[str, Any]:
    from cluster.local import LocalServices, collect, launch_ranks

    params = args.params or 1 << 20
    with LocalServices() as services:
        outcomes = check(collect(launch_ranks(worker_argv(args, params), args.servers, args.ranks,
                                              {"PASSING_CONTROLLER": services.controller, "PASSING_TIMEOUT": "60",
                                               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}), 1800))
    return summarize(outcomes, args.servers, args.ranks, params)


def tbf_env(net: Any, name: str) -> dict[str, str]:
    """Where host ``name``'s two tbfs are: on its interface, and on its port in the switch's namespace."""
    host = net.hosts[name]
    return {UPLINK_ENV: f"{host.namespace} {host.interface}",
            DOWNLINK_ENV: f"{net.switch.namespace} {host.switch_port}"}


def run_emulated(args: argparse.Namespace) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO / "bench"))
    import emulated_cluster
    import emulated_run

    from cluster import netns
    from cluster.local import collect, launch_ranks

    why = netns.available()
    if why:
        raise SystemExit(f"fsdp_comm: cannot make network namespaces ({why}); run as root")
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs]
    rate = 10_000 / args.factor  # the paper's 10 Gbit/s link
    params = args.params or round(emulated_run.MODELS["resnet50"][0] / args.factor)
    lanes = emulated_cluster.CHIP_LANES[args.switch_kind]
    pool = args.pool or emulated_cluster.pool_for(rate, lanes)
    results = []
    with tempfile.TemporaryDirectory(prefix="passing-fsdp-") as tmp:
        cluster = emulated_cluster.Cluster(max(s for s, _ in configs), rate, Path(tmp), args.nice, args.switch_kind)
        try:
            for servers, ranks in configs:
                env = {"PASSING_CONTROLLER": cluster.controllers["switch"], "PASSING_TIMEOUT": "120",
                       "PASSING_POOL": str(pool), "GLOO_SOCKET_IFNAME": "eth0"}
                in_server = lambda s: lambda a, **kw: cluster.popen(cluster.servers[s], a, **kw)  # noqa: E731
                procs = launch_ranks(worker_argv(args, params), servers, ranks, env, popen_for_server=in_server,
                                     env_for_server=lambda s: tbf_env(cluster.net, cluster.servers[s]),
                                     master_host=cluster.net.hosts[cluster.servers[0]].ip)
                r = summarize(check(collect(procs, 1800)), servers, ranks, params)
                if r["lanes"] != [lanes]:  # the controller gave other packets than the switch kind's: no figure
                    raise SystemExit(f"fsdp_comm: the ranks used {r['lanes']} lanes, switch kind "
                                     f"{args.switch_kind} {lanes}")
                r.update({"factor": args.factor, "rate_mbit": rate, "pool": pool, "switch_kind": args.switch_kind,
                          "switch": emulated_cluster.switch_kind_label(args.switch_kind),
                          "aggregator": emulated_cluster.SWITCH_LABEL,
                          "loadavg": open("/proc/loadavg").read().split()[:3]})
                print(line(r), flush=True)
                results.append(r)
        finally:
            cluster.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--params", type=int, help="float32 parameters (default 1 M; emulated: ResNet50 / factor)")
    parser.add_argument("--iterations", type=int, default=7)
    parser.add_argument("--emulated", action="store_true", help="servers in network namespaces behind tbf links (root)")
    parser.add_argument("--factor", type=float, default=100.0, help="emulated: divides the 10 Gbit/s link rate")
    parser.add_argument("--configs", nargs="+", default=["4x2", "8x1"], help="emulated: servers x ranks")
    parser.add_argument("--pool", type=int,
                        help="emulated: slots per group (default: bench/emulated_cluster.py's pool_for)")
    parser.add_argument("--nice", type=int, default=-10, help="emulated: nice level of ranks and aggregators")
    parser.add_argument("--switch-kind", choices=("tofino", "tofino2"), default="tofino",
                        help="emulated: the switch the software aggregator stands for, by its program's lanes "
                             "(tofino 64, tofino2 64; default %(default)s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.params, args.iterations)
        return
    sys.path.insert(0, str(REPO))
    from cluster.local import ensure_keys

    ensure_keys()  # the controller, aggregator and workers authenticate (docs/security.md)
    RESULTS.mkdir(exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.emulated:
        runs = run_emulated(args)
        out = RESULTS / ("fsdp_comm-emulated.json" if args.switch_kind == "tofino"
                         else f"fsdp_comm-emulated-{args.switch_kind}.json")
        out.write_text(json.dumps({"started": started, "runs": runs}, indent=2) + "\n")
    else:
        result = run_loopback(args)
        print(line(result), flush=True)
        out = RESULTS / "fsdp_comm.json"
        out.write_text(json.dumps({"started": started, **result}, indent=2) + "\n")
    print(f"fsdp_comm: wrote {out}")


if __name__ == "__main__":
    main()
