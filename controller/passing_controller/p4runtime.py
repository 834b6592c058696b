"""The P4Runtime connection to one switch: pipeline, table entries, multicast groups, counters.

p4runtime-shell's ``P4RuntimeClient`` handles the gRPC channel, the stream and the
primary-controller arbitration; entities are built here from the P4Info by name, so the
per-control modules (``admission``, ``l2_forward``, ``result_rewrite``) read like the P4
program. Names are the P4 program's (``Ingress.admission``, ``Ingress.admit``, ...).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import google.protobuf.text_format
import grpc
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2
from p4runtime_sh.p4runtime import P4RuntimeClient, P4RuntimeException, P4RuntimeWriteException, SSLOptions

log = logging.getLogger("passing_controller.p4runtime")


class SwitchError(RuntimeError):
    """The switch refused a request (the message says which and why)."""


class SwitchUnreachable(SwitchError):
    """No P4Runtime session could be set up with the switch."""


def encode(value: int | bytes, bitwidth: int) -> bytes:
    """A P4Runtime value: big-endian, shortest form (canonical bytestrings)."""
    if isinstance(value, bytes):
        value = int.from_bytes(value, "big")
    if not 0 <= value < 1 << bitwidth:
        raise ValueError(f"value {value} does not fit in {bitwidth} bits")
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


def _write_error(e: grpc.RpcError) -> str:
    """The per-update errors of a failed Write, as p4runtime-shell formats them."""
    try:
        return str(P4RuntimeWriteException(e))
    except Exception:  # not the Write error format (e.g. the switch went away)
        return f"{e.code().name}: {e.details()}"


@dataclass(frozen=True)
class Pipeline:
    """The compiled program: P4Info (text) and the target's device config."""

    p4info: Path
    device_config: Path

    def load_p4info(self) -> p4info_pb2.P4Info:
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


