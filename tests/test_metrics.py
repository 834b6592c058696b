"""Prometheus metrics of passing-controller and passing-aggregator: real processes, a known run
of two workers through the controller, scraped over HTTP and parsed with prometheus_client's
own text parser; and clear errors for a bad --metrics address or a port in use."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.local import BIN, free_tcp_port
from passing import Group
from passing.control import join, leave, report
from passing.launch import free_udp_ports
from tests.cluster import run_threads, start_aggregator, start_controller

LANES = 64
PACKETS, CALLS, WORKERS = 10, 3, 2  # int32 arrays of 10 packets: exact sums, no scaling round


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from GET /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def known_run(tmp_path_factory):
    """Two workers, CALLS allreduces of PACKETS packets through the controller; both endpoints scraped
    while the group runs and after the workers left with their final reports."""
    agg_proc, agg = start_aggregator(["--metrics", "127.0.0.1:0", "--max-lanes", str(LANES)])  # PACKETS of 64 lanes
    ctl_proc, ctl = start_controller({"ps": [{"data": agg["data"], "control": agg["control"]}]},
                                     tmp_path_factory.mktemp("ctl"), f"tcp://127.0.0.1:{free_tcp_port()}",
                                     ["--metrics", "127.0.0.1:0"])
    try:
        endpoint = ctl["endpoint"]
        ports = free_udp_ports(WORKERS)
        data = [np.arange(PACKETS * LANES, dtype=np.int32) * (w + 1) for w in range(WORKERS)]
        groups: dict[int, Group] = {}
        tokens: dict[int, str] = {}

        def work(w: int) -> dict:
            answer = join(endpoint, "known", w, WORKERS, host="127.0.0.1", udp_port=ports[w], pool=4, timeout=30)
            g = groups[w] = Group.from_answer(answer, bind=("127.0.0.1", ports[w]), timeout=10)
            for _ in range(CALLS):
                assert np.array_equal(g.allreduce(data[w]), data[0] * 3)
            stats = {**g.stats.as_dict(), "calls": CALLS, "call_seconds": 0.25 * (w + 1)}
            report(endpoint, "known", 0, w, answer["token"], stats)
            tokens[w] = answer["token"]
            return stats

        sent = run_threads(work, WORKERS)
        assert all(isinstance(s, dict) for s in sent), sent
        out = {"agg": agg, "sent": sent, "ctl": scrape(ctl["metrics"]), "aggregator": scrape(agg["metrics"])}
        for w, g in groups.items():
            g.close()
            leave(endpoint, "known", 0, w, tokens[w], stats={**sent[w], "calls": CALLS + 1})
        out.update(ctl_after=scrape(ctl["metrics"]), aggregator_after=scrape(agg["metrics"]))
        return out
    finally:
        for p in (ctl_proc, agg_proc):
            p.terminate()
            p.wait(10)


GROUP = (("group", "0"), ("job", "known"), ("mode", "ps"))


@pytest.mark.timeout(120)
def test_a_known_run_shows_in_both_endpoints(known_run):
    sent, control = known_run["sent"], known_run["agg"]["control"]
    retransmitted = sum(s["retransmissions"] for s in sent)
    assert sum(s["packets_sent"] for s in sent) == WORKERS * PACKETS * CALLS + retransmitted
    m = known_run["ctl"]
    assert m[("passing_group_running", GROUP)] == 1
    assert m[("passing_groups", (("mode", "ps"),))] == 1 and m[("passing_jobs", (("mode", "ps"),))] == 1
    assert m[("passing_group_pool_slots", GROUP)] == 4
    assert m[("passing_slots_used", (("aggregator", control), ("kind", "ps")))] == 4
    assert m[("passing_aggregator_up", (("aggregator", control), ("kind", "ps")))] == 1
    # the aggregator's counters of the group, through the controller: every packet a worker sent
    assert m[("passing_group_received_packets_total", GROUP)] == sum(s["packets_sent"] for s in sent)
    assert m[("passing_group_aggregated_packets_total", GROUP)] == WORKERS * PACKETS * CALLS
    assert m[("passing_group_completed_rounds_total", GROUP)] == PACKETS * CALLS
    assert m[("passing_group_rejected_packets_total", GROUP)] == 0
    assert m[("passing_group_relayed_packets_total", GROUP)] == 0  # allreduce sends no GATHER or NACK
    # what the workers reported
    for w, s in enumerate(sent):
        host = (("group", "0"), ("job", "known"), ("worker", str(w)))
        assert m[("passing_host_sent_packets_total", host)] == s["packets_sent"]
        assert m[("passing_host_retransmitted_packets_total", host)] == s["retransmissions"]
        assert m[("passing_host_allreduce_seconds_count", host)] == CALLS
        assert m[("passing_host_allreduce_seconds_sum", host)] == 0.25 * (w + 1)

    a = known_run["aggregator"]  # the aggregator's own endpoint
    assert a[("passing_aggregator_received_packets_total", ())] == sum(s["packets_sent"] for s in sent)
    assert a[("passing_aggregator_completed_rounds_total", ())] == PACKETS * CALLS
    assert a[("passing_aggregator_udp_received_packets_total", ())] == sum(s["packets_sent"] for s in sent)
    assert a[("passing_aggregator_udp_sent_packets_total", ())] == sum(s["packets_received"] for s in sent)
    assert a[("passing_aggregator_jobs", ())] == 1 and a[("passing_aggregator_slots_used", ())] == 4
    job = next(labels for name, labels in a if name == "passing_aggregator_job_completed_rounds_total")
    assert a[("passing_aggregator_job_completed_rounds_total", job)] == PACKETS * CALLS
    cpu = {dict(labels)["thread"]: v for (name, labels), v in a.items()
           if name == "passing_aggregator_cpu_seconds_total"}
    assert set(cpu) == {"data", "control"} and cpu["data"] > 0
    assert sum(cpu.values()) <= a[("process_cpu_seconds_total", ())] + 0.05

    # after the workers left with their final reports: the group is over, still shown with its counters
    m = known_run["ctl_after"]
    assert m[("passing_group_running", GROUP)] == 0
    assert m[("passing_groups", (("mode", "ps"),))] == 0
    assert m[("passing_groups_admitted_total", (("mode", "ps"),))] == 1
    assert m[("passing_group_completed_rounds_total", GROUP)] == PACKETS * CALLS
    assert m[("passing_host_allreduce_seconds_count", (("group", "0"), ("job", "known"), ("worker", "1")))] == \
        CALLS + 1
    assert m[("passing_slots_used", (("aggregator", control), ("kind", "ps")))] == 0
    assert known_run["aggregator_after"][("passing_aggregator_jobs", ())] == 0


def test_dashboard_is_json_and_names_only_metrics_that_exist(known_run):
    """docs/grafana-dashboard.json: valid JSON whose queries name only metrics the endpoints served."""
    dashboard = json.loads((Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 8
    served = {name for scrape_ in (known_run["ctl"], known_run["aggregator"]) for name, _ in scrape_}
    used = {n for e in exprs for n in re.findall(r"\b((?:passing|process)_[a-z_]+)\b", e)}
    assert used and used <= served, sorted(used - served)


def test_bad_metrics_address_and_port_in_use_are_clear_errors(tmp_path):
    (tmp_path / "topo.json").write_text('{"ps": [{"data": "127.0.0.1:9877", "control": "tcp://127.0.0.1:9878"}]}')
    controller = [str(BIN / "passing-controller"), "--topology", str(tmp_path / "topo.json"), "--store",
                  str(tmp_path / "s.sqlite"), "--listen", "tcp://127.0.0.1:*"]
    aggregator = [sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen", "127.0.0.1:0", "--control",
                  "none"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = f"127.0.0.1:{busy.getsockname()[1]}"
        for argv in (controller, aggregator):
            bad = subprocess.run([*argv, "--metrics", "9100"], capture_output=True, text=True, timeout=60)
            assert bad.returncode == 2 and "--metrics wants ADDR:PORT" in bad.stderr, bad.stderr
            used = subprocess.run([*argv, "--metrics", taken], capture_output=True, text=True, timeout=60)
            assert used.returncode == 2, used.stderr
            assert f"cannot serve metrics on {taken}" in used.stderr and "in use" in used.stderr, used.stderr


def test_a_report_for_a_group_that_is_not_running_is_refused(tmp_path):
    from passing.control import ControllerError
    from passing_controller.topology import Topology
    from tests.keys import ask, controller

    topo = Topology.from_dict({"ps": [{"data": "127.0.0.1:9", "control": f"tcp://127.0.0.1:{free_tcp_port()}"}]})
    ctl = controller(topo, tmp_path / "s.sqlite")
    thread = threading.Thread(target=ctl.serve)
    thread.start()
    try:
        with pytest.raises(ControllerError, match="job 'nobody' group 0 is not running"):
            report(ctl.endpoint, "nobody", 0, 0, "00" * 16, {"calls": 1})
        answer = ask(ctl.endpoint, "metrics")
        assert answer["groups"] == [] and answer["pending"] == 0 and answer["joins_failed"] == 0
    finally:
        ctl.stop()
        thread.join(10)
