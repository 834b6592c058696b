"""Core benchmark: raw batched UDP, the software aggregator and allreduce, native vs numpy vs gloo.

    make bench-core                    # or: python bench/core.py [--quick] [--workers 2 4 8]

One run measures, everything on this machine, on loopback, as separate processes:

1. the raw batched UDP blast (GSO/GRO and plain datagrams), no processing;
2. the aggregator alone, open loop, for each engine (native: C data path; numpy: Python);
3. the allreduce of 8 MiB float32 (2 097 152 elements) with 2, 4, 8 workers on the native
   path (native host engine + native aggregator), the numpy path (both numpy) and gloo,
   plus one row at 1024 lanes per packet (2 workers);
4. the aggregator's CPU at a steady 5 000 packets/s of a 2-worker job, for each engine;
5. the peak memory a 25M-float allreduce adds in a worker (native path, out= and out=None);
6. allreduce under host-side loss (4 workers, 200 000 floats, loss 0/1/5/20 % each way);
7. torch's all_reduce on backend "passing" with no controller configured, against gloo in
   the same processes: one server of 2 ranks (1 M float32); then, for each mode (PASSING_EMBEDDED
   off: the ring, gloo among each local rank's peers; ps: rank 0's embedded controller and
   aggregator), 2, 4, 8 single-rank servers and 2 x 2, 4 x 2 ranks (8 MiB) on loopback, and as
   root, servers in network namespaces over veths: 2 x 1, 2 x 2, 4 x 2 at MTU 1500, 2 x 1 at 9000.
   Each row has the load average beside it.
8. the host stage per core (bench/core_percore.py): one worker and the native aggregator pinned to a core each,
   at 64, 72, 144 and 364 lanes, on loopback and (root) on a veth pair between network namespaces, for each I/O
   path side by side (UDP sockets; AF_XDP where built): payload Gbit/s each way per second of the worker's own
   CPU, its waiting, perf's top symbols, and callgrind's instructions per packet where perf cannot count them.

Prints tables and the targets next to the figures; writes bench/results/core.json (`--sections 8` alone:
`--out bench/results/core_percore.json`). The
figures include the CPU contention of the workers and the aggregator sharing the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from passing import wire

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: cluster/

from core_host import (  # noqa: E402
    aggregator_capacity,
    aggregator_steady,
    allreduce_memory,
    blast_receiver,
    done,
    gloo_allreduce,
    gloo_worker,
    memory_worker,
    passing_allreduce,
    raw_blast,
)
from core_percore import callgrind_counts, percore, percore_worker, perf_counts_instructions  # noqa: E402
from core_targets import MIB, TARGET_LOSS, Targets, judge_host_targets, judge_torch_targets  # noqa: E402
from core_torch import torch_allreduce, torch_worker  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ENGINES = ("native", "numpy")  # native: native host engine + native aggregator; numpy: both numpy


# ---- the sections ------------------------------------------------------------------------------


def _ms(row: dict[str, Any] | None) -> str:
    if row is None:
        return "n/a"
    return f"{row['seconds'] * 1e3:.1f}" if "seconds" in row else "FAILED"


def section_raw(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    print("\n== 1. raw batched UDP blast (one sender process, one receiver process) ==")
    raw: dict[str, Any] = {}
    for mode, offload in (("offload", True), ("plain", False)):
        raw[mode] = r = raw_blast(args.lanes, args.blast_seconds, offload)
        print(f"{mode:>7}: {r['packets_per_s'] / 1e3:7.0f} kpps received ({r['gbit_per_s']:.2f} Gbit/s; "
              f"{r['received']}/{r['sent']} delivered)", flush=True)
    return raw


def section_capacity(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    print("\n== 2. the aggregator alone, open loop, GSO/GRO ==")
    print(f"{'engine':>7} | {'workers':>7} | {'taken kpps':>10} | {'CPU':>5} | {'us/packet':>9} | "
          f"{'kpps per busy core':>18} | {'vs raw GSO':>10}")
    raw = results["raw"]
    capacity: dict[str, dict[str, Any]] = {e: {} for e in args.engines}
    for engine in args.engines:
        for n in args.workers:
            c = aggregator_capacity(engine, n, args.lanes, args.pool, args.blast_seconds)
            c["vs_raw_gso"] = c["capacity_packets_per_s"] / raw["offload"]["packets_per_s"] if raw else None
            capacity[engine][str(n)] = c
            print(f"{engine:>7} | {n:>7} | {c['packets_per_s'] / 1e3:10.0f} | {c['cpu_share']:5.0%} | "
                  f"{c['cpu_us_per_packet']:9.3f} | {c['capacity_packets_per_s'] / 1e3:18.0f} | "
                  f"{c['vs_raw_gso'] or 0:10.0%}", flush=True)
    return capacity


def section_allreduce(args: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    engines = args.engines
    print(f"\n== 3. allreduce of {args.elements} float32, ms per call (1 warm-up + {args.iterations} timed), "
          f"aggregator CPU ms per call ==")
    print(f"{'workers':>7} | {'lanes':>5} | {'native ms':>9} | {'numpy ms':>9} | {'gloo ms':>8} | "
          f"{'native/numpy speed-up':>21} | {'native/gloo':>11} | {'agg CPU ms nat/np':>17} | "
          f"{'retx nat/np':>11} | {'exact':>5}")
    configs = [(n, args.lanes, args.pool) for n in args.workers]
    if args.wide_lanes:
        configs.append((2, args.wide_lanes, args.wide_pool))
    gloo: dict[int, dict[str, Any] | None] = {}
    allreduce: list[dict[str, Any]] = []
    for n, lanes, pool in configs:
        if n not in gloo:
            gloo[n] = gloo_allreduce(n, args.elements, args.iterations)
        row: dict[str, Any] = {"workers": n, "lanes": lanes, "pool": pool, "gloo": gloo[n]}
        for engine in engines:
            row[engine] = passing_allreduce(engine, n, args.elements, lanes, pool, args.iterations)
        nat, nump, gl = row.get("native"), row.get("numpy"), gloo[n]
        row["speedup"] = nump["seconds"] / nat["seconds"] if done(nat) and done(nump) else None
        row["native_vs_gloo"] = nat["seconds"] / gl["seconds"] if done(nat) and gl else None
        allreduce.append(row)
        cpu = "/".join(f"{row[e]['aggregator_cpu_ms_per_call']:.0f}" if done(row[e]) else "-" for e in engines)
        retx = "/".join(str(row[e]["retransmissions"]) if done(row[e]) else "-" for e in engines)
        exact = all(row[e]["ok"] for e in engines)
        speedup = f"{row['speedup']:.1f}x" if row["speedup"] else "n/a"
        vs_gloo = f"{row['native_vs_gloo']:.1f}x" if row["native_vs_gloo"] else "n/a"
        print(f"{n:>7} | {lanes:>5} | {_ms(nat):>9} | {_ms(nump):>9} | {_ms(gl):>8} | {speedup:>21} | "
              f"{vs_gloo:>11} | {cpu:>17} | {retx:>11} | {'yes' if exact else 'NO':>5}", flush=True)
    return allreduce


def section_steady(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    print(f"\n== 4. aggregator CPU at a steady {args.steady_rate:.0f} packets/s (2-worker job, "
          f"{args.steady_seconds:g} s, every round completes) ==")
    steady: dict[str, Any] = {}
    for engine in args.engines:
        s = steady[engine] = aggregator_steady(engine, args.steady_rate, args.steady_seconds, args.lanes, args.pool)
        print(f"{engine:>7}: {s['cpu_share']:6.2%} of a core ({s['cpu_us_per_packet']:.1f} us/packet; idle "
              f"{s['idle_cpu_share']:.2%}) at {s['offered_packets_per_s']:.0f} packets/s offered; "
              f"{s['completed']}/{s['rounds']} rounds completed, "
              f"{s['results_received']}/{s['packets']} RESULTs back", flush=True)
    if "native" in args.engines:
        f = steady["floor"] = aggregator_steady("native", args.steady_rate, args.steady_seconds, args.lanes,
                                                args.pool, admit=False)
        print(f"  floor: {f['cpu_share']:6.2%} of a core ({f['cpu_us_per_packet']:.1f} us/packet) for the same "
              f"packets of a job not admitted ({f['rejected']}/{f['packets']} rejected, nothing sent): waking up, "
              f"reading and parsing one packet at a time", flush=True)
    return steady


def section_memory(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    print(f"\n== 5. peak memory added by one allreduce of {args.memory_elements} float32 "
          f"({args.memory_elements * 4 / MIB:.0f} MiB), 2 workers, native path ==")
    memory: dict[str, Any] = {}
    if "native" in args.engines:
        for use_out in (True, False):
            m = memory["out" if use_out else "out=None"] = allreduce_memory(
                "native", args.memory_elements, args.lanes, args.pool, use_out)
            resets = all(w["hwm_reset"] for w in m["workers"])
            print(f"{'out=' if use_out else 'out=None':>8}: {m['added'] / MIB:7.1f} MiB peak over the RSS "
                  "with input and output allocated (worst worker; VmHWM "
                  f"{'reset' if resets else 'NOT reset: upper bound'}), "
                  f"call {m['seconds'] * 1e3:.0f} ms", flush=True)
    return memory


def section_loss(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    print(f"\n== 6. loss: {args.loss_workers} workers, {args.loss_elements} float32, pool {args.loss_pool}, "
          f"1 warm-up + {args.loss_iterations} timed, host-side loss each way at every worker ==")
    print(f"{'engine':>7} | {'loss':>5} | {'ms/call':>8} | {'vs no loss':>10} | {'target':>6} | {'retx':>6} | "
          f"{'exact':>5}")
    loss: dict[str, list[dict[str, Any]]] = {}
    for engine in args.engines:
        loss[engine] = []
        for p in sorted(args.loss):
            r = passing_allreduce(engine, args.loss_workers, args.loss_elements, args.lanes, args.loss_pool,
                                  args.loss_iterations, drop=p)
            base = loss[engine][0] if loss[engine] else r
            r["vs_no_loss"] = r["seconds"] / base["seconds"] if done(r) and done(base) else None
            loss[engine].append(r)
            ratio = f"{r['vs_no_loss']:.2f}x" if r["vs_no_loss"] else "n/a"
            goal = f"{TARGET_LOSS[p]:g}x" if p in TARGET_LOSS else "-"
            print(f"{engine:>7} | {p:5.0%} | {_ms(r):>8} | {ratio:>10} | {goal:>6} | "
                  f"{r.get('retransmissions', '-'):>6} | {'yes' if r['ok'] else 'NO':>5}"
                  + (f"  ({r['error']})" if "error" in r else ""), flush=True)
    return loss


def section_torch(args: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    print(f"\n== 7. torch all_reduce on backend \"passing\", no controller configured, vs gloo in the same processes "
          f"(1 warm-up + {args.torch_iterations} timed, alternating; medians). embedded off: the ring (gloo among "
          f"each local rank's peers); ps: rank 0's embedded controller and aggregator ==")
    print(f"{'servers x ranks':>15} | {'where':>10} | {'elements':>9} | {'embedded':>8} | {'mode':>7} | {'lanes':>5} | "
          f"{'passing ms':>10} | {'gloo ms':>8} | {'vs gloo':>7} | {'bit-identical':>13} | {'exact':>5} | "
          f"{'retx/packets':>12} | load")
    runs: list[tuple[int, int, int, int | None, str]] = []
    if args.one_server_elements:
        runs.append((1, 2, args.one_server_elements, None, "off"))
    for embedded in args.torch_embedded:
        runs += [(s, n, args.torch_elements, None, embedded) for s, n in args.torch_layouts]
        if os.geteuid() == 0:
            runs += [(s, n, args.torch_elements, mtu, embedded) for s, n, mtu in args.veths]
    if os.geteuid() != 0 and args.veths:
        print("  (the network-namespace rows need root: skipped)")
    rows: list[dict[str, Any]] = []
    for servers, ranks, elements, mtu, embedded in runs:
        t = torch_allreduce(servers, ranks, elements, args.torch_iterations, mtu, embedded)
        t["loadavg"] = os.getloadavg()[0]  # the machine's load over the last minute, next to the figure
        rows.append(t)
        where = f"veth {mtu}" if mtu else "loopback"
        head = f"{f'{servers} x {ranks}':>15} | {where:>10} | {elements:>9} | {embedded:>8}"
        if not t["ok"] and "error" in t:
            print(f"{head} | FAILED: {t['error']}", flush=True)
            continue
        print(f"{head} | {t['mode']:>7} | {t['lanes'] or '-':>5} | {t['passing_seconds'] * 1e3:10.1f} | "
              f"{t['gloo_seconds'] * 1e3:8.1f} | {t['vs_gloo']:6.2f}x | "
              f"{'yes' if t['identical_to_gloo'] else 'no':>13} | {'yes' if t['ok'] else 'NO':>5} | "
              f"{t['retransmissions']:>5}/{t['packets_sent']} | {t['loadavg']:.2f}", flush=True)
    return rows


def section_percore(args: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    print(f"\n== 8. the host stage per core: one worker (core {0}) and the native aggregator (core 1), "
          f"{args.percore_elements} float32 a call, 2 warm-up + {args.percore_iterations} timed; payload Gbit/s each "
          "way per second of the worker's own CPU (median, range), per wall second; the worker's user and system "
          "CPU, its waiting (wall - CPU) and its core's busy time, ms per call; packets per CPU second ==")
    print(f"{'where':>8} | {'lanes':>5} | {'asked':>5} | {'path':>4} | {'Gbit/s per core':>21} | {'wall':>6} | "
          f"{'user':>7} | {'system':>7} | {'waiting':>7} | {'core':>7} | {'Mpps':>5} | exact")
    rows = percore(args.percore_lanes, args.percore_elements, args.percore_iterations, args.pool, args.percore_veth,
                   args.percore_profile)
    if args.percore_profile and not perf_counts_instructions():
        lanes = args.percore_lanes[0]
        print(f"  perf cannot count instructions here: valgrind's callgrind of the native calls instead ({lanes} "
              "lanes, loopback, 1 M float32; the native library's functions alone): instructions per packet each way",
              flush=True)
        c = callgrind_counts(lanes, 1 << 20, args.pool)
        if "error" in c:
            print(f"  callgrind: {c['error']}")
        else:
            print(f"  {c['instructions_per_packet']:.0f} instructions per packet in the native library", flush=True)
            for share, name, per_packet in c["top"]:
                print(f"{'':>20}{share:5.1f}%  {per_packet:7.1f}/packet  {name}")
        rows.append({"where": "loopback", "callgrind": c})
    return rows


# number -> (key in the results, the function that runs and prints it)
SECTIONS: dict[int, tuple[str, Callable[[argparse.Namespace, dict[str, Any]], Any]]] = {
    1: ("raw", section_raw), 2: ("aggregator_alone", section_capacity), 3: ("allreduce", section_allreduce),
    4: ("steady", section_steady), 5: ("memory", section_memory), 6: ("loss", section_loss),
    7: ("torch", section_torch), 8: ("percore", section_percore),
}
EMPTY: dict[str, Any] = {"raw": {}, "aggregator_alone": {}, "allreduce": [], "steady": {}, "memory": {}, "loss": {},
                         "torch": [], "percore": []}


def _layout(text: str) -> tuple[int, int]:
    """'4x2' -> (4 servers, 2 ranks each)."""
    servers, _, ranks = text.partition("x")
    try:
        return int(servers), int(ranks)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a layout is SERVERSxRANKS, e.g. 4x2") from None


def _veth(text: str) -> tuple[int, int, int]:
    """'2x2@1500' -> (2 servers, 2 ranks each, MTU 1500)."""
    layout, _, mtu = text.partition("@")
    try:
        return (*_layout(layout), int(mtu))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a veth row is SERVERSxRANKS@MTU, e.g. 2x2@1500") from None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a short run (under a minute): 2 workers, 1 s blasts, 2 s at the steady rate, loss 0 and 5 %%")
    p.add_argument("--elements", type=int, default=2 * 1024 * 1024, help="float32 elements per allreduce")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--lanes", type=int, default=wire.DEFAULT_LANES)
    p.add_argument("--pool", type=int, default=512)
    p.add_argument("--iterations", type=int, default=3, help="timed allreduces per run (after one warm-up)")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--blast-seconds", type=float, default=3.0)
    p.add_argument("--wide-lanes", type=int, default=1024, help="lanes of the extra 2-worker row (0: none)")
    p.add_argument("--wide-pool", type=int, default=256)
    p.add_argument("--steady-rate", type=float, default=5000.0, help="packets/s of the steady-rate run")
    p.add_argument("--steady-seconds", type=float, default=5.0)
    p.add_argument("--memory-elements", type=int, default=25_000_000)
    p.add_argument("--loss-workers", type=int, default=4)
    p.add_argument("--loss-elements", type=int, default=200_000)
    p.add_argument("--loss-pool", type=int, default=256)
    p.add_argument("--loss-iterations", type=int, default=10)
    p.add_argument("--loss", type=float, nargs="+", default=[0.0, 0.01, 0.05, 0.20],
                   help="host-side loss each way at every worker (0 is the reference)")
    p.add_argument("--torch-layouts", type=_layout, nargs="*", default=[(2, 1), (4, 1), (8, 1), (2, 2), (4, 2)],
                   metavar="SxN", help="section 7: servers x ranks per server on loopback (none: skip those rows)")
    p.add_argument("--veths", type=_veth, nargs="*", default=[(2, 1, 1500), (2, 2, 1500), (4, 2, 1500), (2, 1, 9000)],
                   metavar="SxN@MTU", help="section 7: servers in network namespaces on veths of that MTU (root only)")
    p.add_argument("--torch-embedded", nargs="+", choices=("off", "ps"), default=["off", "ps"],
                   help="section 7: the PASSING_EMBEDDED values to run the rows with (off: the ring; ps: rank 0's PS)")
    p.add_argument("--torch-elements", type=int, default=2 * 1024 * 1024)
    p.add_argument("--one-server-elements", type=int, default=1_000_000,
                   help="section 7: float32 elements of the one-server row (0: skip it)")
    p.add_argument("--torch-iterations", type=int, default=20,
                   help="section 7: timed calls of each (after one warm-up); the median is reported")
    p.add_argument("--percore-lanes", type=int, nargs="+", default=[64, 72, 144, 364],
                   help="section 8: lane counts (Tofino 1 and 2, the Tofino 2 program without the tree roles, a "
                        "packet of 2 x 72 lanes, the PS's at MTU 1500)")
    p.add_argument("--percore-elements", type=int, default=16 * 1024 * 1024, help="section 8: float32 per call")
    p.add_argument("--percore-iterations", type=int, default=5, help="section 8: timed calls per row")
    p.add_argument("--percore-veth", action=argparse.BooleanOptionalAction, default=True,
                   help="section 8: the rows on a veth pair between network namespaces too (root)")
    p.add_argument("--percore-profile", action=argparse.BooleanOptionalAction, default=True,
                   help="section 8: perf's top symbols of the worker, first lane count of each row set")
    p.add_argument("--sections", type=int, nargs="+", choices=sorted(SECTIONS), default=sorted(SECTIONS),
                   help="run only these sections (the targets of the others are not judged)")
    p.add_argument("--out", type=Path, default=RESULTS / "core.json")
    args = p.parse_args()
    if args.quick:
        args.workers, args.blast_seconds, args.steady_seconds, args.loss = [2], 1.0, 2.0, [0.0, 0.05]
        args.torch_layouts, args.veths = [(2, 1), (2, 2)], []
        args.percore_elements, args.percore_iterations, args.percore_lanes = 4 * 1024 * 1024, 3, [64]
    if 0.0 not in args.loss:
        args.loss = [0.0, *args.loss]
    return args


def main() -> int:
    args = parse_args()
    machine = {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
               "numpy": np.__version__, "loadavg_at_start": os.getloadavg()}
    print(f"machine: {machine['cores']} cores, {machine['platform']}, python {machine['python']}, "
          f"load average at start {machine['loadavg_at_start'][0]:.2f}")
    print(f"buffer: {args.elements} float32 ({args.elements * 4 / MIB:.1f} MiB), "
          f"{args.lanes} lanes/packet ({wire.packet_size(args.lanes)} B), pool {args.pool}", flush=True)
    started = time.perf_counter()
    results = dict(EMPTY)
    for number in sorted(args.sections):
        key, run = SECTIONS[number]
        results[key] = run(args, results)

    print("\n== targets ==")
    targets = Targets()
    judge_host_targets(args, results, targets)
    judge_torch_targets(results, targets)

    elapsed = time.perf_counter() - started
    machine["loadavg_at_end"] = os.getloadavg()
    print(f"\nran {elapsed:.0f} s; load average at end {machine['loadavg_at_end'][0]:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = vars(args) | {"out": str(args.out)}
    args.out.write_text(json.dumps({"config": config, "machine": machine, "seconds": elapsed, **results,
                                    "targets": targets.judged}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cluster.local import ensure_keys

    ensure_keys()
    if len(sys.argv) > 1 and sys.argv[1] == "--blast-receiver":
        blast_receiver(int(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4])), idle=1.0)
    elif len(sys.argv) > 1 and sys.argv[1] == "--gloo-worker":
        gloo_worker(*map(int, sys.argv[2:7]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--torch-worker":
        torch_worker(int(sys.argv[2]), int(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--percore-worker":
        percore_worker(json.loads(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--memory-worker":
        w, n, agg, bind, gen, pool, lanes, elements, engine, use_out = sys.argv[2:12]
        memory_worker(int(w), int(n), agg, bind, int(gen), int(pool), int(lanes), int(elements), engine,
                      bool(int(use_out)))
    else:
        sys.exit(main())
