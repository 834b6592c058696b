"""PASSING controller: programs the switch over P4Runtime, allocates slots to jobs, places
groups on the switch or a software aggregator and moves them on failure (docs/control.md;
the module map is in docs/architecture.md)."""

__version__ = "0.1.0"
