"""PASSING host agent: wire format, aggregation engine, software aggregator, streaming."""

from .aggregator.engine import AggregationEngine, ConfigError, JobSpec
from .errors import AggregatorUnreachable, PassingError, PassingOverflow
from .stream import Group
from .stream_state import Aggregator

__all__ = [
    "AggregationEngine", "Aggregator", "AggregatorUnreachable", "ConfigError", "Group", "JobSpec",
    "PassingError", "PassingOverflow",
]
__version__ = "0.1.0"
