"""CURVE keys of the control plane (docs/security.md): who may talk to the controller and to
the software aggregators, and as what.

A key directory (``passing-ctl keygen``; ``--keys DIR``, ``$PASSING_KEYS``, else
``~/.config/passing/keys``) holds four ZeroMQ certificates, each a public ``NAME.key`` and
a secret ``NAME.key_secret`` (mode 0600):

* ``controller``: the controller's own key; also the only client an aggregator accepts;
* ``aggregator``: the software aggregators' key (a topology entry may name another one);
* ``operator``: a client allowed status, stats, metrics and administration;
* ``worker``: a client allowed to join jobs and act on its own group (with its token).

More public keys may be allowed by dropping ``*.key`` files into ``operators/`` or
``workers/`` under the directory. A host needs only the files of its own role.

The host package has a twin of the client half of this (``passing/keys.py``): the two
distributions share protocols, not code.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

ROLES = ("operator", "worker")
NAMES = ("controller", "aggregator", "operator", "worker")
CONTROLLER_DOMAIN = "passing-controller"  # the ZAP domain of the controller's socket


class KeysError(ValueError):
    """A key directory or key file that cannot be used; the text says how to fix it."""


def default_dir() -> Path:
    return Path(os.environ.get("PASSING_KEYS") or Path.home() / ".config" / "passing" / "keys")


def keygen(directory: Path, force: bool = False) -> list[Path]:
    """Create the four key pairs in ``directory`` (mode 0700); refuses to overwrite unless ``force``."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    existing = [directory / f"{n}.key_secret" for n in NAMES if (directory / f"{n}.key_secret").exists()]
    if existing and not force:
        raise KeysError(f"{directory} already holds keys ({', '.join(p.name for p in existing)}); "
                        "--force replaces them (every host then needs the new files)")
    made = []
    for name in NAMES:
        for suffix in (".key", ".key_secret"):
            (directory / f"{name}{suffix}").unlink(missing_ok=True)
        public, secret = zmq.auth.create_certificates(str(directory), name)
        os.chmod(secret, 0o600)
        os.chmod(public, 0o644)
        made += [Path(public), Path(secret)]
    for sub in ("operators", "workers"):
        (directory / sub).mkdir(exist_ok=True)
    return made


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
class ServerKeys:
    """A service's own key pair and the public keys it accepts, each with its role."""

    public: bytes
    secret: bytes
    clients: dict[bytes, str]  # Z85 public key -> role

    @classmethod
    def controller(cls, directory: Path) -> ServerKeys:
        public, secret = load_secret(directory / "controller.key_secret")
        clients: dict[bytes, str] = {}
        for role in ROLES:
            own = directory / f"{role}.key"
            extra = sorted((directory / f"{role}s").glob("*.key")) if (directory / f"{role}s").is_dir() else []
            for path in ([own] if own.exists() else []) + extra:
                clients[load_public(path)] = role
        if not clients:
            raise KeysError(f"{directory} allows no client: it has neither operator.key nor worker.key")
        return cls(public, secret, clients)


@dataclass(frozen=True)
class ClientKeys:
    """What a client presents: its key pair, and the server's public key it expects."""

    server: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, directory: Path, role: str, server: str = "controller") -> ClientKeys:
        public, secret = load_secret(directory / f"{role}.key_secret")
        return cls(load_public(directory / f"{server}.key"), public, secret)

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


class _Allowed:
    """The ZAP callback: a client is let in when its key is in the map (of one domain)."""

    def __init__(self, clients: dict[bytes, str]) -> None:
        self.clients = clients

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.clients


def serve_curve(context: zmq.Context, sock: zmq.Socket, keys: ServerKeys, domain: str) -> ThreadAuthenticator:
    """Make ``sock`` a CURVE server that admits only ``keys.clients`` (a ZAP handler in ``context``:
    each service owns its context, so two services in one process keep their own allow-lists)."""
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain, _Allowed(keys.clients))
    sock.zap_domain = domain.encode()
    sock.curve_server = True
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    return auth


def new_secret() -> str:
    """A token or job secret: 128 random bits, hex."""
    return secrets.token_hex(16)


def digest(secret: str) -> str:
    """What the store keeps of a secret: never the secret itself."""
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(secret: str, stored_digest: str) -> bool:
    return hmac.compare_digest(digest(secret), stored_digest)
