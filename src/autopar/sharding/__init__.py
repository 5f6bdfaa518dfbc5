"""Sharding space: per-op strategies on an N-D mesh and the cost of converting between layouts."""

from autopar.sharding.layout import (
    FREE,
    PARTIAL,
    REPLICATE,
    Layout,
    LayoutCosts,
    Transfer,
    as_gradient,
    local_shape,
    parse,
    short,
    short_layout,
)
from autopar.sharding.strategies import PASS, Strategy, apply, count, local_bytes, strategies

__all__ = [
    "FREE",
    "PARTIAL",
    "PASS",
    "REPLICATE",
    "Layout",
    "LayoutCosts",
    "Strategy",
    "Transfer",
    "apply",
    "as_gradient",
    "count",
    "local_bytes",
    "local_shape",
    "parse",
    "short",
    "short_layout",
    "strategies",
]
