"""What the controller's P4Runtime side shares and needs no P4Runtime library for: errors, the
compiled pipeline, P4Info lookups, the encoding of values.

The session with one switch (``Switch``, in ``session.py``) needs p4runtime-shell, gRPC and
protobuf: the ``switch`` extra of passing-controller (``pip install 'passing-controller[switch]'``).
This module imports none of them, nor the session (the session imports this module), so a
PS-only controller (the torch backend's embedded one, a topology without a switch) runs
without them; ``switch.connect`` imports the session when a switch is configured, and names
the extra when it is missing. Names are the P4 program's (``Ingress.admission``,
``Ingress.admit``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .topology import TopologyError

if TYPE_CHECKING:
    from p4.config.v1 import p4info_pb2

EXTRA = "switch"  # the optional dependencies of passing-controller that switch control needs


class SwitchError(RuntimeError):
    """The switch refused a request (the message says which and why)."""


class SwitchUnreachable(SwitchError):
    """No P4Runtime session could be set up with the switch."""


class SwitchSupportMissing(TopologyError):
    """The topology has a switch, but p4runtime-shell (the ``switch`` extra) is not installed."""


def encode(value: int | bytes, bitwidth: int) -> bytes:
    """A P4Runtime value: big-endian, shortest form (canonical bytestrings)."""
    if isinstance(value, bytes):
        value = int.from_bytes(value, "big")
    if not 0 <= value < 1 << bitwidth:
        raise ValueError(f"value {value} does not fit in {bitwidth} bits")
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


@dataclass(frozen=True)
class Tls:
    """TLS toward a switch that serves P4Runtime over TLS: the CA that signed its certificate, and
    this controller's certificate and key where the switch asks for a client certificate."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def read(self) -> tuple[bytes, bytes | None, bytes | None]:
        """(CA, key, certificate) as PEM bytes, or SwitchError naming the file that cannot be read."""
        def one(path: Path | None) -> bytes | None:
            if path is None:
                return None
            try:
                return path.read_bytes()
            except OSError as e:
                raise SwitchError(f"P4Runtime TLS: cannot read {path}: {e}") from None
        return one(self.ca), one(self.key), one(self.cert)  # type: ignore[return-value]


@dataclass(frozen=True)
class Pipeline:
    """The compiled program: P4Info (text) and the target's device config."""

    p4info: Path
    device_config: Path

    def load_p4info(self) -> p4info_pb2.P4Info:
        import google.protobuf.text_format  # the switch extra's; only a switch needs a pipeline
        from p4.config.v1 import p4info_pb2

        info = p4info_pb2.P4Info()
        google.protobuf.text_format.Merge(self.p4info.read_text(), info, allow_unknown_field=True)
        return info


class P4Info:
    """Name -> id (and match-field / parameter ids) lookups."""

    def __init__(self, info: p4info_pb2.P4Info) -> None:
        self.info = info
        self.tables = {t.preamble.name: t for t in info.tables}
        self.actions = {a.preamble.name: a for a in info.actions}
        self.counters = {c.preamble.name: c for c in info.counters}
        self.registers = {r.preamble.name: r for r in info.registers}

    def table(self, name: str):
        try:
            return self.tables[name]
        except KeyError:
            raise SwitchError(f"the P4 program has no table {name!r}") from None

    def action(self, name: str):
        try:
            return self.actions[name]
        except KeyError:
            raise SwitchError(f"the P4 program has no action {name!r}") from None

    def counter(self, name: str):
        try:
            return self.counters[name]
        except KeyError:
            raise SwitchError(f"the P4 program has no counter {name!r}") from None
