"""bench/core.py's section 8: the host stage's payload rate per core (issue 46).

One worker (a Group on the native host engine) and the native software aggregator, each pinned to a core of its
own (taskset), on loopback and on a veth pair between two network namespaces (root), at the switch's lane counts
(64: Tofino 1 and 2, 72: the Tofino 2 program without the tree roles) and the PS's (364: a 1500-byte MTU
path), for each I/O path that can run there (the UDP sockets with GSO/GRO; AF_XDP where the library was built
with it and the path has XDP). The figure is the payload each way per second of the worker's own CPU time
(user + system, getrusage around each call): the same
bytes go up as DATA and come back as RESULTs, so "each way" is the array's size. The wall time minus the CPU time
is the worker's waiting (for the aggregator, or for the kernel's delivery on the other core); core 0's busy time
from /proc/stat (the worker's core: softirq work the kernel does there for its packets included, and whatever
else the shared machine runs there) is reported beside it.

Where the time goes: ``perf record`` of the worker's calls where perf works here (software clock events where the
machine has no hardware counters), else nothing (valgrind's callgrind is run by hand: docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CORE = Path(__file__).resolve().with_name("core.py")
WORKER_CORE, AGGREGATOR_CORE = 0, 1
NS_SUBNET = "10.57.0"  # the veth pair: worker .1, aggregator .2


def _cpu_busy(core: int) -> float:
    """Seconds core ``core`` spent busy since boot (user, nice, system, irq, softirq, steal: /proc/stat)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{core} "):
            f = [int(v) for v in line.split()[1:]]
            return (f[0] + f[1] + f[2] + f[5] + f[6] + f[7]) / os.sysconf("SC_CLK_TCK")
    return float("nan")


def percore_worker(spec: dict[str, Any]) -> None:
    """In the worker process: one Group, warm-up calls, then timed calls; prints JSON."""
    from passing import Group

    with Group(1, 0, 1, [spec["aggregator"]], pool=spec["pool"], lanes=spec["lanes"], generation=0,
               bind=spec["bind"], scale="auto", engine="native", io=spec["io"], timeout=60.0) as group:
        x = np.random.default_rng(0).standard_normal(spec["elements"], dtype=np.float32)
        out = np.empty_like(x)
        for _ in range(spec["warmup"]):
            group.allreduce(x, out=out)
        calls = []
        for _ in range(spec["iterations"]):
            r0, busy0, t0 = resource.getrusage(resource.RUSAGE_SELF), _cpu_busy(WORKER_CORE), time.perf_counter()
            group.allreduce(x, out=out)
            t1, busy1, r1 = time.perf_counter(), _cpu_busy(WORKER_CORE), resource.getrusage(resource.RUSAGE_SELF)
            calls.append({"wall": t1 - t0, "user": r1.ru_utime - r0.ru_utime, "system": r1.ru_stime - r0.ru_stime,
                          "core_busy": busy1 - busy0})
        if spec.get("profile_seconds"):  # calls the profiler watches (bench's perf record), after the timed ones
            print("profile", flush=True)
            end = time.perf_counter() + spec["profile_seconds"]
            while time.perf_counter() < end:
                group.allreduce(x, out=out)
        ok = bool(np.allclose(out, x, atol=2e-6))
        print(json.dumps({"calls": calls, "ok": ok, "io": group.io_path, "io_reason": group.io_reason,
                          "stats": group.stats.as_dict()}), flush=True)


class _Where:
    """Loopback, or a veth pair between two namespaces (worker 10.57.0.1, aggregator 10.57.0.2)."""

    def __init__(self, veth: bool, mtu: int = 1500) -> None:
        self.veth = veth
        self.namespaces: list[str] = []
        if not veth:
            self.worker_ip = self.aggregator_ip = "127.0.0.1"
            return
        tag = f"pcr{os.getpid()}"
        self.worker_ns, self.aggregator_ns = f"{tag}-w", f"{tag}-a"
        self.worker_ip, self.aggregator_ip = f"{NS_SUBNET}.1", f"{NS_SUBNET}.2"
        try:
            for ns in (self.worker_ns, self.aggregator_ns):
                _sh("ip", "netns", "add", ns)
                self.namespaces.append(ns)
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _sh("ip", "link", "add", f"{tag}w", "netns", self.worker_ns, "type", "veth", "peer", "name", f"{tag}a",
                "netns", self.aggregator_ns)
            for ns, dev, ip in ((self.worker_ns, f"{tag}w", self.worker_ip),
                                (self.aggregator_ns, f"{tag}a", self.aggregator_ip)):
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "name", "eth0")
                _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "mtu", str(mtu), "up")
        except BaseException:
            self.close()
            raise

    def prefix(self, worker: bool) -> list[str]:
        if not self.veth:
            return []
        return ["ip", "netns", "exec", self.worker_ns if worker else self.aggregator_ns]

    def close(self) -> None:
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()


