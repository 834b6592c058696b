"""bench/emulated.py's report: the markdown tables (measured against the model, per scheme, configuration and
link) and the plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cost_model
from emulated_cluster import BMV2_NOTE, DEFAULT_SWITCH_KIND, PS_LABEL, SWITCH_LABEL, aggregator_of, switch_kind_label
from emulated_run import BATCH_PER_GPU, COMPUTE_S, MODELS, SCALING_SERVERS

from passing_controller.topology import CHIP_LANES

RESULTS = Path(__file__).resolve().parent / "results"


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
