"""Batched UDP over IPv4: ``sendmmsg``/``recvmmsg`` through ctypes, buffers in numpy.

One syscall moves a whole batch of datagrams. The message headers, I/O vectors and
socket addresses live in numpy arrays laid out like the kernel's structs (Linux,
64-bit), so preparing a batch is a few vectorised assignments, not a Python loop.
Addresses are packed into one int64, ``ip << 16 | port``, so that they can be
compared and indexed as numpy arrays.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import socket
import struct
import sys
from dataclasses import dataclass

import numpy as np

from . import wire

if sys.platform != "linux" or struct.calcsize("P") != 8:
    raise ImportError("passing.transport needs 64-bit Linux (sendmmsg/recvmmsg)")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_sendmmsg = _libc.sendmmsg
_sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
_sendmmsg.restype = ctypes.c_int
_recvmmsg = _libc.recvmmsg
_recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
_recvmmsg.restype = ctypes.c_int

MSG_DONTWAIT = 0x40
AF_INET = 2

# struct mmsghdr { struct msghdr msg_hdr; unsigned int msg_len; } on x86_64/aarch64.
MMSGHDR = np.dtype(
    {
        "names": ["name", "namelen", "iov", "iovlen", "control", "controllen", "flags", "len"],
        "formats": ["u8", "u4", "u8", "u8", "u8", "u8", "i4", "u4"],
        "offsets": [0, 8, 16, 24, 32, 40, 48, 56],
        "itemsize": 64,
    }
)
IOVEC = np.dtype([("base", "u8"), ("len", "u8")])
SOCKADDR_IN = np.dtype([("family", "<u2"), ("port", ">u2"), ("addr", ">u4"), ("zero", "u8")])


def pack_address(host: str, port: int) -> int:
    """An (IPv4, UDP port) pair as one int64: ip << 16 | port."""
    ip = struct.unpack("!I", socket.inet_aton(socket.gethostbyname(host)))[0]
    if not 0 <= port < 1 << 16:
        raise ValueError(f"port {port} out of range")
    return ip << 16 | port


def unpack_address(packed: int) -> tuple[str, int]:
    return socket.inet_ntoa(struct.pack("!I", int(packed) >> 16)), int(packed) & 0xFFFF


def parse_endpoint(text: str, default_port: int) -> tuple[str, int]:
    """'host:port' or 'host' -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, default_port
    try:
        return host, int(port)
    except ValueError:
        raise ValueError(f"bad endpoint {text!r}: expected host:port") from None


