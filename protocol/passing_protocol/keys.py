"""CURVE keys of the control channels (docs/security.md): reading key files, what a client
presents, and making a socket a CURVE server that admits an allow-list of client keys.

The key directory (``--keys DIR``, ``$PASSING_KEYS``, else ``~/.config/passing/keys``) is made
by ``passing-ctl keygen`` (``passing_controller.keys``); which keys each service admits is that
service's own (``passing.keys``: an aggregator admits the controller; ``passing_controller.keys``:
the controller admits operators and workers, with their roles).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


class KeysError(ValueError):
    """A key directory or key file that cannot be used; the text says how to fix it."""


def default_dir() -> Path:
    return Path(os.environ.get("PASSING_KEYS") or Path.home() / ".config" / "passing" / "keys")


def load_public(path: Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise KeysError(f"cannot read public key {path}: {e} (run `passing-ctl keygen`, or set PASSING_KEYS)") from None
    return public


def load_secret(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) of a ``.key_secret`` file, which only its owner may read."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise KeysError(f"cannot read secret key {path}: {e} (run `passing-ctl keygen`, or set PASSING_KEYS)") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeysError(f"secret key {path} is readable by others (mode {stat.S_IMODE(mode):o}): chmod 600 it")
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise KeysError(f"cannot read secret key {path}: {e}") from None
    if not secret:
        raise KeysError(f"{path} holds no secret key")
    return public, secret


@dataclass(frozen=True)
class ClientKeys:
    """What a client presents: its key pair, and the server's public key it expects."""

    server: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, directory: Path | None = None, role: str = "worker", server: str = "controller") -> ClientKeys:
        directory = directory or default_dir()
        public, secret = load_secret(directory / f"{role}.key_secret")
        return cls(load_public(directory / f"{server}.key"), public, secret)

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


class _Allowed:
    """The ZAP callback: a client is let in when its key is in ``clients`` (of one domain)."""

    def __init__(self, clients: Container[bytes]) -> None:
        self.clients = clients

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.clients


def serve_curve(context: zmq.Context, sock: zmq.Socket, public: bytes, secret: bytes, clients: Container[bytes],
                domain: str) -> ThreadAuthenticator:
    """Make ``sock`` a CURVE server with the key pair (``public``, ``secret``) that admits only the
    client keys in ``clients`` (read at each handshake), through a ZAP handler for ``domain`` in
    ``context``: each service owns its context, so two services in one process keep their own
    allow-lists."""
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain, _Allowed(clients))
    sock.zap_domain = domain.encode()
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    return auth
