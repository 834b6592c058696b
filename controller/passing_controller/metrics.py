"""Prometheus metrics of the controller: `passing-controller --metrics ADDR:PORT` (docs/control.md).

Each scrape asks the service for its `metrics` answer over the controller's in-process
endpoint, so the service thread stays the only one that touches its state (SQLite, the
P4Runtime session). The HTTP server is the protocol's (``passing_protocol.metrics``), shared
with the software aggregator.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

PORT = 9100  # the controller's usual metrics port (an aggregator's is 9101), as --metrics errors show it

# The aggregation state machine's counters (docs/protocol.md) and what each one counts.
COUNTER_UNITS = {"received": "packets", "rejected": "packets", "aggregated": "packets", "completed": "rounds",
                 "duplicate": "packets", "duplicate_answered": "packets", "stale": "packets", "overflow": "packets",
                 "relayed": "packets", "results_sent": "packets", "malformed": "packets",
                 # a tree's (docs/protocol.md, "Trees across racks"): a leaf's packets up, its root's answers
                 "sent_up": "packets", "answered": "packets", "late_answer": "packets"}
# What a worker reports (docs/control.md, report): field -> (metric, help)
HOST_COUNTERS = {
    "packets_sent": ("passing_host_sent_packets", "DATA packets the worker sent, retransmissions included"),
    "packets_received": ("passing_host_received_packets", "RESULT packets the worker received"),
    "bytes_sent": ("passing_host_sent_bytes", "bytes of the DATA packets the worker sent"),
    "bytes_received": ("passing_host_received_bytes", "bytes of the RESULT packets the worker received"),
    "retransmissions": ("passing_host_retransmitted_packets", "DATA packets the worker sent again"),
    "early_retransmissions": ("passing_host_early_retransmitted_packets",
                              "of them, resent before their timer (later packets were answered)"),
}
GROUP_LABELS = ("job", "group", "mode")


def counter_name(prefix: str, counter: str) -> str:
    """e.g. passing_group_received_packets (exposed with _total)."""
    return f"{prefix}_{counter}_{COUNTER_UNITS[counter]}"


def controller_metrics(snapshot: dict[str, Any]) -> Iterator[Metric]:
    """The metric families of one `metrics` answer."""
    up = GaugeMetricFamily("passing_aggregator_up", "1 while the aggregator (the switch or a PS) is usable, "
                           "0 while it is marked down", labels=("aggregator", "kind"))
    used = GaugeMetricFamily("passing_slots_used", "slots allocated to running groups", labels=("aggregator", "kind"))
    free = GaugeMetricFamily("passing_slots_free", "slots free for new groups", labels=("aggregator", "kind"))
    for a in snapshot["aggregators"]:
        labels = (a["aggregator"], a["kind"])
        up.add_metric(labels, 1.0 if a["state"] == "up" else 0.0)
        used.add_metric(labels, a["slots"] - a["free_slots"])
        free.add_metric(labels, a["free_slots"])
    yield from (up, used, free)

    running = [g for g in snapshot["groups"] if g["running"]]
    groups = GaugeMetricFamily("passing_groups", "job groups running, by mode", labels=("mode",))
    jobs = GaugeMetricFamily("passing_jobs", "jobs with a group running in this mode", labels=("mode",))
    admitted = CounterMetricFamily("passing_groups_admitted", "job groups allocated since the controller started",
                                   labels=("mode",))
    for mode in ("switch", "ps", "tree"):
        groups.add_metric((mode,), sum(g["mode"] == mode for g in running))
        jobs.add_metric((mode,), len({g["job"] for g in running if g["mode"] == mode}))
        admitted.add_metric((mode,), snapshot["admitted"][mode])
    yield from (groups, jobs, admitted)
    yield GaugeMetricFamily("passing_groups_pending", "job groups waiting for workers to join",
                            value=snapshot["pending"])
    yield CounterMetricFamily("passing_joins_failed", "job groups no aggregator could take since the controller "
                              "started", value=snapshot["joins_failed"])
    for name, value in snapshot.get("switch_totals", {}).items():
        yield CounterMetricFamily(counter_name("passing_switch", name), f"the switch's '{name}' counter, all jobs",
                                  value=value)

    info = GaugeMetricFamily("passing_group_info", "a job group (1) and where it runs",
                             labels=(*GROUP_LABELS, "job_id", "generation", "aggregator"))
    alive = GaugeMetricFamily("passing_group_running", "1 while the group runs; 0 for a while after it ended",
                              labels=GROUP_LABELS)
    pool = GaugeMetricFamily("passing_group_pool_slots", "slots of the group at its aggregator", labels=GROUP_LABELS)
    per_group = {c: CounterMetricFamily(counter_name("passing_group", c), f"the aggregator's '{c}' counter of the "
                                        "group (docs/protocol.md)", labels=GROUP_LABELS)
                 for c in COUNTER_UNITS if c != "malformed"}
    node_labels = (*GROUP_LABELS, "node", "role")
    per_node = {c: CounterMetricFamily(counter_name("passing_group_node", c), f"the '{c}' counter of the group at "
                                       "one node of its tree (a leaf or the root)", labels=node_labels)
                for c in COUNTER_UNITS if c != "malformed"}
    host_labels = ("job", "group", "worker")
    per_host = {k: CounterMetricFamily(name, text, labels=host_labels) for k, (name, text) in HOST_COUNTERS.items()}
    calls = SummaryMetricFamily("passing_host_allreduce_seconds", "the worker's allreduce calls and their time",
                                labels=host_labels)
    for g in snapshot["groups"]:
        labels = (g["job"], str(g["group"]), g["mode"])
        info.add_metric((*labels, str(g["job_id"]), str(g["generation"]), g["aggregator"]), 1.0)
        alive.add_metric(labels, 1.0 if g["running"] else 0.0)
        pool.add_metric(labels, g["pool"])
        for c, value in g["counters"].items():
            if c in per_group:
                per_group[c].add_metric(labels, value)
        for node in g.get("nodes", []):  # a tree's: each leaf's and the root's (a node not answering: none)
            for c, value in node.get("counters", {}).items():
                if c in per_node:
                    per_node[c].add_metric((*labels, node["name"], node["role"]), value)
        for worker, stats in g["hosts"].items():
            hl = (g["job"], str(g["group"]), worker)
            for k, family in per_host.items():
                if k in stats:
                    family.add_metric(hl, stats[k])
            if "calls" in stats:
                calls.add_metric(hl, count_value=stats["calls"], sum_value=stats.get("call_seconds", 0.0))
    yield from (info, alive, pool, *per_group.values(), *per_node.values(), *per_host.values(), calls)
