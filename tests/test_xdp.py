"""The AF_XDP I/O path (host/csrc/xsk.c, passing/xdp.py) against the UDP sockets: the same collectives give the
same bits on both, loss, duplication and reordering included, with the aggregator and the workers in network
namespaces on veths (loopback has no XDP receive path an XSK can use). Needs root, `ip netns` and a library built
with AF_XDP; the choice between the paths (auto, forced, the reason) is tested wherever the library loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from passing import Group, native, xdp
from passing.launch import free_udp_ports
from tests.test_scenarios import SOFTWARE

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from cluster import netns  # noqa: E402

pytestmark = pytest.mark.skipif(not native.available(), reason="the native library is not built")

WORKERS = 2
ELEMENTS = 60_000
PORT = 47000  # each worker's, in its own namespace


def _why_no_netns_xdp() -> str:
    if not xdp.built():
        return "the library was built without AF_XDP (libxdp-dev, libbpf-dev, clang: README)"
    return netns.available()


@pytest.fixture(scope="module")
def network():
    why = _why_no_netns_xdp()
    if why:
        pytest.skip(f"AF_XDP on veths: {why}")
    with netns.EmulatedNetwork(["agg", *(f"w{w}" for w in range(WORKERS))]) as net:
        yield net


def run(net: netns.EmulatedNetwork, io: str, lanes: int = 64, drop: float = 0.0, impair: bool = False,
        calls: int = 2, elements: int = ELEMENTS) -> tuple[dict, list[dict]]:
    """The aggregator and the workers over ``io``; their reports (the aggregator's: its stats at the end)."""
    workers = [f"{net.hosts[f'w{w}'].ip}:{PORT}" for w in range(WORKERS)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"jobs": [{"job": 1, "pool": 64, "generation": 0, "lanes": lanes, "workers": workers}]}, f)
    extra = ["--drop-ingress", "0.05", "--drop-egress", "0.05", "--duplicate", "0.05", "--reorder"] if impair else []
    agg = net.popen("agg", [sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen",
                            f"{net.hosts['agg'].ip}:0", "--control", "none", "--engine", "native", "--io", io,
                            "--lanes", str(lanes), "--config", f.name, "--seed", "3", *extra],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        ready = json.loads(agg.stdout.readline() or "{}")
        assert "data" in ready, agg.stderr.read() if agg.poll() is not None else "no ready line"
        procs = [net.popen(f"w{w}", [sys.executable, "-m", "tests.xdp_worker", json.dumps(
            {"worker": w, "workers": WORKERS, "aggregator": ready["data"], "bind": workers[w], "pool": 64,
             "lanes": lanes, "elements": elements, "seed": 7, "io": io, "drop": drop, "calls": calls})],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for w in range(WORKERS)]
        reports = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-2000:]
            reports.append(json.loads(out.splitlines()[-1]))  # the last line: the first says "ready"
    finally:
        agg.terminate()
        out, _ = agg.communicate(timeout=30)
        Path(f.name).unlink()
    stopped = json.loads(out.splitlines()[-1])
    return {"ready": ready, **stopped}, reports


@pytest.fixture(scope="module")
def udp_reference(network):
    return run(network, "udp")


def test_xdp_gives_the_udp_paths_bits(network, udp_reference):
    agg_udp, udp = udp_reference
    agg, got = run(network, "xdp")
    assert agg["ready"]["io"] == "xdp" and agg_udp["ready"]["io"] == "udp"
    assert agg["io"]["path"] == "xdp" and "AF_XDP on" in agg["io"]["reason"]
    # the aggregator's XSK carried the DATA and the RESULTs (the first packets may go through the socket)
    assert agg["io"]["xsk"]["rx_packets"] > 0 and agg["io"]["xsk"]["tx_packets"] > 0
    for r, ref in zip(got, udp):
        assert r["io"] == "xdp" and ref["io"] == "udp"
        assert r["xsk"]["rx_packets"] > 0 and r["xsk"]["tx_packets"] > 0
        assert r["digest"] == ref["digest"]
    # the int32 sums are exact: recomputed here from the workers' inputs
    from tests.xdp_worker import inputs
    expected = sum(inputs(7, w, ELEMENTS)[1][:8].astype(np.int64) for w in range(WORKERS))
    assert got[0]["int_sum"] == expected.tolist()


def test_xdp_under_loss_duplication_and_reordering(network, udp_reference):
    """5 % loss each way, 5 % duplication and reordering at the aggregator, 2 % loss each way at every worker:
    the same bits as the loss-free UDP run."""
    _, udp = udp_reference
    agg, got = run(network, "xdp", drop=0.02, impair=True)
    assert agg["io"]["xsk"]["rx_packets"] > 0
    for r, ref in zip(got, udp):
        assert r["io"] == "xdp" and r["stats"]["retransmissions"] > 0
        assert r["digest"] == ref["digest"]


@pytest.mark.slow  # seconds of processes in namespaces: make test-all, make sanitize
def test_xdp_at_the_ps_lanes(network):
    """364 lanes (a PS on a 1500-byte MTU path): one frame each, the same bits on both paths."""
    _, udp = run(network, "udp", lanes=364, calls=1)
    _, got = run(network, "xdp", lanes=364, calls=1)
    assert [r["digest"] for r in got] == [r["digest"] for r in udp]
    assert all(r["io"] == "xdp" and r["xsk"]["tx_packets"] > 0 for r in got)


@pytest.mark.slow  # seconds of processes in namespaces: make test-all, make sanitize
def test_the_scenario_table_through_an_aggregator_on_afxdp(network):
    """tests/test_scenarios.py's table against the native aggregator serving over AF_XDP (another namespace),
    packets sent from real sockets in a worker's namespace."""
    agg, w0 = network.hosts["agg"], network.hosts["w0"]
    done = subprocess.run(["ip", "netns", "exec", w0.namespace, sys.executable, "-m", "pytest", "-q", "-p",
                           "no:cacheprovider", "-p", "no:xdist", "tests/test_scenarios.py", "-k",
                           "test_udp_aggregator"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PASSING_SCENARIOS_OVER_XDP": f"{agg.namespace} {agg.ip} {w0.ip}"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    table = len(SOFTWARE)  # the flat table's software scenarios and the tree's
    assert passed and int(passed.group(1)) == table, done.stdout[-1000:]  # every one, on the native engine


def _xdp_attached(net: netns.EmulatedNetwork, host: str) -> bool:
    shown = subprocess.run(["ip", "netns", "exec", net.hosts[host].namespace, "ip", "link", "show", "eth0"],
                           capture_output=True, text=True).stdout
    return "xdp" in shown


@pytest.mark.slow  # seconds of processes in namespaces: make test-all, make sanitize
def test_an_aggregator_killed_mid_call_fails_the_call_and_leaves_no_xdp_program(network):
    """SIGKILL of an aggregator serving over AF_XDP mid-stream: the workers' calls end in AggregatorUnreachable
    within their timeout (not a hang), the steering program goes with the process (a BPF link), and the next
    aggregator on that interface gets AF_XDP again."""
    workers = [f"{network.hosts[f'w{w}'].ip}:{PORT}" for w in range(WORKERS)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"jobs": [{"job": 1, "pool": 64, "generation": 0, "workers": workers}]}, f)
    argv = [sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen", f"{network.hosts['agg'].ip}:0",
            "--control", "none", "--engine", "native", "--io", "xdp", "--config", f.name]
    try:
        agg = network.popen("agg", argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        ready = json.loads(agg.stdout.readline())
        assert ready["io"] == "xdp" and _xdp_attached(network, "agg")
        procs = [network.popen(f"w{w}", [sys.executable, "-m", "tests.xdp_worker", json.dumps(
            {"worker": w, "workers": WORKERS, "aggregator": ready["data"], "bind": workers[w], "pool": 64,
             "lanes": 64, "elements": ELEMENTS, "seed": 7, "io": "xdp", "drop": 0.0, "calls": 100_000,
             "timeout": 3.0})], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
            for w in range(WORKERS)]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # mid-stream
        agg.kill()  # `ip netns exec` execs the aggregator: this is its SIGKILL
        agg.wait(10)
        for p in procs:
            _, err = p.communicate(timeout=60)
            assert p.returncode != 0 and "AggregatorUnreachable" in err and "no RESULT" in err, err[-2000:]
        assert not _xdp_attached(network, "agg")
        again = network.popen("agg", argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert json.loads(again.stdout.readline())["io"] == "xdp"
        again.terminate()
        again.communicate(timeout=30)
    finally:
        Path(f.name).unlink()


def test_auto_keeps_the_udp_sockets_where_afxdp_would_copy(network):
    """veth has no zero-copy AF_XDP: "auto" keeps the UDP sockets (faster there), and says why, at both ends."""
    agg, got = run(network, "auto", calls=1, elements=5000)
    assert agg["ready"]["io"] == "udp" and "zero-copy" in agg["ready"]["io_reason"]
    assert all(r["io"] == "udp" and "zero-copy" in r["io_reason"] and r["xsk"] == {} for r in got)


def test_auto_takes_the_udp_socket_on_loopback_and_says_why():
    (port,) = free_udp_ports(1)
    with Group(1, 0, 1, ["127.0.0.1:9"], bind=f"127.0.0.1:{port}", engine="native") as g:
        assert g.io_path == "udp"
        assert ("loopback" in g.io_reason) if xdp.built() else ("without AF_XDP" in g.io_reason)
    with Group(1, 0, 1, ["127.0.0.1:9"], bind=f"127.0.0.1:{port}", engine="numpy") as g:
        assert g.io_path == "udp" and "numpy" in g.io_reason
    with Group(1, 0, 1, ["127.0.0.1:9"], bind=f"127.0.0.1:{port}", engine="native", io="udp") as g:
        assert g.io_path == "udp" and "io='udp'" in g.io_reason


def test_forcing_xdp_where_it_cannot_run_raises_with_the_reason():
    (port,) = free_udp_ports(1)
    with pytest.raises(OSError, match="io='xdp': AF_XDP cannot run .*(loopback|without AF_XDP)"):
        Group(1, 0, 1, ["127.0.0.1:9"], bind=f"127.0.0.1:{port}", engine="native", io="xdp")
    with pytest.raises(ValueError, match="io must be one of"):
        Group(1, 0, 1, ["127.0.0.1:9"], bind=f"127.0.0.1:{port}", engine="native", io="dpdk")
