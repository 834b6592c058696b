"""CURVE keys, the host side (docs/security.md): what a worker presents to the controller, and
what a software aggregator's control socket admits (the controller's key, nothing else).

The key directory (``--keys DIR``, ``$PASSING_KEYS``, else ``~/.config/passing/keys``) is
made by ``passing-ctl keygen``; a worker host needs ``controller.key`` and
``worker.key_secret``, an aggregator host ``aggregator.key_secret`` and ``controller.key``.
This is the controller package's ``keys`` module's twin for the parts a host needs: the two
distributions share protocols, not code.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

AGGREGATOR_DOMAIN = "passing-aggregator"  # the ZAP domain of an aggregator's control socket


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


@dataclass(frozen=True)
class ServerKeys:
    """An aggregator's own key pair and the one client key it admits (the controller's)."""

    public: bytes
    secret: bytes
    controller: bytes

    @classmethod
    def aggregator(cls, directory: Path | None = None) -> ServerKeys:
        directory = directory or default_dir()
        public, secret = load_secret(directory / "aggregator.key_secret")
        return cls(public, secret, load_public(directory / "controller.key"))


class _OnlyController:
    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


def serve_curve(context: zmq.Context, sock: zmq.Socket, keys: ServerKeys) -> ThreadAuthenticator:
    """Make ``sock`` a CURVE server that admits the controller's key only (a ZAP handler in
    ``context``, which the aggregator owns)."""
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(AGGREGATOR_DOMAIN, _OnlyController(keys.controller))
    sock.zap_domain = AGGREGATOR_DOMAIN.encode()
    sock.curve_server = True
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    return auth


class Ephemeral:
    """Key pairs that live in memory only: the embedded zero-configuration mode makes its own."""

    def __init__(self) -> None:
        self.pairs = {name: zmq.curve_keypair() for name in ("controller", "aggregator", "worker")}

    def public(self, name: str) -> bytes:
        return self.pairs[name][0]

    def client(self, name: str, server: str) -> ClientKeys:
        public, secret = self.pairs[name]
        return ClientKeys(self.pairs[server][0], public, secret)

    def aggregator(self) -> ServerKeys:
        public, secret = self.pairs["aggregator"]
        return ServerKeys(public, secret, self.pairs["controller"][0])
