"""Statistics and int8 quantization of a tensor on a CUDA device (Numba's CUDA target).

The public path of :mod:`engine.numerics.device`, which holds the code (the engine's own
modules import it there): its ``__all__`` and its other public names.
"""

from engine.errors import MissingDependencyError as _Missing

try:
    from engine.numerics.device import *  # noqa: F403
    from engine.numerics.device import DEFAULT_LAUNCH, SIMULATOR, as_device_array, numba_stream  # noqa: F401
    from engine.numerics.device import __all__ as __all__
except ModuleNotFoundError as _exc:  # Numba and llvmlite: the ``kernels`` extra
    raise _Missing.of(_exc, "engine.device (statistics and int8 quantization on a CUDA device)") from None
