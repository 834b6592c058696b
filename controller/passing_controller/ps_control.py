"""The controller's side of the software aggregators' control channel (docs/protocol.md): which
PS a control endpoint is, how the controller authenticates to it, one request."""

from __future__ import annotations

from typing import Any

from passing_protocol import rpc
from passing_protocol.keys import ClientKeys

from .keys import ServerKeys
from .schema import RequestError
from .topology import PsEndpoint, Topology

CHECK_TIMEOUT = 2.0  # seconds a PS may take to answer the liveness check of a silent group, or a counter read
REQUEST_TIMEOUT = 5.0  # seconds a PS may take to answer any other request (ping at placement, add_job, remove_job)


class PsControl:
    def __init__(self, topo: Topology, keys: ServerKeys, aggregator_key: bytes | None,
                 request_timeout: float = REQUEST_TIMEOUT, check_timeout: float = CHECK_TIMEOUT) -> None:
        """``keys``: the controller's own key pair; ``aggregator_key``: the public key of the
        software aggregators that the topology does not give one for; ``request_timeout`` and
        ``check_timeout``: how long a PS may take to answer a request, and a liveness check or a
        counter read (the controller's --ps-timeout and --check-timeout)."""
        for name, value in (("PS request timeout", request_timeout), ("PS check timeout", check_timeout)):
            if not value > 0:
                raise ValueError(f"{name} must be positive; got {value}")
        self.topo, self.keys, self.aggregator_key = topo, keys, aggregator_key
        self.request_timeout, self.check_timeout = request_timeout, check_timeout

    def endpoint(self, control: str) -> PsEndpoint:
        return next(p for p in self.topo.ps if p.control == control)

    def client_keys(self, control: str) -> ClientKeys:
        """How the controller authenticates to a PS: its own key pair, the PS's public key."""
        ps = next((p for p in self.topo.ps if p.control == control), None)
        server = ps.public_key if ps is not None and ps.public_key is not None else self.aggregator_key
        if server is None:
            raise RequestError(f"no public key for PS {control}: the topology names none and the key "
                               "directory has no aggregator.key")
        return ClientKeys(server, self.keys.public, self.keys.secret)

    def request(self, control: str, cmd: str, timeout: float | None = None, **fields: Any) -> dict:
        """One request to a software aggregator's control channel (docs/protocol.md), answered
        within ``timeout`` seconds (default: ``request_timeout``)."""
        reply = rpc.call(control, {"version": rpc.AGGREGATOR_VERSION, "cmd": cmd, **fields},
                         self.request_timeout if timeout is None else timeout, self.client_keys(control))
        if not reply.get("ok"):
            raise RequestError(f"software aggregator {control} refused {cmd}: {reply.get('error')}")
        return reply