@dataclass
class TransportStats:
    packets_sent: int = 0
    bytes_sent: int = 0
    packets_received: int = 0
    bytes_received: int = 0
    retransmissions: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class BatchSocket:
    """A non-blocking UDP socket that sends and receives batches of datagrams."""

    def __init__(self, bind: tuple[str, int] = ("0.0.0.0", 0), batch: int = 1024, max_datagram: int = 9000,
                 buffer_bytes: int = 8 << 20) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        for force, plain in ((33, socket.SO_RCVBUF), (32, socket.SO_SNDBUF)):  # SO_*BUFFORCE needs root
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, force, buffer_bytes)
            except OSError:
                self.sock.setsockopt(socket.SOL_SOCKET, plain, buffer_bytes)
        try:
            self.sock.bind(bind)
        except OSError as e:
            self.sock.close()
            raise OSError(e.errno, f"cannot bind UDP {bind[0]}:{bind[1]}: {e.strerror}") from None
        self.fd = self.sock.fileno()
        self.batch = batch
        self.max_datagram = max_datagram
        self.stats = TransportStats()
        # Receive side: fixed buffers the kernel fills in place.
        self._rx_buf = np.zeros((batch, max_datagram), dtype=np.uint8)
        self._rx_names = np.zeros(batch, dtype=SOCKADDR_IN)
        self._rx_iov = np.zeros(batch, dtype=IOVEC)
        self._rx_iov["base"] = _addr(self._rx_buf) + np.arange(batch, dtype=np.uint64) * max_datagram
        self._rx_iov["len"] = max_datagram
        self._rx_msgs = np.zeros(batch, dtype=MMSGHDR)
        self._rx_msgs["name"] = _addr(self._rx_names) + np.arange(batch, dtype=np.uint64) * SOCKADDR_IN.itemsize
        self._rx_msgs["iov"] = _addr(self._rx_iov) + np.arange(batch, dtype=np.uint64) * IOVEC.itemsize
        self._rx_msgs["iovlen"] = 1
        self._rx_msgs["namelen"] = SOCKADDR_IN.itemsize
        # Send side: headers are filled per batch.
        self._tx_names = np.zeros(batch, dtype=SOCKADDR_IN)
        self._tx_names["family"] = AF_INET
        self._tx_iov = np.zeros(batch, dtype=IOVEC)
        self._tx_msgs = np.zeros(batch, dtype=MMSGHDR)
        self._tx_msgs["name"] = _addr(self._tx_names) + np.arange(batch, dtype=np.uint64) * SOCKADDR_IN.itemsize
        self._tx_msgs["namelen"] = SOCKADDR_IN.itemsize
        self._tx_msgs["iov"] = _addr(self._tx_iov) + np.arange(batch, dtype=np.uint64) * IOVEC.itemsize
        self._tx_msgs["iovlen"] = 1
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> BatchSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_readable(self, timeout: float) -> bool:
        return bool(self._poll.poll(max(0, int(timeout * 1000))))

    def recv_batch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Whatever is queued, up to ``batch`` datagrams, without blocking.

        Returns ``(buffers, lengths, sources)``: a (count, max_datagram) uint8 view of
        the receive buffer (valid until the next call), datagram sizes, packed origins.
        """
        n = _recvmmsg(self.fd, _addr(self._rx_msgs), self.batch, MSG_DONTWAIT, None)
        if n < 0:
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR, errno.ECONNREFUSED):
                n = 0  # ECONNREFUSED: an ICMP error for an earlier datagram, not for this call
            else:
                raise OSError(err, f"recvmmsg: {os.strerror(err)}")
        lengths = self._rx_msgs["len"][:n].astype(np.int64)
        names = self._rx_names[:n]
        sources = (names["addr"].astype(np.int64) << 16) | names["port"].astype(np.int64)
        self._rx_msgs["namelen"][:n] = SOCKADDR_IN.itemsize
        self.stats.packets_received += n
        self.stats.bytes_received += int(lengths.sum())
        return self._rx_buf[:n], lengths, sources

    def recv_packets(self, lanes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Like recv_batch, but the buffers viewed as a packet array (no copy).

        Rows whose length is not a full packet hold garbage beyond the datagram:
        callers must check ``lengths`` (``wire.well_formed`` does).
        """
        buffers, lengths, sources = self.recv_batch()
        dtype = wire.packet_dtype(lanes)
        if dtype.itemsize > self.max_datagram:
            raise ValueError(f"{lanes} lanes do not fit in {self.max_datagram}-byte datagrams")
        view = np.ndarray(shape=(len(lengths),), dtype=dtype, buffer=self._rx_buf, strides=(self.max_datagram,))
        return view, lengths, sources

    def send_batch(self, packets: np.ndarray, dest: np.ndarray | int, rows: np.ndarray | None = None,
                   timeout: float = 5.0) -> None:
        """Send ``packets[rows]`` (all when rows is None), each to its packed ``dest``.

        The datagrams are read in place from ``packets`` (a contiguous structured
        array), so nothing is copied. Blocks while the socket buffer is full, up to
        ``timeout`` seconds, then raises TimeoutError.
        """
        if rows is None:
            rows = np.arange(len(packets))
        count = len(rows)
        if count == 0:
            return
        if not packets.flags.c_contiguous:
            raise ValueError("packets must be a contiguous array")
        size = packets.dtype.itemsize
        dest = np.broadcast_to(np.asarray(dest, dtype=np.int64), (count,))
        base = _addr(packets)
        done = 0
        while done < count:
            k = min(self.batch, count - done)
            chunk = slice(done, done + k)
            self._tx_iov["base"][:k] = base + rows[chunk].astype(np.uint64) * size
            self._tx_iov["len"][:k] = size
            self._tx_names["addr"][:k] = dest[chunk] >> 16
            self._tx_names["port"][:k] = dest[chunk] & 0xFFFF
            sent = _sendmmsg(self.fd, _addr(self._tx_msgs), k, 0)
            if sent < 0:
                err = ctypes.get_errno()
                if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS):
                    if not select.select([], [self.fd], [], timeout)[1]:
                        raise TimeoutError(f"UDP send buffer stayed full for {timeout} s")
                    continue
                if err == errno.EINTR:
                    continue
                if err == errno.ECONNREFUSED:  # an ICMP error from an earlier datagram
                    continue
                raise OSError(err, f"sendmmsg: {os.strerror(err)}")
            done += sent
            self.stats.packets_sent += sent
            self.stats.bytes_sent += sent * size
