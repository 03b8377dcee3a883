"""safetensors-engine: a strict, fast reader, streamer and writer of safetensors weights.

``import engine`` stays light: it imports no numpy, torch, CuPy or Numba.  Public names
are resolved on first use from the module that owns them; reading headers (names, dtypes,
shapes, metadata) imports no numpy either, and the first array does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> module that defines it; imported on first attribute access
_LAZY = {
    # the error hierarchy: a first open that succeeds creates none of its classes
    "CacheWriteWarning": "engine.errors",
    "Cancelled": "engine.errors",
    "CheckpointIndexError": "engine.errors",
    "ChecksumError": "engine.errors",
    "ConfigError": "engine.errors",
    "DeviceError": "engine.errors",
    "DeviceFallbackWarning": "engine.errors",
    "DistributedLoadError": "engine.errors",
    "HeaderError": "engine.errors",
    "InvalidSliceError": "engine.errors",
    "MissingDependencyError": "engine.errors",
    "MissingShardError": "engine.errors",
    "NonFiniteError": "engine.errors",
    "OptionError": "engine.errors",
    "RangeIgnoredWarning": "engine.errors",
    "ReadError": "engine.errors",
    "RemoteFileNotFoundError": "engine.errors",
    "SafetensorError": "engine.errors",
    "SerializationError": "engine.errors",
    "SerializationTypeError": "engine.errors",
    "ShardingError": "engine.errors",
    "SharedTensorsError": "engine.errors",
    "TensorMismatchError": "engine.errors",
    "TensorNotFoundError": "engine.errors",
    "UnrepresentableTensorError": "engine.errors",
    "UnsupportedFrameworkError": "engine.errors",
    "WriteError": "engine.errors",
    "read_header": "engine.apps.entry_points",  # a path or a URL
    "Header": "engine.format.header",
    "TensorInfo": "engine.format.header",
    "MAX_HEADER_SIZE": "engine.format.header",
    "safe_open": "engine.apps.opener",
    "_safe_open_handle": "engine.loading.file_object",
    "TensorSpec": "engine.writing.tensorspec",
    "serialize": "engine.writing.tensorspec",
    "serialize_file": "engine.writing.tensorspec",
    "deserialize": "engine.writing.tensorspec",
    "stream": "engine.apps.entry_points",
    "load_into": "engine.apps.entry_points",
    "keep_staging": "engine.gpu.rings",
    "keep_mappings": "engine.io.kept_mappings",
    "prepare_device": "engine.loading.loader",
    "load_records": "engine.gpu.records",
    "LoadRecord": "engine.gpu.records",
    "load_file": "engine.numpy",
    "load": "engine.numpy",
    "save_file": "engine.writing.writer",
    "save": "engine.writing.writer",
    "add_checksums": "engine.format.checksums",
    # sharded checkpoints (index + shards, or one file, as one checkpoint)
    "open_checkpoint": "engine.apps.entry_points",  # a path or a URL
    "save_sharded": "engine.checkpoints.shards",
    "Checkpoint": "engine.checkpoints.checkpoint",
    "read_checkpoint_info": "engine.apps.entry_points",  # a path or a URL
    # kernels (Numba is imported only when one of these is used)
    "stats": "engine.statistics",
    "Stats": "engine.statistics",
    "stats_file": "engine.apps.checkpoint_stats",
    "quantize_int8": "engine.quantize",
    "dequantize_int8": "engine.quantize",
    "Int8": "engine.quantize",
    "QuantizedTensor": "engine.quantize",
    "quantize_file": "engine.apps.quantized_format",
    "load_quantized": "engine.apps.quantized_format",
    "WeightValidator": "engine.apps.validator",
    "ValidationReport": "engine.apps.validator",
}



__all__ = list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        if name == "errors":  # ``import engine; engine.errors.X`` keeps working
            return importlib.import_module("engine.errors")
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # pragma: no cover
    from engine.apps.entry_points import load_into, open_checkpoint, read_checkpoint_info, read_header, stream
    from engine.apps.opener import safe_open
    from engine.checkpoints.checkpoint import Checkpoint
    from engine.checkpoints.shards import save_sharded
    from engine.errors import (
        CacheWriteWarning,
        Cancelled,
        CheckpointIndexError,
        ChecksumError,
        ConfigError,
        DeviceError,
        DeviceFallbackWarning,
        DistributedLoadError,
        HeaderError,
        InvalidSliceError,
        MissingDependencyError,
        MissingShardError,
        NonFiniteError,
        OptionError,
        RangeIgnoredWarning,
        ReadError,
        RemoteFileNotFoundError,
        SafetensorError,
        SerializationError,
        SerializationTypeError,
        ShardingError,
        SharedTensorsError,
        TensorMismatchError,
        TensorNotFoundError,
        UnrepresentableTensorError,
        UnsupportedFrameworkError,
        WriteError,
    )
    from engine.format.checksums import add_checksums
    from engine.format.header import MAX_HEADER_SIZE, Header, TensorInfo
    from engine.gpu.records import LoadRecord, load_records
    from engine.gpu.rings import keep_staging
    from engine.io.kept_mappings import keep_mappings
    from engine.loading.file_object import _safe_open_handle
    from engine.loading.loader import prepare_device
    from engine.numpy import load, load_file
    from engine.writing.tensorspec import TensorSpec, deserialize, serialize, serialize_file
    from engine.writing.writer import save, save_file
