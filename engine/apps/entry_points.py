"""The entry points that take a local path or a URL alike: ``engine.read_header``,
``engine.read_checkpoint_info``, ``engine.open_checkpoint``, ``engine.load_into`` and
``engine.stream`` (``engine.safe_open`` is :mod:`engine.apps.opener`'s, apart so that a first
open loads none of this).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from engine.apps.opener import is_checkpoint_path
from engine.base._files import is_url

__all__ = ["load_into", "stream", "read_header", "read_checkpoint_info", "open_checkpoint", "memory_limit"]


def read_header(path, *, max_header_size: int | None = None, strict: bool = False, **options):
    """:func:`engine.format.header.read_header` for a path, :func:`engine.urls.remote.read_header` for a
    URL (``http(s)://``, ``s3://`` or another fsspec protocol; a file, or a prefix that holds
    one ``model.safetensors``): ``engine.read_header`` takes both.

    Parameters
    ----------
    path : str or os.PathLike
        A ``.safetensors`` file or its URL.
    max_header_size : int, optional
        Largest header accepted (default :data:`engine.format.header.MAX_HEADER_SIZE`).
    strict : bool, default False
        For a local file, as :func:`engine.format.header.read_header` takes it.
    **options
        For a URL: ``timeout``, ``headers``, ``max_redirects``, ``storage_options`` (see
        :func:`engine.urls.remote.read_metadata`); a local path takes none.

    Returns
    -------
    Header

    Raises
    ------
    HeaderError, ReadError, OSError
        As :func:`engine.format.header.read_header` (a path) or :func:`engine.urls.remote.read_header`
        (a URL) raise them; a URL's errors name the URL and the reason
        (``RemoteFileNotFoundError`` for a 404, ``ReadError`` with ``reason="ConnectionError"``
        for a refused connection, at once).
    """
    from engine.format.header import MAX_HEADER_SIZE

    limit = MAX_HEADER_SIZE if max_header_size is None else max_header_size
    if is_url(path):
        from engine.urls import remote

        return remote.read_header(path, max_header_size=limit, **options)
    if options:
        raise TypeError(f"options for URLs only, given for a local path: {sorted(options)}")
    from engine.format.header import read_header as read_local

    return read_local(path, max_header_size=limit, strict=strict)


def read_checkpoint_info(path, *, max_header_size: int | None = None, max_workers: int | None = None, **options):
    """:func:`engine.checkpoints.checkpoint.read_checkpoint_info` for a path, :func:`engine.urls.remote.read_metadata`
    for a URL of a file, an index or a prefix (as :func:`engine.torch.load_file` resolves
    one): ``engine.read_checkpoint_info`` takes both.

    Parameters
    ----------
    path : str or os.PathLike
        A file, an index, a directory, or a URL of any of them (a prefix ending in ``/``).
    max_header_size : int, optional
        Largest header per file, and largest index, in bytes.
    max_workers : int, optional
        Files whose headers are read at once (default: up to 8).
    **options
        For a URL: ``timeout``, ``headers``, ``max_redirects``, ``max_shards``,
        ``storage_options`` (see :func:`engine.urls.remote.read_metadata`).

    Returns
    -------
    CheckpointInfo

    Raises
    ------
    As :func:`engine.checkpoints.checkpoint.read_checkpoint_info` or :func:`engine.urls.remote.read_metadata`.
    """
    from engine.format.header import MAX_HEADER_SIZE

    limit = MAX_HEADER_SIZE if max_header_size is None else max_header_size
    if is_url(path):
        from engine.urls import remote

        return remote.read_metadata(path, max_header_size=limit, max_workers=max_workers, **options)
    if options:
        raise TypeError(f"options for URLs only, given for a local path: {sorted(options)}")
    from engine.checkpoints.checkpoint import read_checkpoint_info as read_local

    return read_local(path, max_header_size=limit, max_workers=max_workers)


def open_checkpoint(path, framework: str = "numpy", device: Any = "cpu", *, backend: str = "mmap",
                    max_header_size: int | None = None, max_workers: int | None = None, **options):
    """:func:`engine.checkpoints.checkpoint.open_checkpoint` for a path; for a URL of a file, an index
    or a prefix, a :class:`~engine.urls.remote_handle.RemoteHandle` with the same methods
    (``keys``, ``offset_keys``, ``metadata``, ``get_tensor``, ``get_slice``,
    ``get_tensors``, ``info``) that reads only the bytes asked for.

    Parameters
    ----------
    path : str or os.PathLike
        A file, an index, a directory, or a URL of any of them.
    framework, device
        As :func:`engine.checkpoints.checkpoint.open_checkpoint` takes them.
    backend : {"mmap", "pread"}, default "mmap"
        Local files only (a remote file has no mapping).
    max_header_size, max_workers : int, optional
        As :func:`engine.checkpoints.checkpoint.open_checkpoint` takes them.
    **options
        For a URL: ``headers``, ``timeout``, ``connections``, ``retry``, ``s3``,
        ``storage_options``, ``max_redirects``, ``max_shards``, ``cache_dir`` (the files
        downloaded there first, then read from there: see
        :class:`~engine.urls.remote_handle.RemoteHandle` and :func:`engine.urls.remote_load.stream`).

    Returns
    -------
    Checkpoint or RemoteHandle
        Both are context managers and instances of :class:`engine.safe_open`.

    Notes
    -----
    Copies of tensor bytes: as :class:`engine.safe_open` for local files; 1 per tensor for
    a URL (socket to the tensor, or the local copy to the tensor with ``cache_dir``).
    """
    from engine.format.header import MAX_HEADER_SIZE

    limit = MAX_HEADER_SIZE if max_header_size is None else max_header_size
    if is_url(path):
        from engine.urls.remote_handle import RemoteHandle

        return RemoteHandle(path, framework, device, max_header_size=limit, **options)
    if options:
        raise TypeError(f"options for URLs only, given for a local path: {sorted(options)}")
    from engine.checkpoints.checkpoint import open_checkpoint as open_local

    return open_local(path, framework, device, backend=backend, max_header_size=limit, max_workers=max_workers)


def load_into(path, tensors: Mapping[str, Any], **options) -> list[str]:
    """Fill existing tensors in place from a file, or from a checkpoint (an index or a
    directory) as one load across its shards.

    Parameters, returns, errors and copies as :func:`engine.loading.fill.load_into`; for a
    checkpoint the names come shard by shard (sorted shards), in file order within each,
    and ``strict`` counts the tensors of every shard.  An ``http(s)://``, ``s3://`` or other
    fsspec URL loads with parallel ranged reads (:func:`engine.urls.remote_load.load_into`;
    ``cache_dir=`` keeps local copies, see :mod:`engine.urls.remote_cache`).
    ``process_group=`` (a ``torch.distributed`` group; every rank calls this with the same
    source) reads each byte once in the group and sends it to the other ranks
    (:func:`engine.apps.group_load.load_into`).
    When a load fails part way, the error's ``.filled`` names the destinations whose bytes
    all landed.  ``verify_checksums=False`` skips the check of the checksums a file records
    (:mod:`engine.format.checksums`; on by default): a tensor that fails it raises
    :class:`~engine.errors.ChecksumError`, its destination holding the bytes that landed.
    """
    if options.get("process_group") is not None:
        from engine.apps.group_load import load_into as group_load_into

        return group_load_into(path, tensors, options.pop("process_group"), **options)
    options.pop("process_group", None)
    memory_limit(options, _on_device(tensors.values()), sizes_ring=False)
    if is_url(path):
        from engine.urls import remote_load

        return remote_load.load_into(path, tensors, **options)
    from engine.format.verification import verification

    with verification(options.pop("verify_checksums", None)):
        if not is_checkpoint_path(path):
            from engine.loading import fill  # the threaded pipeline: opening a file needs none of it

            return fill.load_into(path, tensors, **options)
        from engine.checkpoints.checkpoint import Checkpoint
        from engine.format.header import MAX_HEADER_SIZE

        max_header_size = options.pop("max_header_size", MAX_HEADER_SIZE)
        with Checkpoint(path, backend="pread", max_header_size=max_header_size) as c:
            return c.load_into(tensors, **options)


def stream(path, **options):
    """Yield ``(name, tensor)`` as each tensor finishes loading: :func:`engine.loading.loader.stream`
    for local files (a checkpoint's directory or index: its shards as one pipeline),
    :func:`engine.urls.remote_load.stream` for a URL (``http(s)://``, ``s3://`` or another fsspec
    protocol: a file, an index or a prefix; ``cache_dir=`` keeps local copies, see
    :mod:`engine.urls.remote_cache`), with the same options.  ``process_group=`` (a
    ``torch.distributed`` group; every rank calls this with the same source and consumes the
    stream to its end) reads each byte once in the group and yields each tensor on every rank
    as its last bucket is exchanged (:func:`engine.apps.group_load.stream`; the CPU, or a CUDA
    ``device`` for torch tensors; ``stats`` and ``quantize`` as here on the CPU, ``cache_dir``
    for URLs)."""
    if options.get("process_group") is not None:
        return _group_stream(path, **options)
    options.pop("process_group", None)
    memory_limit(options, str(options.get("device", "cpu")).partition(":")[0] not in ("cpu", ""))
    if is_url(path):
        from engine.urls import remote_load

        return remote_load.stream(path, **options)
    from engine.loading import loader

    if isinstance(path, (str, os.PathLike)) and is_checkpoint_path(path):
        # a checkpoint's directory or index: its shards, read as one pipeline
        from engine.checkpoints.checkpoint_info import read_checkpoint_info

        info = read_checkpoint_info(path, **{k: options[k] for k in ("max_header_size",) if k in options})
        shards = [info.shard_path(s) for s in info.shards]
        return loader.stream(shards if len(shards) != 1 else shards[0], **options)
    return loader.stream(path, **options)


def _group_stream(path, *, process_group, framework: str = "pt", device: Any = "cpu", **options):
    """:func:`stream` shared by a process group (:func:`engine.apps.group_load.stream`)."""
    from engine.apps.group_load import stream as group_stream

    return group_stream(path, process_group, framework=framework, device=device, **options)


def memory_limit(options: dict, on_device: bool, *, sizes_ring: bool = True) -> None:
    """``memory_limit=`` of a load in one process (:mod:`engine.planning.memory`), checked and
    taken out of ``options``.  A host load reads into its outputs and stages nothing beyond
    them, so any limit holds.  A device load stages through the ring's page-locked chunks:
    where the path takes ``slot_bytes`` (``sizes_ring``) the chunks are sized so that the ring
    fits the limit; elsewhere a limit below the default ring is an
    :class:`~engine.errors.OptionError` naming both."""
    from engine.planning import memory

    limit = memory.checked(options.pop("memory_limit", None))
    if limit is None or not on_device:
        return
    from engine.errors import OptionError
    from engine.gpu.geometry import default_geometry

    ring = default_geometry()
    if ring.pinned_bytes <= limit:
        return
    chunk = memory.ring_chunk(limit, ring.chunks)
    if sizes_ring and chunk and not options.get("slot_bytes"):
        options["slot_bytes"] = chunk
        return
    floor = 4096 * ring.chunks if sizes_ring else ring.pinned_bytes
    raise OptionError(f"memory_limit={limit} bytes is below the {floor} bytes of page-locked chunks this device load "
                      f"stages through{'' if sizes_ring else ' (engine.stream sizes its ring from the limit)'}",
                      option="memory_limit", reason="MemoryLimitTooLow")


def _on_device(tensors) -> bool:
    """Whether any of ``tensors`` (numpy, torch or CuPy) lives off the host."""
    for t in tensors:
        device = getattr(t, "device", None)
        if device is not None and str(getattr(device, "type", device)) not in ("cpu",):
            return True
    return False
