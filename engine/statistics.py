"""Statistics of a tensor (count, min, max, mean, standard deviation, non-finite counts), in one
pass on the CPU: the public face of :mod:`engine.numerics.statistics`.

Kept whole for the callers of this path; the engine's own modules import
:mod:`engine.numerics.statistics`.
"""

from __future__ import annotations

from .numerics.statistics import (
    SUPPORTED_NAMES,  # noqa: F401 - its other public names
    Accumulator,
    Stats,
    stats,
    stats_from_partials,
)

__all__ = [
    "Accumulator",
    "Stats",
    "stats",
    "stats_from_partials",
]