@dataclass(frozen=True)
class Tls:
    """TLS toward a switch that serves P4Runtime over TLS: the CA that signed its certificate, and
    this controller's certificate and key where the switch asks for a client certificate."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: Path | None) -> bytes | None:
            if path is None:
                return None
            try:
                return path.read_bytes()
            except OSError as e:
                raise SwitchError(f"P4Runtime TLS: cannot read {path}: {e}") from None
        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


class Switch:
    """A primary P4Runtime session with one device (over TLS when ``tls`` is given)."""

    def __init__(self, address: str, device_id: int = 0, election_id: tuple[int, int] = (0, 1),
                 timeout: float = 5.0, tls: Tls | None = None) -> None:
        self.address, self.device_id, self.election_id, self.timeout = address, device_id, election_id, timeout
        channel = grpc.insecure_channel(address) if tls is None else grpc.secure_channel(address, tls.credentials())
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            channel.close()
            raise SwitchUnreachable(f"no P4Runtime server at {address} within {timeout} s") from None
        channel.close()
        try:
            ssl = SSLOptions(True) if tls is None else SSLOptions(False, *(
                None if path is None else str(path) for path in (tls.ca, tls.cert, tls.key)))
            self.client = P4RuntimeClient(device_id, address, election_id, ssl_options=ssl)
        except SystemExit:  # p4runtime-shell exits when the arbitration gets no answer
            raise SwitchUnreachable(f"P4Runtime arbitration with {address} failed") from None
        self.p4info: P4Info | None = None

    def close(self) -> None:
        self.client.tear_down()

    # ---- pipeline ----------------------------------------------------------------------

    def set_pipeline(self, pipeline: Pipeline) -> None:
        try:
            self.client.set_fwd_pipe_config(str(pipeline.p4info), str(pipeline.device_config))
        except (P4RuntimeException, OSError) as e:
            raise SwitchError(f"SetForwardingPipelineConfig on {self.address} failed: {e}") from None
        self.p4info = P4Info(pipeline.load_p4info())

    def fetch_pipeline(self) -> None:
        """Use the P4Info the switch runs (after a controller restart)."""
        try:
            self.p4info = P4Info(self.client.get_p4info())
        except P4RuntimeException as e:
            raise SwitchError(f"the switch at {self.address} has no pipeline: {e}") from None

    def _info(self) -> P4Info:
        if self.p4info is None:
            raise SwitchError("no pipeline: call set_pipeline or fetch_pipeline first")
        return self.p4info

    # ---- writes ------------------------------------------------------------------------

    def write(self, updates: list[p4runtime_pb2.Update]) -> None:
        if not updates:
            return
        req = p4runtime_pb2.WriteRequest()
        req.device_id = self.device_id
        req.election_id.high, req.election_id.low = self.election_id
        req.updates.extend(updates)
        try:
            self.client.stub.Write(req, timeout=self.timeout)
        except grpc.RpcError as e:
            raise SwitchError(f"P4Runtime write to {self.address} failed: {_write_error(e)}") from None

    def table_entry(self, table: str, match: dict[str, int | bytes], action: str | None = None,
                    params: dict[str, int | bytes] | None = None) -> p4runtime_pb2.Entity:
        info = self._info()
        t = info.table(table)
        entity = p4runtime_pb2.Entity()
        entry = entity.table_entry
        entry.table_id = t.preamble.id
        fields = {f.name: f for f in t.match_fields}
        for name, value in match.items():
            if name not in fields:
                raise SwitchError(f"table {table} has no match field {name!r}")
            m = entry.match.add()
            m.field_id = fields[name].id
            m.exact.value = encode(value, fields[name].bitwidth)
        if action is not None:
            a = info.action(action)
            entry.action.action.action_id = a.preamble.id
            declared = {p.name: p for p in a.params}
            for name, value in (params or {}).items():
                if name not in declared:
                    raise SwitchError(f"action {action} has no parameter {name!r}")
                p = entry.action.action.params.add()
                p.param_id = declared[name].id
                p.value = encode(value, declared[name].bitwidth)
        return entity

    @staticmethod
    def update(kind: str, entity: p4runtime_pb2.Entity) -> p4runtime_pb2.Update:
        u = p4runtime_pb2.Update()
        u.type = {"insert": p4runtime_pb2.Update.INSERT, "modify": p4runtime_pb2.Update.MODIFY,
                  "delete": p4runtime_pb2.Update.DELETE}[kind]
        u.entity.CopyFrom(entity)
        return u

    @staticmethod
    def multicast_group(group: int, replicas: list[tuple[int, int]]) -> p4runtime_pb2.Entity:
        """A PRE multicast group: (egress port, replication id) pairs."""
        entity = p4runtime_pb2.Entity()
        g = entity.packet_replication_engine_entry.multicast_group_entry
        g.multicast_group_id = group
        for port, rid in replicas:
            r = g.replicas.add()
            r.egress_port = port
            r.instance = rid
        return entity

    # ---- reads -------------------------------------------------------------------------

    def read(self, entity: p4runtime_pb2.Entity) -> list[p4runtime_pb2.Entity]:
        req = p4runtime_pb2.ReadRequest()
        req.device_id = self.device_id
        req.entities.append(entity)
        try:
            return [e for response in self.client.stub.Read(req, timeout=self.timeout) for e in response.entities]
        except grpc.RpcError as e:
            raise SwitchError(f"P4Runtime read from {self.address} failed: {e.code().name}: {e.details()}") from None

    def read_table(self, table: str) -> list[p4runtime_pb2.Entity]:
        entity = p4runtime_pb2.Entity()
        entity.table_entry.table_id = self._info().table(table).preamble.id
        return self.read(entity)

    def read_counter(self, counter: str) -> dict[int, int]:
        """index -> packet count of an indexed counter."""
        entity = p4runtime_pb2.Entity()
        entity.counter_entry.counter_id = self._info().counter(counter).preamble.id
        return {e.counter_entry.index.index: e.counter_entry.data.packet_count for e in self.read(entity)}

    def read_multicast_groups(self) -> list[p4runtime_pb2.Entity]:
        entity = p4runtime_pb2.Entity()
        entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = 0
        return self.read(entity)
