"""safetensors-engine: a strict, fast reader, streamer and writer of safetensors weights.

``import engine`` stays light: it imports no numpy, torch, CuPy or Numba.  Public names
are resolved on first use from the module that owns them; reading headers (names, dtypes,
shapes, metadata) imports no numpy either, and the first array does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import (
    CacheWriteWarning,
    Cancelled,
    CheckpointIndexError,
    ConfigError,
    DeviceError,
    DeviceFallbackWarning,
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

__version__ = "0.1.0"

# public name -> module that defines it; imported on first attribute access
_LAZY = {
    "read_header": "engine.opener",  # a path or a URL
    "Header": "engine.header",
    "TensorInfo": "engine.header",
    "MAX_HEADER_SIZE": "engine.header",
    "safe_open": "engine.opener",
    "_safe_open_handle": "engine.file_handle",
    "TensorSpec": "engine.tensorspec",
    "serialize": "engine.tensorspec",
    "serialize_file": "engine.tensorspec",
    "deserialize": "engine.tensorspec",
    "stream": "engine.opener",
    "load_into": "engine.opener",
    "keep_staging": "engine.device_staging",
    "keep_mappings": "engine.kept_mappings",
    "prepare_device": "engine.loader",
    "load_records": "engine.device_ring",
    "LoadRecord": "engine.device_ring",
    "load_file": "engine.numpy",
    "load": "engine.numpy",
    "save_file": "engine.writer",
    "save": "engine.writer",
    # sharded checkpoints (index + shards, or one file, as one checkpoint)
    "open_checkpoint": "engine.opener",  # a path or a URL
    "save_sharded": "engine.shards",
    "Checkpoint": "engine.checkpoint",
    "read_checkpoint_info": "engine.opener",  # a path or a URL
    # kernels (Numba is imported only when one of these is used)
    "stats": "engine.statistics",
    "Stats": "engine.statistics",
    "stats_file": "engine.checkpoint_stats",
    "quantize_int8": "engine.quantize",
    "dequantize_int8": "engine.quantize",
    "Int8": "engine.quantize",
    "QuantizedTensor": "engine.quantize",
    "quantize_file": "engine.quantized_format",
    "load_quantized": "engine.quantized_format",
    "WeightValidator": "engine.validator",
    "ValidationReport": "engine.validator",
}

__all__ = [
    "CacheWriteWarning",
    "Cancelled",
    "CheckpointIndexError",
    "ConfigError",
    "DeviceError",
    "DeviceFallbackWarning",
    "HeaderError",
    "InvalidSliceError",
    "MissingDependencyError",
    "MissingShardError",
    "NonFiniteError",
    "OptionError",
    "RangeIgnoredWarning",
    "ReadError",
    "RemoteFileNotFoundError",
    "SafetensorError",
    "SerializationError",
    "SerializationTypeError",
    "ShardingError",
    "SharedTensorsError",
    "TensorMismatchError",
    "TensorNotFoundError",
    "UnrepresentableTensorError",
    "UnsupportedFrameworkError",
    "WriteError",
    *_LAZY,
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # pragma: no cover
    from .checkpoint import Checkpoint
    from .device_ring import LoadRecord, load_records
    from .device_staging import keep_staging
    from .file_handle import _safe_open_handle
    from .header import MAX_HEADER_SIZE, Header, TensorInfo
    from .kept_mappings import keep_mappings
    from .loader import prepare_device
    from .numpy import load, load_file
    from .opener import load_into, open_checkpoint, read_checkpoint_info, read_header, safe_open, stream
    from .shards import save_sharded
    from .tensorspec import TensorSpec, deserialize, serialize, serialize_file
    from .writer import save, save_file
