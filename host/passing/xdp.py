"""The AF_XDP I/O path (host/csrc/xsk.c): choosing it for a socket, or the UDP sockets with the reason.

``io="auto"`` (the default of a Group and of the software aggregator) takes AF_XDP where it can run and pays:
the library was built with it (libxdp, libbpf and clang at install: host/setup.py), the engine is the native
one, the socket is bound to an interface's address (not 0.0.0.0, not loopback: ``lo`` has no XDP receive path
an XSK could use), the packets fit the XSK's 2 KiB frames, the interface's driver binds XSK sockets zero-copy
(copy mode, veth's and generic XDP's, costs a kernel packet per frame, where the UDP sockets' GSO/GRO move 64
in one: slower, docs/benchmarks.md), the process may load XDP programs (CAP_BPF, CAP_NET_ADMIN), the
interface has no other XDP program and its queue 0 no other XSK socket. Elsewhere the UDP sockets, with a
one-line reason in the log (INFO) and in ``io_reason``. ``io="udp"`` forces the sockets; ``io="xdp"`` forces
AF_XDP, copy mode included, and raises, with the reason, where it cannot run.

The XSK works beside the socket, never instead of it: datagrams are read from both (one the XDP program
passed on, from another queue of a multi-queue NIC or another interface, still arrives), and packets go
through the XSK to every destination whose MAC it learned from a received frame (or was told:
``add_neighbor``), the others through the socket (the kernel resolves their address). The wire is the
same either way but for the UDP checksum, which the XSK leaves 0 (none, as IPv4 allows).
"""

from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import logging
import socket
import struct
from typing import Any

from . import native, wire

IO_PATHS = ("auto", "udp", "xdp")
FRAME_ROOM = 2048 - 256 - 42  # an XSK frame less the kernel's XDP headroom and the Ethernet/IPv4/UDP headers
SIOCGIFADDR = 0x8915
ZEROCOPY_ONLY = 2  # pn_xsk_open's PN_XSK_ZEROCOPY_ONLY: what io="auto" asks

log = logging.getLogger("passing.xdp")


class XskStats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "rx_packets", "tx_packets", "rx_foreign", "tx_spilled", "kicks", "tx_waits", "ring_rx_dropped",
        "ring_rx_full", "ring_fill_empty", "ring_tx_invalid")] + [
        ("zerocopy", ctypes.c_int32), ("driver_mode", ctypes.c_int32), ("ifindex", ctypes.c_uint32),
        ("queue", ctypes.c_uint32)]


_PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "pn_xdp_built": (ctypes.c_int, []),
    "pn_xsk_open": (ctypes.c_void_p, [ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
                                      ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int, ctypes.c_char_p,
                                      ctypes.c_uint32]),
    "pn_xsk_close": (None, [ctypes.c_void_p]),
    "pn_xsk_get_stats": (None, [ctypes.c_void_p, ctypes.POINTER(XskStats)]),
    "pn_xsk_add_neighbor": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_char_p]),
}


def _lib() -> ctypes.CDLL:
    lib = native.lib()
    if not getattr(lib, "_passing_xdp", False):
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        lib._passing_xdp = True
    return lib


def built() -> bool:
    """Whether the native library here was built with the AF_XDP path."""
    try:
        return bool(_lib().pn_xdp_built())
    except (native.NativeUnavailable, AttributeError):
        return False


def interface_of(ip: str) -> tuple[str, int] | None:
    """The interface (name, index) that holds IPv4 address ``ip``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for index, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(answer[20:24]) == ip:
                return name, index
    return None


class XdpPath:
    """An open XSK beside a socket (pn_xsk_open); closed with the socket."""

    def __init__(self, handle: int, interface: str) -> None:
        self.handle: int | None = handle
        self.interface = interface

    def stats(self) -> dict[str, int]:
        out = XskStats()
        if self.handle:
            _lib().pn_xsk_get_stats(self.handle, ctypes.byref(out))
        return {name: int(getattr(out, name)) for name, _ in XskStats._fields_}

    def add_neighbor(self, ip: str, mac: bytes) -> None:
        if self.handle and _lib().pn_xsk_add_neighbor(self.handle, int(ipaddress.IPv4Address(ip)), mac) != 0:
            raise RuntimeError(f"AF_XDP: no room for the MAC of {ip}")

    def describe(self) -> str:
        s = self.stats()
        return (f"AF_XDP on {self.interface} queue {s['queue']}, {'driver' if s['driver_mode'] else 'generic'} XDP, "
                f"{'zero-copy' if s['zerocopy'] else 'copy mode'}")

    def close(self) -> None:
        if self.handle:
            _lib().pn_xsk_close(self.handle)
            self.handle = None


def _why_not(sock: Any, lanes: int, engine_native: bool, clip: bool) -> str:
    """'' where AF_XDP may be tried for this socket, else the reason it cannot."""
    if not engine_native:
        return "the numpy engine has no AF_XDP path"
    if not built():
        try:
            native.lib()
        except native.NativeUnavailable as e:
            return str(e)
        return "the library was built without AF_XDP (libxdp-dev, libbpf-dev and clang at install: README)"
    ip = sock.address[0]
    if ip == "0.0.0.0":
        return "the socket is bound to 0.0.0.0: AF_XDP needs the data interface's address"
    if ipaddress.IPv4Address(ip).is_loopback:
        return "loopback: lo has no XDP receive path for an XSK socket"
    if wire.packet_size(lanes) > FRAME_ROOM and not clip:
        return f"packets of {wire.packet_size(lanes)} bytes exceed an XSK frame's {FRAME_ROOM}"
    return ""


def open_path(io: str, sock: Any, lanes: int, engine_native: bool, clip: bool = False) \
        -> tuple[XdpPath | None, str]:
    """The AF_XDP path for ``sock`` (a bound passing.transport.BatchSocket) per ``io``, or None and why not.
    ``clip`` (an aggregator, whose socket is sized for the widest job): packets up to a frame go through the XSK,
    longer ones through the socket; else packets too long for a frame rule AF_XDP out."""
    if io not in IO_PATHS:
        raise ValueError(f"io must be one of {IO_PATHS}, got {io!r}")
    if io == "udp":
        return None, "io='udp' asked for the UDP sockets"
    why = _why_not(sock, lanes, engine_native, clip)
    found = None if why else interface_of(sock.address[0])
    if not why and found is None:
        why = f"no interface holds {sock.address[0]}"
    path = None
    if not why and found is not None:
        error = ctypes.create_string_buffer(200)
        ip, port = sock.address
        handle = _lib().pn_xsk_open(sock.fd, found[1], 0, int(ipaddress.IPv4Address(ip)), port,
                                    min(wire.packet_size(lanes), FRAME_ROOM),
                                    ZEROCOPY_ONLY if io == "auto" else 0, error, len(error))
        if handle:
            path = XdpPath(handle, found[0])
        else:
            why = f"{found[0]}: {error.value.decode(errors='replace')}"
    if path is None:
        if io == "xdp":
            raise OSError(f"io='xdp': AF_XDP cannot run for {sock.address[0]}:{sock.address[1]}: {why}")
        log.info("passing: UDP sockets for %s:%d, not AF_XDP: %s", *sock.address, why)
        return None, why
    reason = path.describe()
    log.info("passing: %s for %s:%d", reason, *sock.address)
    return path, reason
