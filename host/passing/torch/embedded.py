"""The embedded controller: what backend "passing" runs when no controller is configured.

A process group's rank 0 starts a PS-only controller (the real one, ``passing_controller``)
and a software aggregator in threads of its own process, bound to the address the other
ranks reach it at, and publishes the controller's endpoint in the group's store. Every
rank then joins through it as through an external controller, so the in-host stage and the
schemes work unchanged; the groups aggregate on the software aggregator (PS mode), in packets
as large as it takes and the path MTU allows: the MTU of rank 0's interface with that address
(``PASSING_MTU`` overrides it), 65536 on loopback.

It makes its own CURVE keys, in memory only (docs/security.md): the controller's, the
aggregator's (which admits the controller's only) and one worker key that the ranks get
through the group's store, the one channel they already trust with each other.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import os
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..aggregator.server import SoftwareAggregator
from ..keys import ClientKeys, Ephemeral
from .options import OptionError

log = logging.getLogger("passing.torch")

STORE_KEY = "passing/embedded"  # in the group's store: ``announcement()`` or {"error": text}
LINGER = 30.0  # s rank 0 waits at shutdown for the other workers to leave (their last RESULTs need the PS)


def tcp_store(store: dist.Store) -> dist.TCPStore | None:
    """The TCPStore under ``store`` (torchrun's, at MASTER_ADDR:MASTER_PORT), if it is one."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


def _source_toward(host: str) -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent: connect() only picks the route
            return s.getsockname()[0]
    except OSError:
        return None


def rank0_address(store: dist.Store) -> str:
    """Where the other ranks reach rank 0: the source address of rank 0's route to the store's
    host (rank 0 is on that host, or faces it on the cluster's network). A store on loopback
    means one machine; a host name that resolves to loopback here (Debian's 127.0.1.1 for the
    machine's own name) gives way to the address of the default route."""
    tcp = tcp_store(store)
    if tcp is None:
        return "127.0.0.1"  # no TCP store (file:// init): one machine unless PASSING_HOST says otherwise
    host = tcp.host
    source = _source_toward(host)
    if source is not None and not ipaddress.ip_address(source).is_loopback:
        return source
    if host == "localhost" or _is_loopback_literal(host):
        return "127.0.0.1"
    return _source_toward("192.0.2.1") or "127.0.0.1"  # TEST-NET-1: routed by the default route, never sent to


SIOCGIFADDR, SIOCGIFMTU = 0x8915, 0x8921  # Linux ioctls: an interface's IPv4 address, its MTU
LOOPBACK_MTU, DEFAULT_MTU = 65536, 1500


def interface_mtu(address: str) -> int:
    """The MTU of the interface that holds IPv4 ``address`` (its primary address): what the path
    from the other ranks to rank 0 carries at most; 65536 for a loopback address, 1500 when no
    interface has it."""
    if _is_loopback_literal(address):
        return LOOPBACK_MTU
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("16s16x", name.encode()[:15])
            try:
                if socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)[20:24]) != address:
                    continue
                return int(struct.unpack("16si12x", fcntl.ioctl(s.fileno(), SIOCGIFMTU, request))[1])
            except OSError:  # no IPv4 address on it
                continue
    return DEFAULT_MTU


