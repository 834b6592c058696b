"""Strict reading of control messages (docs/control.md): one JSON object of bounded size and
depth, no NaN or Infinity, every field of the right type and in range. Whatever fails is a
``RequestError`` whose text goes back to the sender; nothing else escapes."""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_MESSAGE_BYTES = 64 * 1024  # zmq.MAXMSGSIZE of the control sockets: a join is a few hundred bytes
MAX_DEPTH = 8  # nesting of objects and lists a control message may have (reports need 2)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")  # job names: printable, no spaces, ≤ 200
HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:-]{0,252}")  # a host name or address
SECRET = re.compile(r"[0-9a-f]{32,128}")  # hex: tokens and job secrets


class RequestError(ValueError):
    """A request the controller refuses; the text goes back to the host."""


class Unauthorized(RequestError):
    """A request this client's role may not make."""


def _no_constant(name: str) -> Any:
    raise RequestError(f"{name} is not a number a control message may carry")


def _depth(value: Any) -> int:
    """Nesting depth, without recursion (a hostile message must not exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            if d > MAX_DEPTH:
                return d
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse(raw: bytes) -> dict[str, Any]:
    """One control message as a dict, or RequestError."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise RequestError(f"message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, digits limit, depth
        raise RequestError(f"request is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise RequestError("a request must be a JSON object")
    if _depth(value) > MAX_DEPTH:
        raise RequestError(f"message nests deeper than {MAX_DEPTH} levels")
    return value


_MISSING = object()


def integer(req: dict, name: str, lo: int, hi: int, default: Any = _MISSING) -> int:
    v = req.get(name, _MISSING)
    if v is _MISSING or (v is None and default is not _MISSING):
        if default is _MISSING:
            raise RequestError(f"missing field {name!r}")
        return default
    if type(v) is not int:  # no bool, no float (1e400, 2.0), no string
        raise RequestError(f"{name} must be an integer in {lo}..{hi}, got {_show(v)}")
    if not lo <= v <= hi:
        raise RequestError(f"{name} {v} outside {lo}..{hi}")
    return v


def number(req: dict, name: str, lo: float, hi: float, default: Any = _MISSING) -> float:
    v = req.get(name, _MISSING)
    if v is _MISSING:
        if default is _MISSING:
            raise RequestError(f"missing field {name!r}")
        return default
    if not (type(v) is int or (type(v) is float and math.isfinite(v))):  # (a huge int is no float)
        raise RequestError(f"{name} must be a finite number, got {_show(v)}")
    if not lo <= v <= hi:
        raise RequestError(f"{name} {v} outside [{lo:g}, {hi:g}]")
    return float(v)


def text(req: dict, name: str, pattern: re.Pattern[str], default: Any = _MISSING, what: str = "") -> str:
    v = req.get(name, _MISSING)
    if v is _MISSING:
        if default is _MISSING:
            raise RequestError(f"missing field {name!r}")
        return default
    if not isinstance(v, str) or not pattern.fullmatch(v):
        raise RequestError(f"{name} must be {what or 'a string matching ' + pattern.pattern}, got {_show(v)}")
    return v


def choice(req: dict, name: str, choices: tuple[str, ...], default: str) -> str:
    v = req.get(name, default)
    if v not in choices:
        raise RequestError(f"{name} must be one of {choices}, got {_show(v)}")
    return str(v)


def counters(req: dict, name: str, fields: tuple[str, ...]) -> dict[str, float]:
    """A worker's report: an object of finite non-negative numbers (unknown keys ignored)."""
    v = req.get(name)
    if not isinstance(v, dict):
        raise RequestError(f"{name} must be an object of counters")
    return {k: number(v, k, 0.0, 1e300) for k in fields if k in v}


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
