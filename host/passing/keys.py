"""CURVE keys, the host's policy (docs/security.md): an aggregator's own key pair and the one
client key its control socket admits (the controller's), and the in-memory keys of the embedded
zero-configuration mode. Reading key files, a client's keys and the CURVE server socket are the
protocol's (``passing_protocol.keys``), shared with the controller.

The key directory (``--keys DIR``, ``$PASSING_KEYS``, else ``~/.config/passing/keys``) is
made by ``passing-ctl keygen``; a worker host needs ``controller.key`` and
``worker.key_secret``, an aggregator host ``aggregator.key_secret`` and ``controller.key``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from passing_protocol import keys as protocol

# ClientKeys and KeysError: re-exported, as passing.keys.ClientKeys is the public API (README)
from passing_protocol.keys import ClientKeys as ClientKeys
from passing_protocol.keys import KeysError as KeysError
from passing_protocol.keys import default_dir, load_public, load_secret

AGGREGATOR_DOMAIN = "passing-aggregator"  # the ZAP domain of an aggregator's control socket


@dataclass(frozen=True)
class AggregatorKeys:
    """An aggregator's own key pair and the one client key it admits (the controller's)."""

    public: bytes
    secret: bytes
    controller: bytes

    @classmethod
    def load(cls, directory: Path | None = None) -> AggregatorKeys:
        directory = directory or default_dir()
        public, secret = load_secret(directory / "aggregator.key_secret")
        return cls(public, secret, load_public(directory / "controller.key"))


def serve_curve(context: zmq.Context, sock: zmq.Socket, keys: AggregatorKeys) -> ThreadAuthenticator:
    """Make ``sock`` a CURVE server that admits the controller's key only (a ZAP handler in
    ``context``, which the aggregator owns)."""
    return protocol.serve_curve(context, sock, keys.public, keys.secret, (keys.controller,), AGGREGATOR_DOMAIN)


class Ephemeral:
    """Key pairs that live in memory only: the embedded zero-configuration mode makes its own."""

    def __init__(self) -> None:
        self.pairs = {name: zmq.curve_keypair() for name in ("controller", "aggregator", "worker")}

    def public(self, name: str) -> bytes:
        return self.pairs[name][0]

    def client(self, name: str, server: str) -> ClientKeys:
        public, secret = self.pairs[name]
        return ClientKeys(self.pairs[server][0], public, secret)

    def aggregator(self) -> AggregatorKeys:
        public, secret = self.pairs["aggregator"]
        return AggregatorKeys(public, secret, self.pairs["controller"][0])
