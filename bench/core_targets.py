"""bench/core.py's targets: the figures each section is held to, judged and printed next to them."""

from __future__ import annotations

import argparse
from typing import Any

from core_host import done

MIB = 1 << 20

# The targets, printed next to the figures.
TARGET_CAPACITY_VS_RAW = 0.50  # native aggregator alone: packets per busy core / raw GSO blast rate
TARGET_SPEEDUP = 5.0  # native over numpy, 8 MiB, 2 workers
TARGET_VS_GLOO = 5.0  # native ms / gloo ms
TARGET_STEADY_CPU = 0.05  # native aggregator's CPU share at 5 kpps
TARGET_MEMORY = 64 * MIB  # peak added by a 25M-float allreduce with out=
TARGET_LOSS = {0.01: 1.5, 0.05: 2.5, 0.20: 10.0}  # time / loss-free time
TARGET_ONE_SERVER_VS_GLOO = 1.2  # backend "passing" on one server / gloo, same processes
TARGET_RING_VS_GLOO = 1.05  # nothing configured, one rank per server (gloo's own all_reduce) / gloo
TARGET_HIERARCHY_VS_GLOO = 1.0  # nothing configured, several ranks per server (in-host + peers) / gloo
TARGET_RETRANSMISSIONS = 1e-4  # loss-free runs: retransmissions per packet sent


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


class Targets:
    """The targets judged so far, each printed as it is judged."""

    def __init__(self) -> None:
        self.judged: list[dict[str, Any]] = []

    def judge(self, what: str, value: float | None, goal: float, higher_is_better: bool, text: str) -> None:
        met = value is not None and (value >= goal if higher_is_better else value <= goal)
        self.judged.append({"what": what, "value": value, "target": goal, "met": met})
        print(f"  {what}: {text} -> {_verdict(met)}")


def judge_host_targets(args: argparse.Namespace, results: dict[str, Any], targets: Targets) -> None:
    """Sections 1-6: the aggregator, the host engine, memory and loss."""
    engines, raw, steady = args.engines, results["raw"], results["steady"]
    if "native" in engines:
        for n, c in results["aggregator_alone"].get("native", {}).items() if raw else []:
            targets.judge(f"native aggregator alone, {n} workers, capacity vs raw GSO", c["vs_raw_gso"],
                          TARGET_CAPACITY_VS_RAW, True,
                          f"{c['vs_raw_gso']:.0%} (target >= {TARGET_CAPACITY_VS_RAW:.0%})")
        for row in results["allreduce"]:
            if row["speedup"] and row["workers"] == 2 and row["lanes"] == args.lanes:
                targets.judge("native speed-up over numpy, 8 MiB, 2 workers", row["speedup"], TARGET_SPEEDUP, True,
                              f"{row['speedup']:.1f}x (target >= {TARGET_SPEEDUP:g}x)")
        for row in results["allreduce"]:
            if row["native_vs_gloo"]:
                targets.judge(f"native/gloo, {row['workers']} workers, {row['lanes']} lanes", row["native_vs_gloo"],
                              TARGET_VS_GLOO, False, f"{row['native_vs_gloo']:.1f}x (target <= {TARGET_VS_GLOO:g}x)")
        s = steady.get("native")
        if s:
            targets.judge(f"native aggregator CPU at {args.steady_rate:.0f} pps", s["cpu_share"], TARGET_STEADY_CPU,
                          False, f"{s['cpu_share']:.2%} of a core (target <= {TARGET_STEADY_CPU:.0%}; the receive-only "
                          f"floor on this machine: {steady['floor']['cpu_share']:.2%})")
        m = results["memory"].get("out")
        if m:
            targets.judge(f"peak memory added, {args.memory_elements} floats, out=", m["added"] / MIB,
                          TARGET_MEMORY / MIB, False,
                          f"{m['added'] / MIB:.1f} MiB (target <= {TARGET_MEMORY / MIB:.0f} MiB)")
    for engine in engines:
        for r in results["loss"].get(engine, []):
            goal = TARGET_LOSS.get(r["drop"])
            if goal is not None:
                value = r["vs_no_loss"] if r["ok"] else None
                targets.judge(f"{engine} under {r['drop']:.0%} loss vs no loss (exact)", value, goal, False,
                              f"{value:.2f}x (target <= {goal:g}x)" if value else "failed or inexact")
    for row in results["allreduce"]:  # loss-free runs: spurious retransmissions
        for engine in engines:
            r = row.get(engine)
            if done(r) and r.get("packets_sent"):
                rate = r["retransmissions"] / r["packets_sent"]
                targets.judge(f"{engine} retransmissions per packet, {row['workers']} workers, {row['lanes']} lanes, "
                              "no loss", rate, TARGET_RETRANSMISSIONS, False, f"{r['retransmissions']} of "
                              f"{r['packets_sent']} (target <= 1 per {1 / TARGET_RETRANSMISSIONS:.0f})")


def judge_torch_targets(results: dict[str, Any], targets: Targets) -> None:
    """Section 7: the one-server row and the ring's rows against gloo; every row exact; the embedded
    PS's rows are figures for the record, with no time target."""
    for t in results["torch"]:
        mode = f"embedded {t['embedded']}" if t["servers"] > 1 else "one server"
        name = f"torch {t['servers']} x {t['ranks']} ({mode})"
        if "error" in t:
            targets.judge(name, None, 0, False, f"failed: {t['error']}")
            continue
        where = f"veths of MTU {t['mtu']}" if t["mtu"] else "loopback"
        if t["servers"] == 1:
            targets.judge(f"{name}: bit-identical to gloo", float(t["identical_to_gloo"]), 1.0, True,
                          "yes" if t["identical_to_gloo"] else "no")
            goal: float | None = TARGET_ONE_SERVER_VS_GLOO
        elif t["embedded"] == "off":
            goal = TARGET_RING_VS_GLOO if t["ranks"] == 1 else TARGET_HIERARCHY_VS_GLOO
            if t["ranks"] == 1:
                targets.judge(f"{name} on {where}: bit-identical to gloo", float(t["identical_to_gloo"]), 1.0, True,
                              "yes" if t["identical_to_gloo"] else "no")
        else:
            goal = None
        if goal is not None:
            targets.judge(f"{name} on {where} vs gloo (exact)", t["vs_gloo"] if t["ok"] else None, goal, False,
                          f"{t['vs_gloo']:.2f}x at load {t['loadavg']:.2f} (target <= {goal:g}x)"
                          + ("" if t["ok"] else ", NOT exact"))
        else:
            targets.judge(f"{name} on {where}: exact", float(t["ok"]), 1.0, True,
                          f"{'yes' if t['ok'] else 'NO'} ({t['vs_gloo']:.2f}x gloo at load {t['loadavg']:.2f}, "
                          "for the record)")
        if t["packets_sent"]:
            targets.judge(f"{name} on {where}: retransmissions per packet", t["retransmissions"] / t["packets_sent"],
                          TARGET_RETRANSMISSIONS, False, f"{t['retransmissions']} of {t['packets_sent']}")
