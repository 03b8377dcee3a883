"""Statistics of a tensor (count, min, max, mean, standard deviation, non-finite counts), in one
pass on the CPU.

The public path of :mod:`engine.numerics.statistics`, which holds the code (the engine's own
modules import it there): its ``__all__`` and its other public names.
"""

from engine.errors import MissingDependencyError as _Missing

try:
    from engine.numerics.statistics import *  # noqa: F403
    from engine.numerics.statistics import SUPPORTED_NAMES  # noqa: F401
    from engine.numerics.statistics import __all__ as __all__
except ModuleNotFoundError as _exc:  # Numba and llvmlite: the ``kernels`` extra
    raise _Missing.of(_exc, "engine.stats and engine.Stats (the Numba kernels)") from None
