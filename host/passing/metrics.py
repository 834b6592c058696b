"""Prometheus metrics of the software aggregator: `passing-aggregator serve --metrics ADDR:PORT`.

A scrape reads the aggregator's counters (``SoftwareAggregator.metrics``) from the HTTP
server's thread. Packet rates are the counters' rates in Prometheus
(``rate(passing_aggregator_udp_received_packets_total[1m])``). The HTTP server is the
protocol's (``passing_protocol.metrics``), shared with the controller.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .aggregator.engine import COUNTERS

PORT = 9101  # the aggregator's usual metrics port (the controller's is 9100), as --metrics errors show it

# What each counter of the state machine (docs/protocol.md) counts.
UNITS = {name: "rounds" if name == "completed" else "packets" for name in COUNTERS}
TRANSPORT = {"packets_received": ("passing_aggregator_udp_received_packets", "UDP datagrams received"),
             "packets_sent": ("passing_aggregator_udp_sent_packets", "UDP datagrams sent (RESULTs)"),
             "bytes_received": ("passing_aggregator_udp_received_bytes", "bytes of the datagrams received"),
             "bytes_sent": ("passing_aggregator_udp_sent_bytes", "bytes of the datagrams sent"),
             "gso_fallbacks": ("passing_aggregator_gso_fallbacks", "GSO messages the kernel refused, resent as "
                               "plain datagrams")}


def aggregator_metrics(snapshot: dict[str, Any]) -> Iterator[Metric]:
    """The metric families of one ``SoftwareAggregator.metrics()`` answer."""
    for name, value in snapshot["totals"].items():
        yield CounterMetricFamily(f"passing_aggregator_{name}_{UNITS[name]}", f"the '{name}' counter of the "
                                  "aggregation engine, all jobs (docs/protocol.md)", value=value)
    generations = {str(j["job"]): str(j["generation"]) for j in snapshot["admitted"]}
    per_job = {name: CounterMetricFamily(f"passing_aggregator_job_{name}_{UNITS[name]}", f"the '{name}' counter "
                                         "of one admitted job", labels=("job", "generation"))
               for name in COUNTERS if name != "malformed"}
    for job, counters in snapshot["jobs"].items():
        for name, value in counters.items():
            if name in per_job:
                per_job[name].add_metric((job, generations.get(job, "")), value)
    yield from per_job.values()
    used = sum(j["pool"] for j in snapshot["admitted"])
    yield GaugeMetricFamily("passing_aggregator_jobs", "jobs admitted", value=len(snapshot["admitted"]))
    yield GaugeMetricFamily("passing_aggregator_slots_used", "slots of admitted jobs", value=used)
    yield GaugeMetricFamily("passing_aggregator_slots_free", "slots free for new jobs", value=snapshot["slots"] - used)
    for key, (name, text) in TRANSPORT.items():
        yield CounterMetricFamily(name, text, value=snapshot["transport"][key])
    if "server" in snapshot:
        yield CounterMetricFamily("passing_aggregator_send_errors", "sends the kernel refused",
                                  value=snapshot["server"]["send_errors"])
        yield CounterMetricFamily("passing_aggregator_batches", "receive batches the data path processed",
                                  value=snapshot["server"]["batches"])
    cpu = CounterMetricFamily("passing_aggregator_cpu_seconds", "CPU time of the aggregator's threads: 'data' "
                              "runs the data path, 'control' answers the control channel", labels=("thread",))
    for thread, seconds in snapshot["cpu_seconds"].items():
        cpu.add_metric((thread,), seconds)
    yield cpu
