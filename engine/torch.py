"""torch flavour of the reference API: ``load_file``, ``load``, ``save_file``, ``save``.

Importing this module imports torch: that is the opt-in.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from . import writer
from .api import safe_open, views
from .errors import SerializationError
from .header import parse_buffer
from .sinks.torch import TorchSink

__all__ = ["load_file", "load", "save_file", "save"]


def load_file(
    filename, device: Union[str, int, torch.device] = "cpu", *, backend: str = "mmap"
) -> dict[str, torch.Tensor]:
    """Load every tensor of a file as torch tensors.

    Parameters
    ----------
    filename : str or os.PathLike
    device : str, int or torch.device, default "cpu"
    backend : {"mmap", "pread"}
        ``"mmap"``: tensors view a private mapping (writable, copy-on-write);
        ``"pread"``: owned tensors filled by positional reads.

    Returns
    -------
    dict of str to torch.Tensor, in file order.

    Notes
    -----
    Copies of tensor bytes on the CPU: 0 with "mmap", 1 with "pread"; a CUDA device adds
    one host-to-device copy.
    """
    with safe_open(filename, framework="pt", device=device, backend=backend) as f:
        return f.get_tensors()


def load(data: bytes) -> dict[str, torch.Tensor]:
    """Load tensors from the bytes of a whole safetensors file.

    Notes
    -----
    Copies of tensor bytes: 1.  ``bytes`` are immutable while torch tensors are writable, so
    the data region is copied once into one ``bytearray`` that the tensors share.
    """
    header = parse_buffer(data)
    # one owned copy of the data region (at least one byte: torch cannot wrap an empty buffer)
    owned = bytearray(memoryview(data)[header.data_start :]) or bytearray(1)
    sink = TorchSink()
    return views(sink, sink.map(owned), header, header.table.order.tolist(), 0)


def _check(tensors) -> None:
    if not isinstance(tensors, dict):
        raise SerializationError(f"expected a dict of str to torch.Tensor, got {type(tensors).__name__}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise SerializationError(f"tensor {name!r} is a {type(t).__name__}, expected torch.Tensor", tensors=(name,))


def save_file(tensors: dict, filename, metadata: Optional[dict[str, str]] = None) -> None:
    """Write torch tensors to ``filename`` atomically; see :func:`engine.writer.save_file`."""
    _check(tensors)
    writer.save_file(tensors, os.fspath(filename), metadata)


def save(tensors: dict, metadata: Optional[dict[str, str]] = None) -> bytes:
    """The bytes of a safetensors file holding ``tensors``; see :func:`engine.writer.save`."""
    _check(tensors)
    return writer.save(tensors, metadata)
