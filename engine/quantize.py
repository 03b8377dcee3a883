"""Int8 quantization of one array (per-channel absmax scales) and its inverse.

The public path of :mod:`engine.numerics.quantize`, which holds the code (the engine's own
modules import it there): its ``__all__`` and its other public names.
"""

from engine.errors import MissingDependencyError as _Missing

try:
    from engine.numerics.quantize import *  # noqa: F403
    from engine.numerics.quantize import (  # noqa: F401
        EMBEDDING_PATTERNS,
        INPUTS,
        quantize_array,
        raise_if_nonfinite,
        target_dtype,
    )
    from engine.numerics.quantize import __all__ as __all__
except ModuleNotFoundError as _exc:  # Numba and llvmlite: the ``kernels`` extra
    raise _Missing.of(_exc, "engine.quantize_int8 and int8 quantization (the Numba kernels)") from None
