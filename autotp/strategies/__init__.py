"""Stage 3: the ways each op may be split (pure rules in an explicit registry)."""

from autotp.strategies.base import AxisOption, RuleEntry, Strategy, expand
from autotp.strategies.enumerate import OpStrategies, enumerate_strategies
from autotp.strategies.registry import default_registry

__all__ = ["AxisOption", "RuleEntry", "Strategy", "expand", "OpStrategies", "enumerate_strategies",
           "default_registry"]
