"""The wire format: one definition, encode/decode of batches, scapy agrees byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP

from passing import wire
from passing.scapy_layer import Passing


def test_header_layout_is_the_documented_one():
    pkt = wire.encode(type=wire.RESULT, job=0x0102, worker=5, psn=0x0A0B0C0D, slot=0x0304, set=1, op=wire.MAX,
                      flags=wire.FLAG_OVERFLOW, generation=0xBEEF, payload=np.arange(4) - 2, lanes=4, owner=9)
    raw = pkt.tobytes()
    assert raw[:16] == bytes([3, 2, 1, 1, 1, 2, 3, 4, 5, 9 << 1 | 1, 0xBE, 0xEF, 0x0A, 0x0B, 0x0C, 0x0D])
    assert wire.owner_of(pkt["hdr"]["set"]).tolist() == [9] and (pkt["hdr"]["set"] & 1).tolist() == [1]
    with pytest.raises(wire.WireError, match="owner"):
        wire.encode(type=wire.DATA, job=1, worker=0, psn=0, pool=1, payload=[0] * 4, lanes=4, owner=128)
    assert raw[16:] == (np.arange(4) - 2).astype(">i4").tobytes()
    assert len(raw) == wire.packet_size(4) == 32


def test_batch_round_trip_and_slot_derivation():
    psn = np.arange(10) + 2**32 - 5  # wraps around
    rows = np.arange(10 * 8).reshape(10, 8) - 40
    batch = wire.encode(type=wire.DATA, job=3, worker=1, psn=psn, pool=3, payload=rows, lanes=8)
    back = np.frombuffer(batch.tobytes(), dtype=wire.packet_dtype(8))
    assert np.array_equal(back["payload"], rows)
    assert np.array_equal(back["hdr"]["psn"], psn & 0xFFFFFFFF)
    slot, set_ = wire.slot_and_set(psn, 3)
    assert np.array_equal(back["hdr"]["slot"], slot) and np.array_equal(back["hdr"]["set"], set_)


def test_decode_rejects_malformed_buffers():
    good = wire.encode(type=wire.DATA, job=1, worker=0, psn=0, pool=1, payload=[1] * 4, lanes=4).tobytes()
    assert wire.decode(good, 4)["hdr"]["job"][0] == 1
    with pytest.raises(wire.WireError, match="bytes"):
        wire.decode(good[:-1], 4)
    with pytest.raises(wire.WireError, match="version"):
        wire.decode(b"\x07" + good[1:], 4)
    with pytest.raises(wire.WireError, match="int32"):
        wire.encode(type=wire.DATA, job=1, worker=0, psn=0, pool=1, payload=[2**31] * 4, lanes=4)


def test_well_formed_mask():
    batch = wire.empty(4, 4)
    batch["hdr"]["type"] = [wire.DATA, wire.DATA, wire.RESULT, wire.DATA]
    batch["hdr"]["version"][1] = 1  # the previous protocol version
    lengths = np.array([32, 32, 32, 31])
    assert wire.well_formed(batch, lengths, 4, wire.DATA).tolist() == [True, False, False, False]


def test_serial_number_comparison():
    assert wire.newer(np.array([5]), np.array([4]))[0]
    assert not wire.newer(np.array([4]), np.array([5]))[0]
    assert not wire.newer(np.array([4]), np.array([4]))[0]
    assert wire.newer(np.array([2]), np.array([2**32 - 3]))[0]  # after wrap-around


def test_scapy_layer_matches_wire_bytes():
    values = list(range(-32, 32))
    built = bytes(Passing(type=wire.RESULT, op=wire.MAX, flags="OVERFLOW+RETRANSMIT", job=7, slot=9, worker=3,
                          set=1, generation=513, psn=123456, values=values))
    ref = wire.encode(type=wire.RESULT, op=wire.MAX, flags=3, job=7, slot=9, worker=3, set=1, generation=513,
                      psn=123456, payload=values, lanes=64).tobytes()
    assert built == ref
    built = bytes(Passing(type=wire.GATHER, flags="OWNER_ONLY", owner=31, set=1, values=values))
    ref = wire.encode(type=wire.GATHER, flags=wire.FLAG_OWNER_ONLY, job=0, worker=0, psn=0, slot=0, set=1, owner=31,
                      payload=values, lanes=64).tobytes()
    assert built == ref


def test_scapy_dissects_a_udp_packet_on_the_passing_port():
    raw = wire.encode(type=wire.DATA, job=2, worker=1, psn=77, pool=4, payload=[5] * 64).tobytes()
    pkt = IP(bytes(IP(dst="10.0.0.1") / UDP(sport=40000, dport=wire.UDP_PORT) / raw))
    layer = pkt[Passing]
    assert (layer.job, layer.worker, layer.psn, layer.slot, layer.set) == (2, 1, 77, 1, 1)
    assert layer.values == [5] * 64
    assert "PASSING DATA SUM job=2" in pkt.summary()
