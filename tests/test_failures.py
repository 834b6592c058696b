"""Dead peers, dead aggregators and bad input: clear errors and counted drops, never hangs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from passing import Group, wire
from passing.aggregator.control_channel import ControlClient
from passing.aggregator.engine import ConfigError
from passing.errors import AggregatorUnreachable, PassingError
from passing.launch import free_udp_ports
from tests.cluster import LocalCluster, start_aggregator


@pytest.mark.timeout(120)
def test_worker_dying_mid_allreduce_gives_the_others_a_clear_error(tmp_path):
    c = LocalCluster(tmp_path, workers=3, pool=64)
    try:
        c.admit()
        timeout = 3.0
        procs = [c.start_worker(w, 2_000_000, extra=["--timeout", str(timeout)]) for w in range(3)]
        # kill worker 2 once the stream is under way (the aggregator has aggregated something)
        deadline = time.monotonic() + 30
        while c.stats()["totals"]["aggregated"] < 1000:
            assert time.monotonic() < deadline, "the allreduce never started"
            time.sleep(0.01)
        procs[2].kill()
        killed_at = time.monotonic()
        for p in procs[:2]:
            _, err = p.communicate(timeout=timeout + 30)
            assert p.returncode == 1
            assert "no RESULT for psn" in err and "peer worker stopped" in err
        assert time.monotonic() - killed_at < timeout + 10
    finally:
        procs[2].wait()
        c.close()


@pytest.mark.timeout(60)
def test_unreachable_aggregator_raises_within_timeout():
    (port,) = free_udp_ports(1)  # nothing listens there
    with Group(1, 0, 1, [f"127.0.0.1:{port}"], bind="127.0.0.1:0", timeout=1.0) as g:
        start = time.monotonic()
        with pytest.raises(AggregatorUnreachable, match="no RESULT"):
            g.allreduce(np.ones(100, np.float32))
        assert time.monotonic() - start < 5
        with pytest.raises(PassingError, match="unusable after an earlier error"):
            g.allreduce(np.ones(100, np.float32))


def test_group_rejects_bad_arguments():
    with pytest.raises(ValueError, match="worker"):
        Group(1, 2, 2, ["127.0.0.1:9"])
    with pytest.raises(ValueError, match="workers"):
        Group(1, 0, 33, ["127.0.0.1:9"])
    with pytest.raises(ValueError, match="scale"):
        Group(1, 0, 1, ["127.0.0.1:9"], scale="big")
    with pytest.raises(ValueError, match="aggregator"):
        Group(1, 0, 1, [])
    with pytest.raises(ValueError, match="endpoint"):
        Group(1, 0, 1, ["127.0.0.1:notaport"])
    with Group(1, 0, 1, ["127.0.0.1:9"]) as g:
        with pytest.raises(TypeError, match="float32 or int32"):
            g.allreduce(np.ones(4, np.float64))
        with pytest.raises(TypeError, match="avg"):
            g.allreduce(np.ones(4, np.int32), op="avg")
        with pytest.raises(ValueError, match="op"):
            g.allreduce(np.ones(4, np.float32), op="prod")
        assert g.allreduce(np.ones(0, np.float32)).size == 0  # nothing to send, nothing sent
        assert g.stats.packets_sent == 0


def garbage(lanes: int, job: int) -> list[bytes]:
    """One of each kind of bad datagram."""
    good = wire.encode(type=wire.DATA, job=job, worker=0, psn=0, pool=4, payload=np.ones(lanes, np.int64),
                       lanes=lanes).tobytes()
    wrong_version = bytearray(good)
    wrong_version[0] = 99
    rng = np.random.default_rng(1)
    return [
        good[:10],  # truncated header
        good[:-4],  # truncated payload
        bytes(wrong_version),
        rng.integers(0, 256, wire.packet_size(lanes), dtype=np.uint8).tobytes(),  # random bytes
        b"\x01" * 20000,  # oversized datagram
        b"",  # empty datagram
    ]


@pytest.mark.timeout(120)
def test_bad_input_is_counted_and_the_service_keeps_serving(tmp_path):
    c = LocalCluster(tmp_path, workers=2, pool=64)
    try:
        c.admit()
        data = c.aggregators[0][1]["data"].rsplit(":", 1)
        target = (data[0], int(data[1]))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            bad = garbage(64, c.job)
            for _ in range(50):
                for d in bad:
                    s.sendto(d, target)
            # well-formed but not admitted: wrong job, out-of-range slot, a stranger posing as worker 0
            for job, slot in ((77, 0), (c.job, 64), (c.job, 0)):
                pkt = wire.encode(type=wire.DATA, job=job, worker=0, psn=0, slot=slot, set=0,
                                  payload=np.full(64, 10**6), lanes=64)
                for _ in range(50):
                    s.sendto(pkt.tobytes(), target)
        # the workers run while more garbage would arrive; their results must still be right
        results = c.results(20_000)
        inputs = c.inputs(20_000)
        expected = np.sum(inputs, axis=0, dtype=np.float64)
        for r in results:
            assert np.max(np.abs(r - expected)) < 1e-3
        totals = c.stats()["totals"]
        # random bytes might parse as a well-formed DATA packet of some job: then they are rejected
        assert totals["malformed"] + totals["rejected"] >= 50 * len(bad) + 150
        assert totals["malformed"] >= 50 * (len(bad) - 1)
        assert totals["rejected"] >= 150
        assert c.aggregators[0][0].poll() is None, "the aggregator died"
    finally:
        c.close()


def test_control_channel_rejects_bad_requests():
    proc, ready = start_aggregator()
    try:
        client = ControlClient(ready["control"])
        with pytest.raises(ConfigError, match="unknown command"):
            client.request("explode")
        with pytest.raises(ConfigError, match="lacks"):
            client.request("add_job", job={"job": 1})
        with pytest.raises(ConfigError, match="outside"):
            client.request("add_job", job={"job": 1, "base": 4090, "pool": 100, "workers": ["127.0.0.1:1"]})
        client.request("add_job", job={"job": 1, "base": 0, "pool": 100, "workers": ["127.0.0.1:1"]})
        with pytest.raises(ConfigError, match="overlaps"):
            client.request("add_job", job={"job": 2, "base": 50, "pool": 100, "workers": ["127.0.0.1:2"]})
        with pytest.raises(ConfigError, match="already"):
            client.request("add_job", job={"job": 1, "base": 200, "pool": 1, "workers": ["127.0.0.1:1"]})
        with pytest.raises(ConfigError, match="not admitted"):
            client.request("remove_job", job=5)
        sock = zmq.Context.instance().socket(zmq.REQ)
        client.keys.apply(sock)
        sock.connect(ready["control"])
        sock.send(b"\xff not json")
        assert sock.poll(5000)
        assert json.loads(sock.recv())["ok"] is False
        sock.send(json.dumps({"version": 99, "cmd": "stats"}).encode())
        assert sock.poll(5000)
        assert "version" in json.loads(sock.recv())["error"]
        sock.close()
        assert client.request("jobs")["jobs"][0]["job"] == 1
    finally:
        proc.terminate()
        proc.wait(10)


def test_sigterm_stops_the_aggregator_cleanly():
    proc, _ = start_aggregator()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert json.loads(out.splitlines()[-1])["event"] == "stopped"


def test_bad_config_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "agg.json"
    bad.write_text(json.dumps({"jobs": [{"job": 1, "pool": 4, "workers": ["127.0.0.1:70000"]}]}))
    r = subprocess.run([sys.executable, "-m", "passing.cli", "aggregator", "serve", "--config", str(bad),
                        "--listen", "127.0.0.1:0", "--control", "none"],
                       capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 2
    assert "bad job entry" in r.stderr
