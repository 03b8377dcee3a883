"""Statistics and int8 quantization of a tensor on a CUDA device (Numba's CUDA target): the
public face of :mod:`engine.numerics.device`.

Kept whole for the callers of this path; the engine's own modules import
:mod:`engine.numerics.device`.
"""

from __future__ import annotations

from .numerics.device import (  # noqa: F401 - its other public names
    DEFAULT_LAUNCH,
    SIMULATOR,
    SUPPORTED_NAMES,
    DeviceAccumulator,
    DeviceQuantizer,
    LaunchConfig,
    as_device_array,
    default_empty,
    device_stats,
    empty_like_framework,
    numba_stream,
    on_gpu,
    probe,
    quantize_int8_device,
)

__all__ = [
    "DeviceAccumulator",
    "DeviceQuantizer",
    "LaunchConfig",
    "device_stats",
    "default_empty",
    "empty_like_framework",
    "on_gpu",
    "probe",
    "quantize_int8_device",
    "SUPPORTED_NAMES",
]
