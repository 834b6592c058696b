"""An emulated cluster in Linux network namespaces (root only).

One "switch" namespace holds a bridge (and whatever stands in for the switch: the
software aggregator, the controller); every host gets a namespace of its own with one
veth link to the bridge, optionally rate-limited with tbf in both directions. Names
carry the creating process's pid, so a later run removes what a crashed one left.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from .processes import stop_processes

PREFIX = "psg"  # every namespace this module makes: psg<pid>-<name>
SUBNET = "10.55"  # hosts 10.55.0.1.., the switch namespace's bridge 10.55.0.254


def available() -> str:
    """'' if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "iproute2's `ip netns` does not work here"
    return ""


def _sh(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done


def remove_stale() -> list[str]:
    """Delete namespaces (and kill their processes) left by runs whose process is gone."""
    removed = []
    for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
        m = re.match(rf"({PREFIX}(\d+)-\S+)", line)
        if m and not _alive(int(m.group(2))):
            _delete_namespace(m.group(1))
            removed.append(m.group(1))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(name: str) -> None:
    for pid in _sh("ip", "netns", "pids", name, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _sh("ip", "netns", "del", name, check=False)


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    ip: str
    interface: str = "eth0"
    switch_port: str = ""  # its link's other end, a veth on the switch namespace's bridge


class EmulatedNetwork:
    """``hosts`` namespaces around a bridge in a switch namespace.

    ``rate_mbit``: per host, the rate of its link in Mbit/s (both directions); a host
    that is not named gets an unlimited link.
    """

    def __init__(self, hosts: Sequence[str], rate_mbit: dict[str, float] | None = None) -> None:
        why = available()
        if why:
            raise RuntimeError(f"cannot emulate a cluster: {why}")
        remove_stale()
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = Host("switch", f"{self.tag}-sw", f"{SUBNET}.0.254", "br0")
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen] = []
        self._namespaces: list[str] = []
        self.limited: list[tuple[str, str]] = []  # (namespace, device) of every tbf
        atexit.register(self.stop)
        try:
            self._make_namespace(self.switch.namespace)
            _sh("ip", "link", "add", "br0", "type", "bridge", ns=self.switch.namespace)
            _sh("ip", "addr", "add", f"{self.switch.ip}/16", "dev", "br0", ns=self.switch.namespace)
            _sh("ip", "link", "set", "br0", "up", ns=self.switch.namespace)
            for i, name in enumerate(hosts):
                self._add_host(i, name, (rate_mbit or {}).get(name))
        except BaseException:
            self.stop()
            raise

    def _make_namespace(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        _sh("ip", "link", "set", "lo", "up", ns=ns)

    def _add_host(self, i: int, name: str, rate: float | None) -> None:
        inner, outer = f"{self.tag}h{i}"[-15:], f"{self.tag}s{i}"[-15:]
        host = Host(name, f"{self.tag}-{name}", f"{SUBNET}.{(i + 1) // 250}.{(i + 1) % 250}", switch_port=outer)
        self._make_namespace(host.namespace)
        _sh("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
        _sh("ip", "link", "set", inner, "netns", host.namespace)
        _sh("ip", "link", "set", outer, "netns", self.switch.namespace)
        _sh("ip", "link", "set", inner, "name", "eth0", ns=host.namespace)
        _sh("ip", "addr", "add", f"{host.ip}/16", "dev", "eth0", ns=host.namespace)
        _sh("ip", "link", "set", "eth0", "up", ns=host.namespace)
        _sh("ip", "link", "set", outer, "master", "br0", ns=self.switch.namespace)
        _sh("ip", "link", "set", outer, "up", ns=self.switch.namespace)
        if rate:
            self.limited += [(host.namespace, "eth0"), (self.switch.namespace, outer)]  # both directions
            for ns, dev in self.limited[-2:]:
                limit(ns, dev, rate)
        self.hosts[name] = host

    def set_mtu(self, mtu: int) -> None:
        """Every host's veth, and every port of the switch's bridge, to ``mtu``."""
        for host in self.hosts.values():
            _sh("ip", "link", "set", "eth0", "mtu", str(mtu), ns=host.namespace)
        for line in _sh("ip", "-o", "link", "show", ns=self.switch.namespace).stdout.splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name != "lo":
                _sh("ip", "link", "set", name, "mtu", str(mtu), ns=self.switch.namespace)

    def set_rate(self, rate_mbit: float, burst_bytes: int | None = None, queue_bytes: int | None = None) -> None:
        """Every rate-limited link to ``rate_mbit``, optionally with the tbf's bucket and queue sizes."""
        for ns, dev in self.limited:
            limit(ns, dev, rate_mbit, burst_bytes, queue_bytes)

    def popen(self, where: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in host ``where`` (or "switch"); it is killed at stop()."""
        ns = self.switch.namespace if where == "switch" else self.hosts[where].namespace
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kwargs)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        stop_processes(self.procs)
        for ns in reversed(self._namespaces):
            _delete_namespace(ns)
        self._namespaces.clear()
        atexit.unregister(self.stop)

    def __enter__(self) -> EmulatedNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def limit(ns: str, dev: str, rate_mbit: float, burst_bytes: int | None = None, queue_bytes: int | None = None) -> None:
    """tbf on ``dev``'s egress: ``rate_mbit`` Mbit/s; by default a bucket of a few ms of
    traffic (at least 64 KiB) and a queue of 50 ms."""
    burst = burst_bytes or max(int(rate_mbit * 1e6 / 8 * 0.004), 64 * 1024)
    queue = ["limit", str(queue_bytes)] if queue_bytes else ["latency", "50ms"]
    _sh("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), *queue,
        ns=ns)


RACK_SUBNET = "10.56"  # racks' hosts 10.56.<rack+1>.<i+1>, a leaf's bridge 10.56.<rack+1>.254, the spine 10.56.0.254


class RackNetwork(EmulatedNetwork):
    """Racks of hosts under leaf bridges joined by a spine bridge (bench/emulated_racks.py), one L2 network.

    ``racks`` x ``per_rack`` host namespaces ``r<k>s<i>`` on a link of ``rate_mbit`` to the bridge of their
    rack's leaf namespace ``leaf<k>``; each leaf on an uplink of ``uplink_mbit`` to the bridge of the spine
    namespace (``self.switch``); ``extra`` hosts (a PS) on a link of ``rate_mbit`` to the spine. Every link
    is rate-limited with tbf in both directions (``limited``; ``set_rate`` sets the server links and
    ``set_uplink_rate`` the uplinks). ``self.leaves[k]`` is leaf k (its bridge's address, where a rack's
    aggregator listens); ``popen`` takes a host, a leaf name or "switch" (the spine)."""

    def __init__(self, racks: int, per_rack: int, rate_mbit: float, uplink_mbit: float,
                 extra: Sequence[str] = ()) -> None:
        why = available()
        if why:
            raise RuntimeError(f"cannot emulate a cluster: {why}")
        if not (1 <= racks <= 250 and 1 <= per_rack <= 250):
            raise ValueError(f"racks {racks} and hosts per rack {per_rack} must be within 1..250")
        remove_stale()
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = Host("spine", f"{self.tag}-spine", f"{RACK_SUBNET}.0.254", "br0")
        self.hosts: dict[str, Host] = {}
        self.leaves: dict[str, Host] = {}
        self.procs: list[subprocess.Popen] = []
        self._namespaces: list[str] = []
        self.limited: list[tuple[str, str]] = []  # server and extra links
        self.uplinks: list[tuple[str, str]] = []
        self._links = 0
        atexit.register(self.stop)
        try:
            self._bridge(self.switch)
            for k in range(racks):
                leaf = Host(f"leaf{k}", f"{self.tag}-leaf{k}", f"{RACK_SUBNET}.{k + 1}.254", "br0")
                self._bridge(leaf)
                self.leaves[leaf.name] = leaf
                self.uplinks += self._link(leaf.namespace, "uplink", self.switch.namespace, uplink_mbit)
                for i in range(per_rack):
                    self._host(f"r{k}s{i}", f"{RACK_SUBNET}.{k + 1}.{i + 1}", leaf, rate_mbit)
            for j, name in enumerate(extra):
                self._host(name, f"{RACK_SUBNET}.250.{j + 1}", self.switch, rate_mbit)
        except BaseException:
            self.stop()
            raise

    def _bridge(self, node: Host) -> None:
        self._make_namespace(node.namespace)
        _sh("ip", "link", "add", "br0", "type", "bridge", ns=node.namespace)
        _sh("ip", "addr", "add", f"{node.ip}/16", "dev", "br0", ns=node.namespace)
        _sh("ip", "link", "set", "br0", "up", ns=node.namespace)

    def _link(self, ns: str, name: str, bridge_ns: str, rate: float) -> list[tuple[str, str]]:
        """A veth named ``name`` in ``ns`` (on ``ns``'s bridge when it has one: a leaf's uplink) to a port of
        ``bridge_ns``'s bridge, tbf on both ends: the two (namespace, device) it limits."""
        self._links += 1
        inner, outer = f"{self.tag}a{self._links}"[-15:], f"{self.tag}b{self._links}"[-15:]
        _sh("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
        _sh("ip", "link", "set", inner, "netns", ns)
        _sh("ip", "link", "set", outer, "netns", bridge_ns)
        _sh("ip", "link", "set", inner, "name", name, ns=ns)
        if name == "uplink":
            _sh("ip", "link", "set", name, "master", "br0", ns=ns)
        _sh("ip", "link", "set", name, "up", ns=ns)
        _sh("ip", "link", "set", outer, "master", "br0", ns=bridge_ns)
        _sh("ip", "link", "set", outer, "up", ns=bridge_ns)
        ends = [(ns, name), (bridge_ns, outer)]
        for where, dev in ends:
            limit(where, dev, rate)
        return ends

    def _host(self, name: str, ip: str, bridge: Host, rate: float) -> None:
        host = Host(name, f"{self.tag}-{name}", ip)
        self._make_namespace(host.namespace)
        ends = self._link(host.namespace, "eth0", bridge.namespace, rate)
        _sh("ip", "addr", "add", f"{ip}/16", "dev", "eth0", ns=host.namespace)
        self.limited += ends
        self.hosts[name] = host

    def set_uplink_rate(self, rate_mbit: float, burst_bytes: int | None = None, queue_bytes: int | None = None) -> None:
        """Every leaf's uplink (both directions) to ``rate_mbit``."""
        for ns, dev in self.uplinks:
            limit(ns, dev, rate_mbit, burst_bytes, queue_bytes)

    def popen(self, where: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in host, leaf or "switch" (the spine) ``where``; it is killed at stop()."""
        ns = (self.switch.namespace if where == "switch" else
              self.leaves[where].namespace if where in self.leaves else self.hosts[where].namespace)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kwargs)
        self.procs.append(proc)
        return proc
