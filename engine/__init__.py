"""safetensors-engine: a strict, fast reader, streamer and writer of safetensors weights.

``import engine`` stays light: it imports no numpy, torch, CuPy or Numba.  Public names
are resolved on first use from the module that owns them; reading headers (names, dtypes,
shapes, metadata) imports no numpy either, and the first array does.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

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

__version__ = "0.1.0"

# public name -> module that defines it; imported on first attribute access
_LAZY = {
    "read_header": "engine.apps.opener",  # a path or a URL
    "Header": "engine.format.header",
    "TensorInfo": "engine.format.header",
    "MAX_HEADER_SIZE": "engine.format.header",
    "safe_open": "engine.apps.opener",
    "_safe_open_handle": "engine.loading.file_handle",
    "TensorSpec": "engine.writing.tensorspec",
    "serialize": "engine.writing.tensorspec",
    "serialize_file": "engine.writing.tensorspec",
    "deserialize": "engine.writing.tensorspec",
    "stream": "engine.apps.opener",
    "load_into": "engine.apps.opener",
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
    "open_checkpoint": "engine.apps.opener",  # a path or a URL
    "save_sharded": "engine.checkpoints.shards",
    "Checkpoint": "engine.checkpoints.checkpoint",
    "read_checkpoint_info": "engine.apps.opener",  # a path or a URL
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



__all__ = [
    "CacheWriteWarning",
    "Cancelled",
    "ChecksumError",
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
    "DistributedLoadError",
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
    from engine.apps.opener import (
        load_into,
        open_checkpoint,
        read_checkpoint_info,
        read_header,
        safe_open,
        stream,
    )
    from engine.checkpoints.checkpoint import Checkpoint
    from engine.checkpoints.shards import save_sharded
    from engine.format.checksums import add_checksums
    from engine.format.header import MAX_HEADER_SIZE, Header, TensorInfo
    from engine.gpu.records import LoadRecord, load_records
    from engine.gpu.rings import keep_staging
    from engine.io.kept_mappings import keep_mappings
    from engine.loading.file_handle import _safe_open_handle
    from engine.loading.loader import prepare_device
    from engine.numpy import load, load_file
    from engine.writing.tensorspec import TensorSpec, deserialize, serialize, serialize_file
    from engine.writing.writer import save, save_file
