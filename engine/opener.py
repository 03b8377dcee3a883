"""Open whatever a model ships as: one ``.safetensors`` file, or a checkpoint (an index or a
directory of shards), through one name.

Kept apart from :mod:`engine.checkpoint` so that opening a single file, the common case
and the one short-lived tools pay for, never loads the checkpoint code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from . import file_handle
from ._files import is_url

__all__ = ["safe_open", "load_into", "stream", "is_checkpoint_path"]


def is_checkpoint_path(path) -> bool:
    """True for what opens as a whole checkpoint rather than one file: an index or a directory."""
    text = os.fspath(path)
    return text.endswith(".json") or os.path.isdir(text)


class _OpensBoth(type):
    """The type of :class:`safe_open`: what it returns is an instance of it, a file's handle
    or a :class:`~engine.checkpoint.Checkpoint` alike, so ``isinstance`` tells the truth.

    A checkpoint is recognised only once :mod:`engine.checkpoint` is imported (it must be, for
    one to exist): this module stays below it and opening a file never loads it.
    """

    def __instancecheck__(cls, obj) -> bool:
        return super().__instancecheck__(obj) or (cls is safe_open and _is_checkpoint(type(obj)))

    def __subclasscheck__(cls, sub) -> bool:
        return super().__subclasscheck__(sub) or (cls is safe_open and _is_checkpoint(sub))


def _is_checkpoint(kind) -> bool:
    """A :class:`~engine.checkpoint.Checkpoint` or a :class:`~engine.remote_handle.RemoteHandle`."""
    if not isinstance(kind, type):
        return False
    checkpoint = sys.modules.get("engine.checkpoint")
    remote = sys.modules.get("engine.remote_handle")
    return (checkpoint is not None and issubclass(kind, checkpoint.Checkpoint)) or (
        remote is not None and issubclass(kind, remote.RemoteHandle))


class safe_open(file_handle.safe_open, metaclass=_OpensBoth):  # noqa: N801 - the reference's spelling, for a drop-in replacement
    """:class:`engine.file_handle.safe_open` for a file, and :class:`engine.checkpoint.Checkpoint`
    for an index or a directory: ``engine.safe_open(path)`` opens whatever a model ships as.

    Parameters and methods are those of :class:`engine.file_handle.safe_open`; an index or a
    directory gives a :class:`~engine.checkpoint.Checkpoint` with the same methods across
    its shards; an ``http(s)://``, ``s3://`` or fsspec URL (a file, an index or a prefix) a
    :class:`~engine.remote_handle.RemoteHandle` that reads only the bytes asked for.  All are
    instances of this class (``isinstance(f, engine.safe_open)``).
    """

    def __new__(cls, filename, *args, **kwargs):
        if cls is safe_open and is_url(filename):
            from .remote_handle import RemoteHandle

            return RemoteHandle(filename, *args, **kwargs)
        if cls is safe_open and is_checkpoint_path(filename):
            from .checkpoint import Checkpoint

            return Checkpoint(filename, *args, **kwargs)
        return super().__new__(cls)


def load_into(path, tensors: Mapping[str, Any], **options) -> list[str]:
    """Fill existing tensors in place from a file, or from a checkpoint (an index or a
    directory) as one load across its shards.

    Parameters, returns, errors and copies as :func:`engine.loader.load_into`; for a
    checkpoint the names come shard by shard (sorted shards), in file order within each,
    and ``strict`` counts the tensors of every shard.  An ``http(s)://``, ``s3://`` or other
    fsspec URL loads with parallel ranged reads (:func:`engine.remote_load.load_into`).
    When a load fails part way, the error's ``.filled`` names the destinations whose bytes
    all landed.
    """
    if is_url(path):
        from . import remote_load

        return remote_load.load_into(path, tensors, **options)
    if not is_checkpoint_path(path):
        from . import loader  # the threaded pipeline: opening a file needs none of it

        return loader.load_into(path, tensors, **options)
    from .checkpoint import Checkpoint
    from .header import MAX_HEADER_SIZE

    max_header_size = options.pop("max_header_size", MAX_HEADER_SIZE)
    with Checkpoint(path, backend="pread", max_header_size=max_header_size) as c:
        return c.load_into(tensors, **options)


def stream(path, **options):
    """Yield ``(name, tensor)`` as each tensor finishes loading: :func:`engine.loader.stream`
    for local files (a checkpoint's directory or index: its shards as one pipeline),
    :func:`engine.remote_load.stream` for a URL (``http(s)://``, ``s3://`` or another fsspec
    protocol: a file, an index or a prefix), with the same options."""
    if is_url(path):
        from . import remote_load

        return remote_load.stream(path, **options)
    from . import loader

    if isinstance(path, (str, os.PathLike)) and is_checkpoint_path(path):
        # a checkpoint's directory or index: its shards, read as one pipeline
        from .checkpoint_info import read_checkpoint_info

        info = read_checkpoint_info(path, **{k: options[k] for k in ("max_header_size",) if k in options})
        shards = [info.shard_path(s) for s in info.shards]
        return loader.stream(shards if len(shards) != 1 else shards[0], **options)
    return loader.stream(path, **options)

