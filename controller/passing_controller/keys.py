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

This module is the controller's policy: which keys there are, which roles the controller admits,
and the secrets of jobs and workers. Reading key files, a client's keys and the CURVE server
socket are the protocol's (``passing_protocol.keys``), shared with the host.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from passing_protocol.keys import KeysError, load_public, load_secret

ROLES = ("operator", "worker")
NAMES = ("controller", "aggregator", "operator", "worker")
CONTROLLER_DOMAIN = "passing-controller"  # the ZAP domain of the controller's socket


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


def new_secret() -> str:
    """A token or job secret: 128 random bits, hex."""
    return secrets.token_hex(16)


def digest(secret: str) -> str:
    """What the store keeps of a secret: never the secret itself."""
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(secret: str, stored_digest: str) -> bool:
    return hmac.compare_digest(digest(secret), stored_digest)
