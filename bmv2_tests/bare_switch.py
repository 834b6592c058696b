"""One BMv2 `simple_switch_grpc` in a network namespace of its own, whose ports are veth pairs: the test writes
and reads whole frames on the other ends. For replaying P4Testgen's vectors, which name switch ports and
frames byte for byte (Mininet hosts would add traffic of their own).

The namespace has its own loopback, so the switch's P4Runtime server listens on a Unix socket (files cross
namespaces) and the test's raw sockets and its Thrift connection are opened inside the namespace by a
short-lived thread (``setns`` moves only the calling thread; a socket stays in the namespace it was made in).
Thrift is BMv2's own runtime API: it resets registers, which BMv2's P4Runtime server cannot write.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import select
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .network import stop_process

CLONE_NEWNET = 0x40000000
ETH_P_ALL = 0x0003
THRIFT_PORT = 9090  # inside the namespace: no other switch there

T = TypeVar("T")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def in_namespace(name: str, make: Callable[[], T]) -> T:
    """make() run by a thread that has entered the network namespace ``name``."""
    result: dict[str, object] = {}

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(f"/run/netns/{name}") as ns:
                if libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {name}: {os.strerror(err)}")
            result["value"] = make()
        except BaseException as e:  # handed to the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name=f"setns-{name}")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["value"]  # type: ignore[return-value]


class ThriftRuntime:
    """The one call of BMv2's Thrift runtime the replay needs (standard.thrift's ``bm_register_reset``), in
    Thrift's binary protocol over a buffered transport, multiplexed by service name, as BMv2 serves it."""

    CALL, REPLY, EXCEPTION = 1, 2, 3
    VERSION_1 = 0x80010000

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.stream = sock.makefile("rb")
        self.seqid = 0

    def register_reset(self, register: str) -> None:
        self.seqid += 1
        name = b"standard:bm_register_reset"
        message = struct.pack(">II", self.VERSION_1 | self.CALL, len(name)) + name + struct.pack(">i", self.seqid)
        message += struct.pack(">bhi", 8, 1, 0)  # 1: i32 cxt_id = 0
        message += struct.pack(">bhI", 11, 2, len(register)) + register.encode()  # 2: string register_array_name
        message += b"\x00"  # end of the arguments
        self.sock.sendall(message)
        version, = struct.unpack(">I", self._read(4))
        self._read(struct.unpack(">I", self._read(4))[0])  # the method's name
        seqid, = struct.unpack(">i", self._read(4))
        fields = self._struct()
        if version & 0xFF == self.EXCEPTION:
            raise RuntimeError(f"BMv2 Thrift: register_reset({register}): {fields.get(1, b'').decode()}")
        if seqid != self.seqid or version & 0xFF != self.REPLY:
            raise RuntimeError(f"BMv2 Thrift: unexpected reply {version:#x} seqid {seqid}")
        if 1 in fields:  # InvalidRegisterOperation {1: code}
            raise RuntimeError(f"BMv2 Thrift: register_reset({register}) failed: code {fields[1].get(1)}")

    def _read(self, n: int) -> bytes:
        data = self.stream.read(n)
        if len(data) != n:
            raise RuntimeError("BMv2 Thrift: connection closed")
        return data

    def _struct(self) -> dict:
        """Field id -> value for the types BMv2's replies here carry (i32, string, struct)."""
        fields: dict = {}
        while True:
            kind, = struct.unpack(">b", self._read(1))
            if kind == 0:
                return fields
            field, = struct.unpack(">h", self._read(2))
            if kind == 8:
                fields[field], = struct.unpack(">i", self._read(4))
            elif kind == 11:
                fields[field] = self._read(struct.unpack(">I", self._read(4))[0])
            elif kind == 12:
                fields[field] = self._struct()
            else:
                raise RuntimeError(f"BMv2 Thrift: field type {kind} not expected in this reply")

    def close(self) -> None:
        self.stream.close()
        self.sock.close()


_SWITCHES = itertools.count()  # this process's switches, for their namespaces' names


