"""The PASSING wire format, defined once for Python (docs/protocol.md has the prose).

A PASSING packet is the UDP payload ``header | payload``: a 16-byte header and
``lanes`` big-endian int32 values. Batches of packets are numpy structured arrays
whose memory is exactly the bytes on the wire, so a batch is sent or received with
one ``sendmmsg``/``recvmmsg`` and no per-packet Python work.
"""

from __future__ import annotations

import numpy as np

VERSION = 3  # 3: owner in byte 9, OWNER_ONLY, ACK/GATHER/NACK; 2: the generation in bytes 10-11
UDP_PORT = 9877  # well-known PASSING port: DATA goes to it, RESULT comes from it
DEFAULT_LANES = 64  # int32 values per packet (the P4 program's compile-time constant)
MAX_WORKERS = 32  # one bit per worker in the 32-bit bitmap
GENERATIONS = 1 << 16  # generation numbers wrap around at this

# type
DATA = 1  # host -> aggregator: a contribution to a round
RESULT = 2  # aggregator -> host: a completed round's sums
ACK = 3  # aggregator -> host, header only: an OWNER_ONLY round is complete, its sums went to its owner
GATHER = 4  # host -> aggregator -> every other worker: a piece of the sender's data, relayed unchanged
NACK = 5  # host -> aggregator -> owner: send GATHER positions psn .. psn + slot - 1 again
RELAYED = (GATHER, NACK)  # the kinds an aggregator replicates without state

# op
SUM = 0
MAX = 1

# flags
FLAG_OVERFLOW = 0x01  # a lane saturated (set by the aggregator, or by a host whose quantization saturated)
FLAG_RETRANSMIT = 0x02  # set by a host that resends a packet
FLAG_OWNER_ONLY = 0x04  # on DATA: the round's sums go to its owner alone, the others get an ACK

OWNER_SHIFT = 1  # byte 9 ("set"): bits 7..1 the owner, bit 0 the set
MAX_OWNER = 0x7F

HEADER_DTYPE = np.dtype(
    [
        ("version", "u1"),
        ("type", "u1"),
        ("op", "u1"),
        ("flags", "u1"),
        ("job", ">u2"),
        ("slot", ">u2"),
        ("worker", "u1"),
        ("set", "u1"),  # bit 0 the set; bits 7..1 the owner (owner_set, owner_of)
        ("generation", ">u2"),  # which allocation of this job id the packet belongs to
        ("psn", ">u4"),
    ]
)
HEADER_SIZE = HEADER_DTYPE.itemsize
assert HEADER_SIZE == 16

INT32_MAX = np.iinfo(np.int32).max
INT32_MIN = np.iinfo(np.int32).min


class WireError(ValueError):
    """A buffer that is not a well-formed PASSING packet."""


def packet_dtype(lanes: int = DEFAULT_LANES) -> np.dtype:
    """The dtype of one whole packet (header + payload) with ``lanes`` int32 values."""
    if lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {lanes}")
    return np.dtype([("hdr", HEADER_DTYPE), ("payload", ">i4", (lanes,))])


def packet_size(lanes: int = DEFAULT_LANES) -> int:
    return HEADER_SIZE + 4 * lanes


def empty(count: int, lanes: int = DEFAULT_LANES) -> np.ndarray:
    """A zeroed batch of ``count`` packets with version already set."""
    batch = np.zeros(count, dtype=packet_dtype(lanes))
    batch["hdr"]["version"] = VERSION
    return batch