def _is_loopback_literal(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Embedded:
    """A PS-only controller and a software aggregator serving from threads of this process."""

    def __init__(self, address: str, join_timeout: float, mtu: int | None = None) -> None:
        try:
            from passing_controller.keys import ServerKeys
            from passing_controller.service import Controller
            from passing_controller.topology import Topology
        except ImportError as e:
            raise OptionError(f"no controller configured (PASSING_CONTROLLER unset, no pg_options.controller) and "
                              f"the embedded one needs the passing-controller package ({e}): install it beside "
                              f"passing (pip install -e controller), or set PASSING_CONTROLLER") from None
        self.address = address
        self.keys = Ephemeral()
        try:
            self.aggregator = SoftwareAggregator(listen=(address, 0), control="tcp://127.0.0.1:*",
                                                 keys=self.keys.aggregator())
        except OSError as e:
            raise OptionError(f"embedded aggregator: cannot listen on {address} ({e}); set PASSING_HOST "
                              f"to an address of this host") from None
        data = "{}:{}".format(*self.aggregator.address)
        self.mtu = mtu or interface_mtu(address)
        try:
            topology = Topology.from_dict({"ps": [{"data": data, "control": self.aggregator.control_endpoint,
                                                   "public_key": self.keys.public("aggregator").decode(),
                                                   "mtu": self.mtu}]})
            public, secret = self.keys.pairs["controller"]
            controller_keys = ServerKeys(public, secret, {self.keys.public("worker"): "worker"})
            self.controller = Controller(topology, None, ":memory:", f"tcp://{address}:*", controller_keys,
                                         join_timeout=join_timeout)
        except BaseException:
            self.aggregator.close()
            raise
        self.endpoint = self.controller.endpoint
        self.threads = [threading.Thread(target=self.aggregator.serve, name="passing-embedded-aggregator",
                                         daemon=True),
                        threading.Thread(target=self.controller.serve, name="passing-embedded-controller",
                                         daemon=True)]
        for t in self.threads:
            t.start()
        self._closed = False

    def announcement(self) -> dict[str, str]:
        """What the other ranks need (through the group's store): where, and the keys to get in."""
        worker_public, worker_secret = self.keys.pairs["worker"]
        return {"controller": self.endpoint, "controller_key": self.keys.public("controller").decode(),
                "worker_public": worker_public.decode(), "worker_secret": worker_secret.decode()}

    def idle(self) -> bool:
        """No group is running or waiting for workers (every worker has left)."""
        return self.controller.idle()

    def close(self, linger: float = LINGER) -> None:
        """Stop both once every worker has left (at most ``linger`` s from now)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + linger
        while not self.idle():
            if time.monotonic() > deadline:
                log.info("passing: embedded controller stops with workers still in after %g s", linger)
                break
            time.sleep(0.05)
        self.controller.stop()
        self.aggregator.stop()
        for t in self.threads:
            t.join(10)


def publish(store: dist.Store, info: dict[str, Any]) -> None:
    store.set(STORE_KEY, json.dumps(info))


def endpoint(store: dist.Store) -> tuple[str, ClientKeys]:
    """The embedded controller's endpoint and a worker's keys for it, as rank 0 published them
    (waits for them)."""
    info = json.loads(store.get(STORE_KEY))
    if "error" in info:
        raise OptionError(f"rank 0 could not start the embedded controller: {info['error']}")
    keys = ClientKeys(info["controller_key"].encode(), info["worker_public"].encode(), info["worker_secret"].encode())
    return str(info["controller"]), keys


ENDED_KEY = "passing/embedded/ended"
TCP_ESTABLISHED = "01"  # the state column of /proc/net/tcp


def end(store: dist.Store, rank0: bool, timeout: float) -> None:
    """The end of an embedded-mode group, at destroy_process_group: rank 0 ends last (its controller waits
    for the others to leave), so it says when its services have stopped, and the others wait for that,
    ``timeout`` s at most (then, for the default group, for its store: ``store_gone``)."""
    if rank0:
        store.set(ENDED_KEY, "1")
        return
    try:
        store.wait([ENDED_KEY], timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError):  # rank 0 is gone already, or late: the store's end says the rest
        pass


def store_gone(store: dist.Store, timeout: float) -> None:
    """At the end of the default group on a rank but 0: wait until rank 0's TCPStore (on MASTER_PORT) has
    closed its connections, ``timeout`` s at most. A rank that ended earlier than rank 0 and calls
    init_process_group again at once would meet that old store, find the previous group's keys in it, and
    wait for peers that are gone (gloo's connectFullMesh to their old addresses). Closed connections are
    read from the kernel's table: a store call on one would fail, but torch logs each such failure with a
    stack trace."""
    tcp = tcp_store(store)
    if tcp is None:
        return
    deadline = time.monotonic() + timeout
    while _established_to(tcp.port):
        if time.monotonic() > deadline:
            log.info("passing: rank 0's store still open %g s after this rank's group ended", timeout)
            return
        time.sleep(0.01)


def _established_to(port: int) -> bool:
    """Whether this process holds an open TCP connection to ``port`` (of any host)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == TCP_ESTABLISHED and fields[9] in inodes and int(fields[2].rsplit(":", 1)[1], 16) == port:
                return True
    return False
