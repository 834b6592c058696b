"""Starting PASSING's processes on one machine: a software aggregator on free ports, and UDP ports
known before their sockets exist. `passing-local`, the tests, the benchmarks and the demo share them."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_udp_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct UDP ports free now on ``host``, for addresses that must be known before their
    sockets exist. Drawn at random outside the kernel's ephemeral range: a socket bound to port 0
    meanwhile (every aggregator, controller and torch store) can never take one of them."""
    low, high = _ephemeral_range()
    candidates = [p for p in range(10000, 65536) if not low <= p <= high]
    if len(candidates) < 1000:  # the whole port space is ephemeral here: the kernel's choice, then
        return _kernel_chosen_udp_ports(count, host)
    rng = random.SystemRandom()
    ports: list[int] = []
    for _ in range(100 * count + 100):
        if len(ports) == count:
            break
        port = rng.choice(candidates)
        if port not in ports and _udp_port_free(host, port):
            ports.append(port)
    if len(ports) < count:
        raise OSError(f"found only {len(ports)} of {count} free UDP ports on {host}")
    return ports


def _udp_port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_chosen_udp_ports(count: int, host: str) -> list[int]:
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(count)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def start_aggregator(
    extra: list[str] | None = None, host: str = "127.0.0.1", popen: Callable[..., Any] = subprocess.Popen
) -> tuple[subprocess.Popen, dict[str, Any]]:
    """Start `passing-aggregator serve` on free ports; returns the process and its ready line.
    ``popen``: what starts it (the tests fork it from a process that imported passing already)."""
    cmd = [sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen", f"{host}:0",
           "--control", f"tcp://{host}:*", *(extra or [])]
    proc = popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError(f"aggregator exited with {proc.returncode} before it was ready")
    return proc, json.loads(line)
