"""The control channels' messages (docs/control.md): one JSON request/reply over ZeroMQ,
authenticated with CURVE, with a deadline; and the strict reading a server does before it acts
on a message: one JSON object of bounded size and depth, no NaN or Infinity, every field of its
type and in range. Whatever fails is a ``MessageError`` (or the subclass the server passes as
``error=``) whose text goes back to the sender; nothing else escapes.

The worker and the CLI ask the controller, the controller and the CLI ask software aggregators
(``call``); the controller and the aggregators read what they are sent (``parse``, ``integer``...).
Which commands exist and what their fields are is each server's own.
"""

from __future__ import annotations

import json
import math
import re
from functools import partial
from typing import Any

import zmq

from .keys import ClientKeys

# The two control channels' versions, which both ends stamp on and check in every request (the one place
# each is written):
CONTROLLER_VERSION = 3  # the controller's (docs/control.md): 3: CURVE keys, job secrets and worker tokens;
# 2: the allocation's generation
AGGREGATOR_VERSION = 3  # a software aggregator's (docs/protocol.md): 3: CURVE, the controller's key only;
# 2: a job object carries its generation

MAX_MESSAGE_BYTES = 64 * 1024  # zmq.MAXMSGSIZE of a control socket: a join or an add_job of 32 workers is < 2 KiB
MAX_REPLY_BYTES = 16 * 1024 * 1024  # a status or metrics answer of thousands of groups fits
MAX_DEPTH = 8  # nesting of objects and lists a control message may have (reports need 2)


class MessageError(ValueError):
    """A control message that is not one, or a request the server refuses: the text goes back
    to the sender.

    Two refusals are worded by the class (``not_integer``, ``constant``): the aggregator's
    words are these, the controller's ``RequestError`` (passing_controller.schema) has its own,
    as each has always sent them.
    """

    @staticmethod
    def not_integer(name: str, lo: int, hi: int, value: Any) -> str:
        return f"{name} must be an integer, got {str(value)[:40]!r}"

    @staticmethod
    def constant(name: str) -> str:
        """NaN, Infinity or -Infinity in a message."""
        return f"{name} is not a number a control message may carry"


def show(v: Any) -> str:
    """A value as an error text quotes it: its repr, at most 60 characters."""
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, allow_nan=False).encode()


def _no_constant(error: type[MessageError], name: str) -> Any:
    raise error(error.constant(name))


def parse(raw: bytes, error: type[MessageError] = MessageError) -> dict[str, Any]:
    """One control message as a dict: bounded size and depth, no NaN or Infinity; else ``error``."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise error(f"message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        value = json.loads(raw, parse_constant=partial(_no_constant, error))
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, the digits limit, depth
        if isinstance(e, MessageError):
            raise
        raise error(f"request is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise error("a request must be a JSON object")
    stack = [(value, 1)]  # depth, without recursion (a hostile message must not exhaust the stack)
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            if d > MAX_DEPTH:
                raise error(f"message nests deeper than {MAX_DEPTH} levels")
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return value


MISSING: Any = object()  # the default of a field that must be there


def integer(obj: dict, name: str, lo: int, hi: int, default: Any = MISSING,
            error: type[MessageError] = MessageError) -> Any:
    """A field that must be an int in [lo, hi] (no bool, no float such as 1e400 or 2.0, no string);
    absent (or null, when there is a default): ``default``."""
    v = obj.get(name, MISSING)
    if v is MISSING or (v is None and default is not MISSING):
        if default is MISSING:
            raise error(f"missing field {name!r}")
        return default
    if type(v) is not int:
        raise error(error.not_integer(name, lo, hi, v))
    if not lo <= v <= hi:
        raise error(f"{name} {v} outside {lo}..{hi}")
    return v


def number(obj: dict, name: str, lo: float, hi: float, default: Any = MISSING,
           error: type[MessageError] = MessageError) -> Any:
    """A field that must be a finite number in [lo, hi], as a float; absent: ``default``."""
    v = obj.get(name, MISSING)
    if v is MISSING:
        if default is MISSING:
            raise error(f"missing field {name!r}")
        return default
    if not (type(v) is int or (type(v) is float and math.isfinite(v))):  # (a huge int is no float)
        raise error(f"{name} must be a finite number, got {show(v)}")
    if not lo <= v <= hi:
        raise error(f"{name} {v} outside [{lo:g}, {hi:g}]")
    return float(v)


def text(obj: dict, name: str, pattern: re.Pattern[str], default: Any = MISSING, what: str = "",
         error: type[MessageError] = MessageError) -> Any:
    """A field that must be a string ``pattern`` matches whole (``what`` names it in the error)."""
    v = obj.get(name, MISSING)
    if v is MISSING:
        if default is MISSING:
            raise error(f"missing field {name!r}")
        return default
    if not isinstance(v, str) or not pattern.fullmatch(v):
        raise error(f"{name} must be {what or 'a string matching ' + pattern.pattern}, got {show(v)}")
    return v


def choice(obj: dict, name: str, choices: tuple[str, ...], default: str,
           error: type[MessageError] = MessageError) -> str:
    v = obj.get(name, default)
    if v not in choices:
        raise error(f"{name} must be one of {choices}, got {show(v)}")
    return str(v)


def counters(obj: dict, name: str, fields: tuple[str, ...],
             error: type[MessageError] = MessageError) -> dict[str, float]:
    """An object of finite non-negative numbers, such as a worker's report (unknown keys ignored)."""
    v = obj.get(name)
    if not isinstance(v, dict):
        raise error(f"{name} must be an object of counters")
    return {k: number(v, k, 0.0, 1e300, error=error) for k in fields if k in v}


def call(endpoint: str, request: dict[str, Any], timeout: float, keys: ClientKeys) -> dict[str, Any]:
    """Send ``request``, return the reply; TimeoutError when none comes in ``timeout`` s (a
    server that does not know ``keys`` never answers: CURVE drops the connection).

    A fresh REQ socket per call: a lost reply never wedges a later call. And a context of its own, ended
    with the call: a process-wide one would keep its I/O threads and descriptors for the life of the
    process (a torch rank's, after destroy_process_group: more than gloo leaves).
    """
    context = zmq.Context(io_threads=1)
    sock = context.socket(zmq.REQ)
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
        context.term()
