"""Int8 quantization of one array (per-channel absmax scales) and its inverse.

The public path of :mod:`engine.numerics.quantize`, which holds the code (the engine's own
modules import it there): its ``__all__`` and its other public names.
"""

from .numerics.quantize import *  # noqa: F403
from .numerics.quantize import EMBEDDING_PATTERNS, INPUTS, quantize_array, raise_if_nonfinite, target_dtype  # noqa: F401
from .numerics.quantize import __all__ as __all__
