"""Statistics of a tensor (count, min, max, mean, standard deviation, non-finite counts), in one
pass on the CPU.

The public path of :mod:`engine.numerics.statistics`, which holds the code (the engine's own
modules import it there): its ``__all__`` and its other public names.
"""

from .numerics.statistics import *  # noqa: F403
from .numerics.statistics import SUPPORTED_NAMES  # noqa: F401
from .numerics.statistics import __all__ as __all__
