"""numpy flavour of the reference API: ``load_file``, ``load``, ``save_file``, ``save``.

Unlike the reference, every dtype of the format loads: BF16 and the FP8 types come back as
``ml_dtypes`` arrays, sub-byte types (F4, F6_*) as their packed bytes (``uint8``).
"""

from __future__ import annotations

import os

from engine.errors import MissingDependencyError as _Missing

try:
    import numpy as np
except ModuleNotFoundError as _exc:  # a core dependency: a broken environment
    raise _Missing.of(_exc, "engine.numpy (numpy arrays)") from None

from engine.apps.opener import safe_open
from engine.base._files import is_url
from engine.errors import SerializationError
from engine.format.header import parse_buffer
from engine.format.verification import verification
from engine.loading.handle_reads import views
from engine.sinks import host_block
from engine.sinks.numpy import NumpySink
from engine.writing import writer

# the reference's safetensors.numpy has them too
from engine.writing.tensorspec import TensorSpec as TensorSpec
from engine.writing.tensorspec import deserialize as deserialize
from engine.writing.tensorspec import serialize as serialize
from engine.writing.tensorspec import serialize_file as serialize_file

__all__ = ["load_file", "load", "save_file", "save"]


def load_file(
    filename, *, backend: str = "mmap", verify_checksums: bool | None = None, check_finite: bool = False,
    process_group=None, memory_limit: int | None = None, **remote
) -> dict[str, np.ndarray]:
    """Load every tensor of a file, or of a checkpoint, as numpy arrays.

    Parameters
    ----------
    filename : str or os.PathLike
        A ``.safetensors`` file, or a sharded checkpoint (its directory or its
        ``model.safetensors.index.json``), whose shards load as one.
    backend : {"mmap", "pread"}
        ``"mmap"``: zero-copy views of a private (copy-on-write) mapping, writable, a
        write never reaching the file; ``"pread"``: owned arrays.
    verify_checksums : bool, optional
        Check every tensor against the CRC-32C its file records, where it records them
        (:mod:`engine.format.checksums`), before returning; default True.  A mismatch raises
        :class:`~engine.errors.ChecksumError` and nothing is returned.
    check_finite : bool, default False
        Fail with :class:`~engine.errors.NonFiniteError` (naming the tensor and the counts)
        when a floating tensor holds NaN or Inf, counted as the bytes land by the statistics
        kernels (needs Numba; one local file; owned tensors, as :func:`engine.stream` makes
        them, whatever ``backend``).
    process_group : torch.distributed.ProcessGroup, optional
        A ``gloo`` group whose every rank loads the same checkpoint: the group reads it once,
        each rank a share, and every rank returns every array (owned; see
        :func:`engine.torch.load_file` and :mod:`engine.apps.group_load`).
    memory_limit : int, optional
        Host bytes the load may hold beyond the arrays it returns (:mod:`engine.planning.memory`):
        a load reads into its arrays and holds nothing more, so any limit holds.
    **remote
        For a URL only: ``headers``, ``timeout``, ``connections``, ``chunk_bytes``, ``retry``,
        ``s3``, ``storage_options``, ``cache_dir`` (a local copy written in the same pass,
        read by the next load; see :func:`engine.urls.remote_load.stream`).

    Returns
    -------
    dict of str to numpy.ndarray, in file order; writable, as the reference's.

    Notes
    -----
    Copies of tensor bytes: 0 with "mmap" (a page written is copied then, by the kernel),
    1 with "pread" (page cache to the array).
    """
    if check_finite:
        from engine.loading.loader import load_finite

        return load_finite(filename, "numpy", "cpu", verify_checksums)
    if process_group is not None:
        from engine.apps.group_load import load as group_load

        return group_load(filename, process_group, framework="numpy", verify_checksums=verify_checksums,
                          memory_limit=memory_limit, **remote)
    from engine.planning.memory import checked

    checked(memory_limit)  # host arrays: a load reads into them and holds nothing more
    with verification(verify_checksums):
        if is_url(filename):  # parallel ranged reads straight into the arrays
            from engine.urls.remote_load import load

            return load(filename, "numpy", **remote)
        if remote:
            raise TypeError(f"load_file() got options for a URL with a local path: {sorted(remote)}")
        with safe_open(filename, framework="numpy", backend=backend) as f:
            return f.get_tensors()


def load(data: bytes) -> dict[str, np.ndarray]:
    """Load tensors from the bytes of a whole safetensors file.

    Returns
    -------
    dict of str to numpy.ndarray, in file order; writable, as the reference's, and
    independent of ``data``.

    Notes
    -----
    Copies of tensor bytes: 1 (the data region into one private block the arrays view;
    ``data`` itself is neither kept nor changed).
    """
    header = parse_buffer(data)
    region = memoryview(data).cast("B")[header.data_start :]
    block = host_block(len(region))
    memoryview(block)[: len(region)] = region
    return views(NumpySink(), block, header.table, header.table.file_order(), 0)


def _check(tensor_dict) -> None:
    if not isinstance(tensor_dict, dict):
        raise SerializationError(f"expected a dict of str to numpy.ndarray, got {type(tensor_dict).__name__}")
    for name, arr in tensor_dict.items():
        if not isinstance(arr, np.ndarray):
            raise SerializationError(
                f"tensor {name!r} is a {type(arr).__name__}, expected numpy.ndarray", tensors=(name,)
            )


def save_file(tensor_dict: dict, filename, metadata: dict[str, str] | None = None, *, checksums: bool = False) -> None:
    """Write numpy arrays to ``filename`` atomically; see :func:`engine.writing.writer.save_file`
    (``checksums=True`` records every tensor's CRC-32C and the header's, verified by every load)."""
    _check(tensor_dict)
    writer.save_file(tensor_dict, os.fspath(filename), metadata, checksums=checksums)


def save(tensor_dict: dict, metadata: dict[str, str] | None = None, *, checksums: bool = False) -> bytes:
    """The bytes of a safetensors file holding ``tensor_dict``; see :func:`engine.writing.writer.save`."""
    _check(tensor_dict)
    return writer.save(tensor_dict, metadata, checksums=checksums)
