"""PASSING controller (placeholder package: the P4Runtime service arrives with the BMv2 issue).

It shares no code with the host agent: the two talk through the documented wire
format (docs/protocol.md) and control messages.
"""

__version__ = "0.1.0"