def _sh(*args: str) -> None:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")


def _perf_works() -> bool:
    if not shutil.which("perf"):
        return False
    probe = subprocess.run(["perf", "stat", "-e", "task-clock", "true"], capture_output=True, text=True)
    return probe.returncode == 0


def _profile(pid: int, seconds: float) -> list[tuple[float, str]]:
    """perf record -e cpu-clock of process ``pid`` for ``seconds``: the top symbols and their share."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        rec = subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-F", "4999", "-p", str(pid), "-o",
                              str(data), "--", "sleep", str(seconds)], capture_output=True, text=True)
        if rec.returncode != 0 or not data.exists():
            return []
        rep = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "symbol",
                              "--percent-limit", "1.5"], capture_output=True, text=True)
    top = []
    for line in rep.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].endswith("%") and not line.startswith("#"):
            try:
                top.append((float(parts[0].rstrip("%")), " ".join(parts[2:])))
            except ValueError:
                continue
    return top[:12]


def percore_run(where: _Where, io: str, lanes: int, elements: int, iterations: int, pool: int,
                profile: bool, wrap: list[str] | None = None) -> dict[str, Any]:
    """One worker and the native aggregator at ``lanes``, pinned, over ``io``; the per-call figures."""
    sys.path.insert(0, str(CORE.parent))
    from passing.launch import free_udp_ports

    port = free_udp_ports(1, "127.0.0.1")[0]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"jobs": [{"job": 1, "pool": pool, "generation": 0, "lanes": lanes,
                             "workers": [f"{where.worker_ip}:{port}"]}]}, f)
        config = f.name
    agg_cmd = [*where.prefix(False), "taskset", "-c", str(AGGREGATOR_CORE), sys.executable, "-m", "passing.cli",
               "aggregator", "serve", "--listen", f"{where.aggregator_ip}:0", "--control", "none", "--engine",
               "native", "--lanes", str(lanes), "--max-lanes", str(max(lanes, 1024)), "--slots", str(max(4096, pool)),
               "--config", config, "--io", io]
    agg = subprocess.Popen(agg_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(agg.stdout.readline() or "{}")
        if "data" not in ready:
            agg.kill()
            return {"error": f"aggregator: {agg.communicate(timeout=10)[1].strip()[-300:]}"}
        spec = {"aggregator": ready["data"], "bind": f"{where.worker_ip}:{port}", "pool": pool, "lanes": lanes,
                "elements": elements, "iterations": iterations, "warmup": 2, "io": io,
                "profile_seconds": 2.0 if profile else 0.0}
        worker = subprocess.Popen([*where.prefix(True), "taskset", "-c", str(WORKER_CORE), *(wrap or []),
                                   sys.executable, str(CORE),
                                   "--percore-worker", json.dumps(spec)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        top: list[tuple[float, str]] = []
        if profile and worker.stdout.readline().strip() == "profile":  # the timed calls are done
            top = _profile(worker.pid, 1.0)
        out, err = worker.communicate(timeout=600)
    finally:
        agg.terminate()
        try:
            agg.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            agg.kill()
        os.unlink(config)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if worker.returncode != 0 or not lines:
        return {"error": (err.strip().splitlines() or [f"exit {worker.returncode}"])[-1]}
    report = json.loads(lines[-1])
    bits = elements * 4 * 8
    calls = report["calls"]
    per_core = [bits / (c["user"] + c["system"]) / 1e9 for c in calls if c["user"] + c["system"] > 0]
    per_wall = [bits / c["wall"] / 1e9 for c in calls]
    cpu = float(np.median([c["user"] + c["system"] for c in calls]))
    wall = float(np.median([c["wall"] for c in calls]))
    return {
        "lanes": lanes, "io": report["io"], "io_reason": report["io_reason"], "ok": report["ok"],
        "elements": elements, "pool": pool, "aggregator_io": ready.get("io"),
        "gbit_per_core_each_way": float(np.median(per_core)) if per_core else None,
        "gbit_per_core_range": [min(per_core), max(per_core)] if per_core else None,
        "gbit_wall_each_way": float(np.median(per_wall)),
        "worker_cpu_s": cpu, "worker_user_s": float(np.median([c["user"] for c in calls])),
        "worker_system_s": float(np.median([c["system"] for c in calls])),
        "wall_s": wall, "waiting_s": max(0.0, wall - cpu),
        "core_busy_s": float(np.median([c["core_busy"] for c in calls])),
        "packets_per_s_per_core": elements / lanes / cpu if cpu else None,
        "retransmissions": report["stats"]["retransmissions"], "profile": top, "calls": calls,
    }


def perf_counts_instructions() -> bool:
    """Whether perf can count instructions here (a VM may have no hardware counters: '<not supported>')."""
    if not shutil.which("perf"):
        return False
    probe = subprocess.run(["perf", "stat", "-x,", "-e", "instructions", "true"], capture_output=True, text=True)
    return probe.returncode == 0 and "not supported" not in probe.stderr and "not counted" not in probe.stderr


def callgrind_counts(lanes: int, elements: int, pool: int) -> dict[str, Any]:
    """Instructions of the host engine's user-space work per packet (valgrind's callgrind, where perf cannot count
    them): one worker on loopback under callgrind, 2 warm-up + 1 timed call of ``elements``; the functions of the
    native library alone (Python's and numpy's start-up and the kernel's work are not in it)."""
    if not shutil.which("valgrind") or not shutil.which("callgrind_annotate"):
        return {"error": "valgrind (callgrind) not found"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        where = _Where(False)
        try:
            r = percore_run(where, "udp", lanes, elements, 1, pool, False,
                            wrap=["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"])
        finally:
            where.close()
        if "error" in r or not out.exists():
            return {"error": r.get("error", "no callgrind output")}
        text = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(out)],
                              capture_output=True, text=True).stdout
    by_function: dict[str, int] = {}
    for line in text.splitlines():  # "1,234 ( 5.6%)  host/csrc/file.c:function [object]": our sources' alone
        m = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(\S+)", line)
        if m and "/csrc/" in m.group(2) and ":" in m.group(2):
            path, function = m.group(2).rsplit(":", 1)
            name = f"{Path(path).name}:{function}"  # a function with no symbol shows as its address
            by_function[name] = by_function.get(name, 0) + int(m.group(1).replace(",", ""))
    native = sorted(((count, name) for name, count in by_function.items()), reverse=True)
    total = sum(count for count, _ in native)
    packets = 3 * -(-elements // lanes) + 3  # three SUM passes (2 warm-up, 1 timed) and their MAX rounds
    return {"lanes": lanes, "elements": elements, "instructions": total, "packets": packets,
            "instructions_per_packet": total / packets,
            "top": [(count / total * 100 if total else 0.0, name, count / packets) for count, name in native[:10]]}


def io_paths() -> list[str]:
    """The I/O paths this build has: 'udp' always, 'xdp' where the library was built with AF_XDP."""
    from passing import xdp

    return ["udp", "xdp"] if xdp.built() else ["udp"]


def percore(lanes_list: list[int], elements: int, iterations: int, pool: int, veth: bool,
            profile: bool) -> list[dict[str, Any]]:
    """Every (where, lanes, I/O path) row; prints each as it comes."""
    rows: list[dict[str, Any]] = []
    places = [False] + ([True] if veth and os.geteuid() == 0 else [])
    if veth and os.geteuid() != 0:
        print("  (the veth rows need root: skipped)")
    perf = profile and _perf_works()
    for on_veth in places:
        where = _Where(on_veth)
        try:
            for lanes in lanes_list:
                for io in io_paths():
                    if io == "xdp" and not on_veth:
                        continue  # loopback has no XDP for AF_XDP (passing/xdp.py says why)
                    r = percore_run(where, io, lanes, elements, iterations, pool, perf and lanes == lanes_list[0])
                    r.update(where="veth" if on_veth else "loopback", lanes=lanes, requested_io=io)
                    rows.append(r)
                    _print_row(r)
        finally:
            where.close()
    return rows


def _print_row(r: dict[str, Any]) -> None:
    head = f"{r['where']:>8} | {r['lanes']:>5} | {r['requested_io']:>4}"
    if "error" in r:
        print(f"{head} | FAILED: {r['error']}", flush=True)
        return
    lo, hi = r["gbit_per_core_range"]
    print(f"{head} | {r['io']:>4} | {r['gbit_per_core_each_way']:6.2f} ({lo:5.2f}-{hi:5.2f}) | "
          f"{r['gbit_wall_each_way']:6.2f} | {r['worker_user_s'] * 1e3:7.1f} | {r['worker_system_s'] * 1e3:7.1f} | "
          f"{r['waiting_s'] * 1e3:7.1f} | {r['core_busy_s'] * 1e3:7.1f} | "
          f"{r['packets_per_s_per_core'] / 1e6:5.2f} | {'yes' if r['ok'] else 'NO'}"
          + (f"  ({r['io_reason']})" if r["io"] != r["requested_io"] else ""), flush=True)
    for share, symbol in r["profile"]:
        print(f"{'':>20}{share:5.1f}%  {symbol}")
