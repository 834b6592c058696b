"""Batched UDP over IPv4: ``sendmmsg``/``recvmmsg`` through ctypes, buffers in numpy.

One syscall moves a whole batch of datagrams. The message headers, I/O vectors and
socket addresses live in numpy arrays laid out like the kernel's structs (Linux,
64-bit), so preparing a batch is a few vectorised assignments, not a Python loop.
Addresses are packed into one int64, ``ip << 16 | port``, so that they can be
compared and indexed as numpy arrays.

Where the kernel offers them, UDP segmentation offload (GSO: consecutive packets to
the same address leave as one message that the stack segments late) and UDP receive
coalescing (GRO: same-flow packets arrive as one buffer) cut the per-packet kernel
cost many times over. On the wire every packet is still its own datagram; a receiver
without GRO, or a switch, sees ordinary packets.
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
from typing import Any

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
SOL_UDP = 17
UDP_SEGMENT = 103  # cmsg: segment size of a GSO message
UDP_GRO = 104  # sockopt: deliver coalesced buffers; cmsg: their segment size
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # like SO_SNDBUF/SO_RCVBUF past the sysctl cap (root only)
GSO_MAX_BYTES = 65000  # a GSO message is one UDP datagram before segmentation
MAX_SEGMENTS = 64  # the kernel's UDP_MAX_SEGMENTS on older kernels

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
CMSG = np.dtype([("len", "u8"), ("level", "i4"), ("type", "i4"), ("data", "i4"), ("pad", "u4")])  # 24 bytes


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
    early_retransmissions: int = 0  # of them, resent on evidence: a later packet was answered (the others: probes)
    foreign_results: int = 0  # RESULTs of another job id or generation, ignored
    gso_fallbacks: int = 0  # GSO messages the kernel refused, resent as plain datagrams

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class SendError(OSError):
    """The kernel refused a packet of a batch; ``sent`` packets of the batch left before it."""

    def __init__(self, err: int, message: str, sent: int) -> None:
        super().__init__(err, message)
        self.sent = sent


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _row_addresses(array: np.ndarray, count: int) -> np.ndarray:
    return _addr(array) + np.arange(count, dtype=np.uint64) * array.dtype.itemsize


class BatchSocket:
    """A non-blocking UDP socket that moves batches of PASSING packets.

    ``lanes`` fixes the receive rows' size, the largest packet expected: each received
    datagram gets a row of its own with its bytes at the start, and its true length (a
    longer one shows as longer than the row, for the caller to count as malformed). Sends
    take any packet size up to the row size.
    ``offload=False`` turns GSO/GRO off (one kernel datagram per packet everywhere).
    """

    def __init__(self, bind: tuple[str, int] = ("0.0.0.0", 0), lanes: int = wire.DEFAULT_LANES,
                 batch: int = 256, offload: bool = True, buffer_bytes: int = 16 << 20) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        for force, plain in ((SO_RCVBUFFORCE, socket.SO_RCVBUF), (SO_SNDBUFFORCE, socket.SO_SNDBUF)):
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
        self.dtype = wire.packet_dtype(lanes)
        self.size = self.dtype.itemsize
        self.stats = TransportStats()
        # the AF_XDP path beside this socket (passing.xdp.open_path: a Group or an aggregator opens it), or
        # None: the socket alone; io_reason says which and why
        self.xsk: Any = None
        self.io_reason = "the UDP socket (no AF_XDP path opened)"
        self._xsk_closed: dict[str, int] | None = None  # the XSK's last counters, once closed
        self.gro = offload and self._try_gro()
        self.gso = offload  # a message the kernel refuses goes as plain datagrams; GSO stays on

        # Receive side: `batch` message buffers the kernel fills in place. A buffer is a
        # whole number of packet rows, so the segments of a coalesced buffer are rows.
        self.rows_per_msg = (65536 // self.size + 2) if self.gro else 2  # 2: a longer datagram shows as longer
        self._rx = np.zeros((batch * self.rows_per_msg, self.size), dtype=np.uint8)
        self._rx_names = np.zeros(batch, dtype=SOCKADDR_IN)
        self._rx_iov = np.zeros(batch, dtype=IOVEC)
        self._rx_iov["base"] = _addr(self._rx) + np.arange(batch, dtype=np.uint64) * (self.rows_per_msg * self.size)
        self._rx_iov["len"] = self.rows_per_msg * self.size
        self._rx_cmsg = np.zeros(batch, dtype=CMSG)
        self._rx_msgs = np.zeros(batch, dtype=MMSGHDR)
        self._rx_msgs["name"] = _row_addresses(self._rx_names, batch)
        self._rx_msgs["iov"] = _row_addresses(self._rx_iov, batch)
        self._rx_msgs["iovlen"] = 1
        if self.gro:
            self._rx_msgs["control"] = _row_addresses(self._rx_cmsg, batch)

        # Send side: one iovec per packet, messages grouping consecutive packets.
        self.tx_packets = 4096
        self._tx_iov = np.zeros(self.tx_packets, dtype=IOVEC)
        self._tx_names = np.zeros(1024, dtype=SOCKADDR_IN)  # UIO_MAXIOV messages per sendmmsg
        self._tx_names["family"] = AF_INET
        self._tx_msgs = np.zeros(1024, dtype=MMSGHDR)
        self._tx_msgs["name"] = _row_addresses(self._tx_names, 1024)
        self._tx_msgs["namelen"] = SOCKADDR_IN.itemsize
        self._tx_cmsg = np.zeros(1, dtype=CMSG)
        self._tx_cmsg[0] = (16 + 2, SOL_UDP, UDP_SEGMENT, self.size, 0)  # CMSG_LEN(2); data: u16 segment size,
        # which each send sets to its packets' size
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)

    def _try_gro(self) -> bool:
        try:
            self.sock.setsockopt(SOL_UDP, UDP_GRO, 1)
            return True
        except OSError:
            return False

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    @property
    def io_path(self) -> str:
        """'xdp' where an AF_XDP path works beside the socket, else 'udp'."""
        return "xdp" if self.xsk is not None or self._xsk_closed is not None else "udp"

    def xsk_stats(self) -> dict[str, int] | None:
        """The AF_XDP path's counters (passing.xdp.XskStats; its last ones once closed), or None without one."""
        return self.xsk.stats() if self.xsk is not None else self._xsk_closed

    def open_io(self, io: str, engine_native: bool, clip: bool = False) -> None:
        """Open the AF_XDP path beside this socket per ``io`` (passing.xdp.open_path), once."""
        from . import xdp

        if self.xsk is None:
            self.xsk, self.io_reason = xdp.open_path(io, self, (self.size - wire.HEADER_SIZE) // 4, engine_native,
                                                     clip)

    def close(self) -> None:
        if self.xsk is not None:
            self._xsk_closed = self.xsk.stats()
            self.xsk.close()
            self.xsk = None
        self.sock.close()

    def __enter__(self) -> BatchSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_readable(self, timeout: float) -> bool:
        return bool(self._poll.poll(max(0, int(timeout * 1000))))

    def recv_packets(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Whatever is queued, without blocking: ``(packets, lengths, sources)``.

        ``packets`` is a new packet array (one row per received datagram, coalesced
        buffers split), ``lengths`` the datagram sizes (rows whose length is not the
        packet size hold garbage past it: ``wire.well_formed`` checks), ``sources``
        the packed origins.
        """
        msgs = self._rx_msgs
        batch = len(msgs)
        msgs["namelen"] = SOCKADDR_IN.itemsize
        if self.gro:
            msgs["controllen"] = CMSG.itemsize
        n = _recvmmsg(self.fd, _addr(msgs), batch, MSG_DONTWAIT, None)
        if n < 0:
            err = ctypes.get_errno()
            if err not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR, errno.ECONNREFUSED):
                raise OSError(err, f"recvmmsg: {os.strerror(err)}")
            n = 0  # ECONNREFUSED: an ICMP error for an earlier datagram, not for this call
        length = msgs["len"][:n].astype(np.int64)
        names = self._rx_names[:n]
        source = (names["addr"].astype(np.int64) << 16) | names["port"].astype(np.int64)
        segment = length.copy()
        if self.gro:
            c = self._rx_cmsg[:n]
            coalesced = (msgs["controllen"][:n] >= 20) & (c["level"] == SOL_UDP) & (c["type"] == UDP_GRO)
            segment = np.where(coalesced & (c["data"] > 0), c["data"], length)
        count = np.where(length > 0, -(-length // np.maximum(segment, 1)), 1)
        msg = np.repeat(np.arange(n), count)
        j = np.arange(msg.size) - np.repeat(np.cumsum(count) - count, count)
        seg_len = np.minimum(segment[msg], length[msg] - j * segment[msg])
        # Segments of the packet size sit on row boundaries; any other size is malformed
        # and only its length matters, so its row index may point anywhere in the buffer.
        rows = msg * self.rows_per_msg + np.where(segment[msg] == self.size, j, 0)
        packets = self._rx[rows].view(self.dtype).reshape(-1)
        odd = (count > 1) & (segment != self.size)  # coalesced datagrams of another size: off the row boundaries
        if odd.any():
            self._place_segments(packets, count, segment, odd)
        self.stats.packets_received += msg.size
        self.stats.bytes_received += int(length.sum())
        return packets, seg_len, source[msg]

    def _place_segments(self, packets: np.ndarray, count: np.ndarray, segment: np.ndarray, odd: np.ndarray) -> None:
        """Copy the segments of the coalesced messages ``odd`` (of a size other than the rows') into
        their rows of ``packets``: one strided copy per message."""
        raw = packets.view(np.uint8).reshape(len(packets), self.size)
        buffer = self._rx.reshape(-1)
        msg_bytes = self.rows_per_msg * self.size  # room for 64 KiB and two rows more: every view stays inside
        first = np.cumsum(count) - count
        for i in np.flatnonzero(odd):
            c, step = int(count[i]), int(segment[i])
            width = min(step, self.size)  # a longer datagram is malformed: its length says so, its row is cut
            segments = np.lib.stride_tricks.as_strided(buffer[i * msg_bytes:], shape=(c, width), strides=(step, 1))
            raw[first[i] : first[i] + c, :width] = segments

    def send_batch(self, packets: np.ndarray, dest: np.ndarray | int, rows: np.ndarray | None = None,
                   timeout: float = 5.0, size: int | None = None) -> None:
        """Send ``packets[rows]`` (all when rows is None), each to its packed ``dest``.

        The datagrams are read in place from ``packets`` (a contiguous packet array), nothing
        is copied: the first ``size`` bytes of each row (default: the whole row, at most this
        socket's row size). Consecutive packets to the same destination share a GSO message;
        one the kernel refuses is resent as plain datagrams (``stats.gso_fallbacks``), and GSO
        stays on. Blocks while the socket buffer is full, up to ``timeout`` seconds, then raises
        TimeoutError; a packet the kernel refuses raises SendError, which says how many packets
        left before it.
        """
        size = packets.dtype.itemsize if size is None else size
        if not packets.flags.c_contiguous or not 0 < size <= min(packets.dtype.itemsize, self.size):
            raise ValueError(f"packets must be a contiguous packet array, sent {size} bytes of each row "
                             f"(at most {self.size})")
        count = len(packets) if rows is None else len(rows)
        if count == 0:
            return
        max_segments = max(1, min(MAX_SEGMENTS, GSO_MAX_BYTES // size))
        self._tx_cmsg["data"] = size  # GSO cuts each message into datagrams of this size
        rows = np.arange(count) if rows is None else np.asarray(rows)
        dest = np.broadcast_to(np.asarray(dest, dtype=np.int64), (count,))
        base = _addr(packets)
        done = 0
        while done < count:
            k = min(self.tx_packets, count - done)
            chunk = slice(done, done + k)
            self._tx_iov["base"][:k] = base + rows[chunk].astype(np.uint64) * packets.dtype.itemsize
            self._tx_iov["len"][:k] = size
            first, per_msg = self._messages(dest[chunk], max_segments)
            try:
                sent = self._sendmmsg(dest[chunk][first], first, per_msg, timeout)
            except SendError as e:
                self.stats.packets_sent += e.sent
                self.stats.bytes_sent += e.sent * size
                raise SendError(e.errno, e.strerror, done + e.sent) from None
            done += sent
            self.stats.packets_sent += sent
            self.stats.bytes_sent += sent * size

    def _messages(self, dest: np.ndarray, max_segments: int) -> tuple[np.ndarray, np.ndarray]:
        """Cut a chunk into messages: runs of one destination, at most max_segments long."""
        i = np.arange(dest.size)
        change = np.r_[True, dest[1:] != dest[:-1]]
        if not self.gso:
            first = i
        else:
            run_start = np.maximum.accumulate(np.where(change, i, 0))
            first = np.flatnonzero(change | ((i - run_start) % max_segments == 0))
        ends = np.r_[first[1:], dest.size]
        return first[:1024], (ends - first)[:1024]  # at most UIO_MAXIOV messages per sendmmsg

    def _sendmmsg(self, msg_dest: np.ndarray, first: np.ndarray, per_msg: np.ndarray, timeout: float) -> int:
        """Send the messages; returns how many packets left (at least one message's worth)."""
        m = first.size
        msgs = self._tx_msgs
        self._tx_names["addr"][:m] = msg_dest >> 16
        self._tx_names["port"][:m] = msg_dest & 0xFFFF
        msgs["iov"][:m] = _addr(self._tx_iov) + first.astype(np.uint64) * IOVEC.itemsize
        msgs["iovlen"][:m] = per_msg
        gso = (per_msg > 1) & self.gso  # a message of one packet needs no segmentation
        msgs["control"][:m] = np.where(gso, _addr(self._tx_cmsg), 0)
        msgs["controllen"][:m] = np.where(gso, CMSG.itemsize, 0)
        while True:
            sent = _sendmmsg(self.fd, _addr(msgs), m, 0)
            if sent > 0:
                return int(per_msg[:sent].sum())
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS):
                self._wait_writable(timeout)
            elif err in (errno.EIO, errno.EINVAL, errno.EMSGSIZE) and gso[0]:
                # The kernel refused this one GSO message: a path that cannot segment (EIO), an
                # MTU below the segment size (EMSGSIZE), a destination it refuses anyway, such as
                # port 0 (EINVAL). Its packets go as plain datagrams; GSO stays on for the others.
                self.stats.gso_fallbacks += 1
                return self._send_plain(int(msg_dest[0]), int(first[0]), int(per_msg[0]), timeout)
            elif err not in (errno.EINTR, errno.ECONNREFUSED):  # ECONNREFUSED: ICMP of an earlier datagram
                raise SendError(err, f"sendmmsg: {os.strerror(err)}", 0)

    def _send_plain(self, dest: int, first: int, count: int, timeout: float) -> int:
        """Send the iovecs [first, first + count) to dest as one datagram each; returns count."""
        msgs = self._tx_msgs
        self._tx_names["addr"][:count] = dest >> 16
        self._tx_names["port"][:count] = dest & 0xFFFF
        msgs["iov"][:count] = _addr(self._tx_iov) + (first + np.arange(count, dtype=np.uint64)) * IOVEC.itemsize
        msgs["iovlen"][:count] = 1
        msgs["control"][:count] = 0
        msgs["controllen"][:count] = 0
        done = 0
        while done < count:
            sent = _sendmmsg(self.fd, _addr(msgs) + done * MMSGHDR.itemsize, count - done, 0)
            if sent > 0:
                done += sent
                continue
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS):
                self._wait_writable(timeout)
            elif err not in (errno.EINTR, errno.ECONNREFUSED):
                raise SendError(err, f"sendmmsg: {os.strerror(err)}", done)
        return count

    def _wait_writable(self, timeout: float) -> None:
        if not select.select([], [self.fd], [], timeout)[1]:
            raise TimeoutError(f"UDP send buffer stayed full for {timeout} s")
