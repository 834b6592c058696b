"""A scapy layer for the PASSING header, for tests, pcaps and debugging only.

Never on the data path: scapy builds one packet in tens of microseconds. Field
widths and constants come from ``passing.wire``, the one definition of the format.

    >>> from passing.scapy_layer import Passing
    >>> pkt = IP(dst="10.0.0.254") / UDP(sport=20000, dport=9877) / Passing(job=1, psn=7, values=[1] * 64)
"""

from __future__ import annotations

from scapy.fields import (
    BitField,
    ByteEnumField,
    ByteField,
    FieldListField,
    FlagsField,
    IntField,
    ShortField,
    SignedIntField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from . import wire


class Passing(Packet):
    name = "PASSING"
    fields_desc = [
        ByteField("version", wire.VERSION),
        ByteEnumField("type", wire.DATA, {wire.DATA: "DATA", wire.RESULT: "RESULT", wire.ACK: "ACK",
                                          wire.GATHER: "GATHER", wire.NACK: "NACK"}),
        ByteEnumField("op", wire.SUM, {wire.SUM: "SUM", wire.MAX: "MAX"}),
        FlagsField("flags", 0, 8, ["OVERFLOW", "RETRANSMIT", "OWNER_ONLY"]),
        ShortField("job", 0),
        ShortField("slot", 0),
        ByteField("worker", 0),
        BitField("owner", 0, 7),  # byte 9: owner in bits 7..1 (wire.owner_of), set in bit 0
        BitField("set", 0, 1),
        ShortField("generation", 0),
        IntField("psn", 0),
        FieldListField("values", [], SignedIntField("value", 0)),  # the rest of the datagram
    ]

    def mysummary(self) -> str:
        return self.sprintf(
            "PASSING %type% %op% job=%job% gen=%generation% worker=%worker% psn=%psn% slot=%slot% set=%set% "
            "owner=%owner% flags=%flags%"
        )


assert len(Passing()) == wire.HEADER_SIZE

bind_layers(UDP, Passing, dport=wire.UDP_PORT)
bind_layers(UDP, Passing, sport=wire.UDP_PORT)
