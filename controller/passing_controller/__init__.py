"""PASSING controller: programs the switch over P4Runtime, allocates slots to jobs, places
groups on the switch or a software aggregator and moves them on failure (docs/control.md;
the module map is in docs/architecture.md).

It shares one package with the host agent, ``passing_protocol`` (CURVE keys, the control
channels' JSON request/reply and its strict reading, the metrics HTTP server); otherwise the two
talk through the documented wire format (docs/protocol.md) and control messages.
"""

__version__ = "0.1.0"