class NamespacedSwitch:
    """simple_switch_grpc with ports 0..ports-1, each a veth pair ``sw<i>`` (the switch's) / ``pk<i>`` (the
    test's), no program loaded: push one over P4Runtime at ``p4runtime_address``."""

    def __init__(self, ports: int) -> None:
        self.ports = ports
        # unique per switch of this process (a module's may still be up when another starts); the pid last, for
        # remove_leftovers
        self.name = f"passing-replay-{next(_SWITCHES)}-{os.getpid()}"
        self.dir = tempfile.mkdtemp(prefix="passing-replay-")
        self.p4runtime_address = f"unix:{self.dir}/p4runtime.sock"
        self.process: subprocess.Popen | None = None
        self.sockets: list[socket.socket] = []
        self.thrift: ThriftRuntime | None = None
        try:
            self._start()
        except BaseException:
            self.stop()  # never leave a namespace behind
            raise

    @staticmethod
    def remove_leftovers() -> None:
        """Namespaces of replays whose process is gone (killed before its teardown): their veths too."""
        for path in Path("/run/netns").glob("passing-replay-*"):
            pid = path.name.rsplit("-", 1)[1]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                subprocess.run(["ip", "netns", "del", path.name], capture_output=True)

    def _start(self) -> None:
        self.remove_leftovers()
        _ip("netns", "add", self.name)
        # no IPv6 autoconfiguration or router solicitations on the ports: only the test's frames cross them
        _ip("netns", "exec", self.name, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1")
        _ip("-n", self.name, "link", "set", "lo", "up")
        args = ["ip", "netns", "exec", self.name, "simple_switch_grpc", "--device-id", "0", "--no-p4",
                "--thrift-port", str(THRIFT_PORT)]
        for i in range(self.ports):
            _ip("-n", self.name, "link", "add", f"sw{i}", "type", "veth", "peer", "name", f"pk{i}")
            for intf in (f"sw{i}", f"pk{i}"):
                _ip("-n", self.name, "link", "set", intf, "up")
                # BMv2 reads raw frames: no offloads, so every frame crosses as sent
                subprocess.run(["ip", "netns", "exec", self.name, "ethtool", "-K", intf, "tx", "off", "rx", "off",
                                "tso", "off", "gso", "off", "gro", "off"], capture_output=True)
            args += ["-i", f"{i}@sw{i}"]
        args += ["--", "--grpc-server-addr", self.p4runtime_address]
        with open(os.path.join(self.dir, "switch.out"), "w") as output:
            self.process = subprocess.Popen(args, stdout=output, stderr=subprocess.STDOUT)
        self.sockets = in_namespace(self.name, self._raw_sockets)
        deadline = time.monotonic() + 30
        while not (os.path.exists(f"{self.dir}/p4runtime.sock") and (self.thrift or self._connect_thrift())):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("simple_switch_grpc did not start, or has no Thrift server (the replay resets "
                                   "registers over Thrift: configure its target --with-thrift, docs/bmv2.md): "
                                   f"{self.log()}")
            time.sleep(0.1)

    def _raw_sockets(self) -> list[socket.socket]:
        out = []
        for i in range(self.ports):
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.bind((f"pk{i}", 0))
            s.setblocking(False)
            out.append(s)
        return out

    def _connect_thrift(self) -> bool:
        def connect() -> socket.socket | None:
            s = socket.socket()
            if s.connect_ex(("127.0.0.1", THRIFT_PORT)) != 0:
                s.close()
                return None
            return s

        sock = in_namespace(self.name, connect)
        if sock is not None:
            self.thrift = ThriftRuntime(sock)
        return sock is not None

    def log(self) -> str:
        try:
            with open(os.path.join(self.dir, "switch.out")) as f:
                return f.read()[-2000:]
        except OSError:
            return "(no log)"

    def send(self, port: int, frame: bytes) -> None:
        self.sockets[port].send(frame)

    def receive(self, is_marker: Callable[[int, bytes], bool], markers: int,
                timeout: float) -> list[tuple[int, bytes]]:
        """Every frame the switch sends out of its ports, (port, frame) in arrival order per port, until
        ``markers`` frames for which is_marker(port, frame) holds have arrived (they are not returned);
        TimeoutError after ``timeout`` seconds."""
        got: list[tuple[int, bytes]] = []
        seen = 0
        deadline = time.monotonic() + timeout
        while seen < markers:
            left = min(deadline - time.monotonic(), 1.0)
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"simple_switch_grpc exited ({self.process.returncode}): {self.log()}")
            if left <= 0:
                raise TimeoutError(f"the switch sent {seen} of {markers} markers within {timeout} s "
                                   f"(and {len(got)} other frames)")
            ready, _, _ = select.select(self.sockets, [], [], left)
            for s in ready:
                port = self.sockets.index(s)
                while True:
                    try:
                        frame, address = s.recvfrom(65536)
                    except BlockingIOError:
                        break
                    if address[2] == socket.PACKET_OUTGOING:
                        continue  # what the test sent on this port
                    if is_marker(port, frame):
                        seen += 1
                    else:
                        got.append((port, frame))
        return got

    def stop(self) -> None:
        if self.thrift is not None:
            self.thrift.close()
        for s in self.sockets:
            s.close()
        if self.process is not None:
            stop_process(self.process)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)  # its veths go with it
        shutil.rmtree(self.dir, ignore_errors=True)
