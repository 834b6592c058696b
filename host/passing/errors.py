"""PASSING's run-time errors, in a module of their own: the controller's client (passing.control)
and the torch backend catch and raise them without importing the streaming engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .replay import Replay


class PassingError(RuntimeError):
    """Base class of PASSING's run-time errors."""


class AggregatorUnreachable(PassingError, TimeoutError):
    """No RESULT within the timeout: the aggregator is down or a peer stopped sending."""


class PassingOverflow(PassingError, OverflowError):
    """A sum left the int32 range (reported by the aggregator's OVERFLOW flag)."""


class GroupFailed(AggregatorUnreachable):
    """The controller could not move the group after its aggregator went silent: no aggregator
    is left (``dead`` empty), or peers stopped (``dead`` names them). The group is unusable.

    To carry on over another transport (the torch backend falls back to gloo), every worker
    first redoes the calls in ``redo`` (those it completed that a peer did not: the group agrees
    on them, docs/control.md) and then the interrupted call, ``current``, from its start."""

    def __init__(self, message: str, dead: list[int], redo: list[Replay], current: Replay | None) -> None:
        super().__init__(message)
        self.dead, self.redo, self.current = dead, redo, current


class Silenced(Exception):
    """Internal: a stream gave its call up because the controller decided (a move or a failure);
    passing.stream.Group catches it and acts on the decision. Never reaches a caller."""
