"""PASSING controller (placeholder package: the P4Runtime service arrives with the BMv2 issue).

It shares one package with the host agent, ``passing_protocol`` (CURVE keys, the control
channels' JSON request/reply and its strict reading, the metrics HTTP server); otherwise the two
talk through the documented wire format (docs/protocol.md) and control messages.
"""

__version__ = "0.1.0"
