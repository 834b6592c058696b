"""The P4Runtime session with one switch: pipeline, table entries, multicast groups, counters.

p4runtime-shell's ``P4RuntimeClient`` handles the gRPC channel, the stream and the
primary-controller arbitration; entities are built here from the P4Info by name, so the
per-control modules (``admission``, ``l2_forward``, ``result_rewrite``) read like the P4
program. It needs the ``switch`` extra of passing-controller; ``switch.connect`` imports
it only when the topology has a switch.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, status_pb2
from p4.v1 import p4runtime_pb2
from p4runtime_sh.p4runtime import P4RuntimeClient, P4RuntimeException, SSLOptions

from .p4runtime import P4Info, Pipeline, SwitchError, SwitchUnreachable, Tls, encode


def _write_error(e: grpc.RpcError) -> str:
    """The per-update errors of a failed Write (P4Runtime spec: a google.rpc.Status in the trailers whose
    details hold one p4.v1.Error per update, OK for those that were applied). Read here, not through
    p4runtime-shell's P4RuntimeWriteException, which loops forever on a batch where some updates succeeded."""
    for key, value in (e.trailing_metadata() or ()):
        if key != "grpc-status-details-bin":
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:
            break
        failed = []
        for index, detail in enumerate(status.details):
            error = p4runtime_pb2.Error()
            if detail.Unpack(error) and error.canonical_code != code_pb2.OK:
                failed.append(f"update {index}: {code_pb2.Code.Name(error.canonical_code)}: {error.message}")
        if failed:
            return "; ".join(failed)
    return f"{e.code().name}: {e.details()}"  # not the Write error format (e.g. the switch went away)


class Switch:
    """A primary P4Runtime session with one device (over TLS when ``tls`` is given)."""

    def __init__(self, address: str, device_id: int = 0, election_id: tuple[int, int] = (0, 1),
                 timeout: float = 5.0, tls: Tls | None = None) -> None:
        self.address, self.device_id, self.election_id, self.timeout = address, device_id, election_id, timeout
        if tls is None:
            channel = grpc.insecure_channel(address)
        else:
            channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(*tls.read()))
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

    def read(self, *entities: p4runtime_pb2.Entity) -> list[p4runtime_pb2.Entity]:
        """Every entity matching any of ``entities``, in one ReadRequest."""
        req = p4runtime_pb2.ReadRequest()
        req.device_id = self.device_id
        req.entities.extend(entities)
        try:
            return [e for response in self.client.stub.Read(req, timeout=self.timeout) for e in response.entities]
        except grpc.RpcError as e:
            raise SwitchError(f"P4Runtime read from {self.address} failed: {e.code().name}: {e.details()}") from None

    def read_table(self, table: str) -> list[p4runtime_pb2.Entity]:
        entity = p4runtime_pb2.Entity()
        entity.table_entry.table_id = self._info().table(table).preamble.id
        return self.read(entity)

    def has_counter(self, counter: str) -> bool:
        """Whether the loaded program declares ``counter`` (a feature one target's program has)."""
        return counter in self._info().counters

    def read_counter(self, counter: str) -> dict[int, int]:
        """index -> packet count of an indexed counter."""
        entity = p4runtime_pb2.Entity()
        entity.counter_entry.counter_id = self._info().counter(counter).preamble.id
        return {e.counter_entry.index.index: e.counter_entry.data.packet_count for e in self.read(entity)}

    def read_counter_cells(self, cells: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """(counter, index) -> packet count of the given cells, in one read. A whole counter costs
        BMv2 a read of each of its cells (about 20 ms for 1024); a cell alone, well under 1 ms."""
        ids = {counter: self._info().counter(counter).preamble.id for counter, _ in cells}
        entities = []
        for counter, index in cells:
            entity = p4runtime_pb2.Entity()
            entity.counter_entry.counter_id = ids[counter]
            entity.counter_entry.index.index = index
            entities.append(entity)
        names = {counter_id: counter for counter, counter_id in ids.items()}
        return {(names[e.counter_entry.counter_id], e.counter_entry.index.index): e.counter_entry.data.packet_count
                for e in (self.read(*entities) if entities else [])}

    def read_multicast_groups(self) -> list[p4runtime_pb2.Entity]:
        entity = p4runtime_pb2.Entity()
        entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = 0
        return self.read(entity)
