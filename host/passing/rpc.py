"""One JSON request/reply over ZeroMQ, authenticated with CURVE, with a deadline; and the strict
reading of a control message that a server does before it acts on one. The aggregator's and the
controller's control channels both use it. (The controller package has its own twin: the two
distributions share protocols, not code.)"""

from __future__ import annotations

import json
from typing import Any

import zmq

from .keys import ClientKeys

MAX_MESSAGE_BYTES = 64 * 1024  # zmq.MAXMSGSIZE of a control socket: an add_job of 32 workers is < 2 KiB
MAX_REPLY_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 8  # nesting of objects and lists a control message may have


class MessageError(ValueError):
    """A control message that is not one: the text goes back to the sender."""


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, allow_nan=False).encode()


def _no_constant(name: str) -> Any:
    raise MessageError(f"{name} is not a number a control message may carry")


def parse(raw: bytes) -> dict[str, Any]:
    """One control message as a dict: bounded size and depth, no NaN or Infinity."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, the digits limit, depth
        if isinstance(e, MessageError):
            raise
        raise MessageError(f"request is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise MessageError("a request must be a JSON object")
    stack = [(value, 1)]  # depth, without recursion
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            if d > MAX_DEPTH:
                raise MessageError(f"message nests deeper than {MAX_DEPTH} levels")
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return value


def integer(obj: dict, name: str, lo: int, hi: int, default: Any = ...) -> Any:
    """A field that must be an int in [lo, hi] (no bool, no float such as 1e400, no string)."""
    v = obj.get(name, ...)
    if v is ... or (v is None and default is not ...):
        if default is ...:
            raise MessageError(f"missing field {name!r}")
        return default
    if type(v) is not int:
        raise MessageError(f"{name} must be an integer, got {str(v)[:40]!r}")
    if not lo <= v <= hi:
        raise MessageError(f"{name} {v} outside {lo}..{hi}")
    return v


def call(endpoint: str, request: dict[str, Any], timeout: float, keys: ClientKeys) -> dict[str, Any]:
    """Send ``request``, return the reply; TimeoutError when none comes in ``timeout`` s (a
    server that does not know ``keys`` never answers: CURVE drops the connection).

    A fresh REQ socket per call: a lost reply never wedges a later call.
    """
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    try:
        keys.apply(sock)
        sock.connect(endpoint)
        sock.send(encode(request))
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"{endpoint} did not answer {request.get('cmd')!r} within {timeout:g} s"
                               " (down, busy, or it does not know this key)")
        try:
            reply = json.loads(sock.recv())
        except ValueError as e:
            raise ConnectionError(f"{endpoint} answered {request.get('cmd')!r} with no JSON: {e}") from None
        if not isinstance(reply, dict):
            raise ConnectionError(f"{endpoint} answered {request.get('cmd')!r} with something that is not an object")
        return reply
    finally:
        sock.close()
