"""PASSING host agent: wire format, aggregation engine, software aggregator, streaming."""

from .aggregator.engine import AggregationEngine, ConfigError, JobSpec
from .stream import Aggregator, AggregatorUnreachable, Group, PassingError, PassingOverflow

__all__ = [
    "AggregationEngine", "Aggregator", "AggregatorUnreachable", "ConfigError", "Group", "JobSpec",
    "PassingError", "PassingOverflow",
]
__version__ = "0.1.0"