def encode(
    *,
    type: int,
    job: int,
    worker: int,
    psn: int | np.ndarray,
    payload: np.ndarray | list[int],
    slot: int | np.ndarray | None = None,
    set: int | np.ndarray | None = None,
    pool: int | None = None,
    op: int = SUM,
    flags: int | np.ndarray = 0,
    generation: int = 0,
    lanes: int = DEFAULT_LANES,
    owner: int | np.ndarray = 0,
) -> np.ndarray:
    """Build a batch of packets; scalars broadcast over the batch.

    ``payload`` is one row of ``lanes`` values or one row per packet. Give either
    ``slot`` and ``set`` explicitly or ``pool`` to derive them from the psn.
    """
    psn_arr = np.atleast_1d(np.asarray(psn, dtype=np.int64))
    rows = np.asarray(payload, dtype=np.int64)
    if rows.ndim == 1:
        rows = np.broadcast_to(rows, (psn_arr.size, rows.size))
    if rows.shape != (psn_arr.size, lanes):
        raise WireError(f"payload shape {rows.shape} does not match ({psn_arr.size}, {lanes})")
    if (rows > INT32_MAX).any() or (rows < INT32_MIN).any():
        raise WireError("payload value out of int32 range")
    if slot is None or set is None:
        if pool is None:
            raise ValueError("give slot and set, or pool to derive them from psn")
        slot, set = slot_and_set(psn_arr, pool)
    batch = empty(psn_arr.size, lanes)
    hdr = batch["hdr"]
    hdr["type"] = type
    hdr["op"] = op
    hdr["flags"] = flags
    hdr["job"] = job
    hdr["generation"] = generation
    hdr["worker"] = worker
    hdr["slot"] = slot
    hdr["set"] = owner_set(owner, set)
    hdr["psn"] = psn_arr & 0xFFFFFFFF
    batch["payload"] = rows
    return batch


def slot_and_set(position: np.ndarray | int, pool: int) -> tuple[np.ndarray, np.ndarray]:
    """Where the packet at stream position p lives: slot p mod pool, set (p div pool) mod 2.

    p is the group's unwrapped packet counter (0, 1, 2, ... over the allocation's life; its psn
    on the wire is p mod 2^32): every pool size gives p and p + pool the same slot, across the
    psn's wrap too (docs/protocol.md, The stream)."""
    p = np.asarray(position, dtype=np.int64)
    return p % pool, (p // pool) % 2


def owner_set(owner: int | np.ndarray, set: int | np.ndarray) -> np.ndarray:
    """Byte 9: the owner (0..127) in bits 7..1, the set (0 or 1) in bit 0."""
    owner = np.asarray(owner, dtype=np.int64)
    if ((owner < 0) | (owner > MAX_OWNER)).any():
        raise WireError(f"owner outside 0..{MAX_OWNER}")
    return (owner << OWNER_SHIFT) | (np.asarray(set, dtype=np.int64) & 1)


def owner_of(set_byte: np.ndarray | int) -> np.ndarray:
    """The owner in byte 9 (the header's "set" field)."""
    return np.asarray(set_byte, dtype=np.int64) >> OWNER_SHIFT


def decode(buffer: bytes | bytearray | memoryview | np.ndarray, lanes: int = DEFAULT_LANES) -> np.ndarray:
    """Parse one packet's bytes (raises WireError when malformed)."""
    raw = np.frombuffer(buffer, dtype=np.uint8)
    if raw.size != packet_size(lanes):
        raise WireError(f"packet is {raw.size} bytes, expected {packet_size(lanes)} ({lanes} lanes)")
    batch = raw.view(packet_dtype(lanes))
    if batch["hdr"]["version"][0] != VERSION:
        raise WireError(f"unsupported version {batch['hdr']['version'][0]} (this is version {VERSION})")
    return batch


def lanes_of(lengths: np.ndarray, max_lanes: int) -> np.ndarray:
    """The lane count of each datagram length that is a whole packet of 1..max_lanes lanes; 0 otherwise."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lanes = (lengths - HEADER_SIZE) // 4
    return np.where((lengths - HEADER_SIZE) % 4 == 0, np.where((lanes >= 1) & (lanes <= max_lanes), lanes, 0), 0)


def well_formed(batch: np.ndarray, lengths: np.ndarray, lanes: int, type: int) -> np.ndarray:
    """Mask of packets in a received batch that have the right length, version and type."""
    hdr = batch["hdr"]
    return (lengths == packet_size(lanes)) & (hdr["version"] == VERSION) & (hdr["type"] == type)


def well_formed_ack(batch: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Mask of the ACKs in a received batch: the header alone, this version."""
    hdr = batch["hdr"]
    return (lengths == HEADER_SIZE) & (hdr["version"] == VERSION) & (hdr["type"] == ACK)


def newer(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Serial-number comparison of 32-bit psns: a is after b (wraps around at 2^32)."""
    diff = (np.asarray(a, dtype=np.int64) - np.asarray(b, dtype=np.int64)) & 0xFFFFFFFF
    return (diff != 0) & (diff < 0x80000000)
