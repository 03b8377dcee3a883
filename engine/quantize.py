"""Int8 quantization of one array (per-channel absmax scales) and its inverse: the public face
of :mod:`engine.numerics.quantize`.

Kept whole for the callers of this path; the engine's own modules import
:mod:`engine.numerics.quantize`.
"""

from __future__ import annotations

from .numerics.quantize import (  # noqa: F401 - its other public names
    EMBEDDING_PATTERNS,
    INPUTS,
    Int8,
    NonFiniteError,
    NonFiniteWarning,
    QuantizedTensor,
    dequantize_int8,
    quantize_array,
    quantize_int8,
    raise_if_nonfinite,
    target_dtype,
)

__all__ = [
    "quantize_int8",
    "dequantize_int8",
    "Int8",
    "QuantizedTensor",
    "NonFiniteError",
    "NonFiniteWarning",
]
