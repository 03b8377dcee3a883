"""Open whatever a model ships as: one ``.safetensors`` file, or a checkpoint (an index or a
directory of shards), through one name.

Kept apart from :mod:`engine.checkpoints.checkpoint` so that opening a single file, the common case
and the one short-lived tools pay for, never loads the checkpoint code; the other entry points that
take a path or a URL alike live in :mod:`engine.apps.entry_points`.
"""

from __future__ import annotations

import os
import sys

from engine.loading import file_handle

__all__ = ["safe_open", "is_checkpoint_path"]


def is_checkpoint_path(path) -> bool:
    """True for what opens as a whole checkpoint rather than one file: an index or a directory."""
    text = os.fspath(path)
    return text.endswith(".json") or os.path.isdir(text)


class _OpensBoth(type):
    """The type of :class:`safe_open`: what it returns is an instance of it, a file's handle
    or a :class:`~engine.checkpoints.checkpoint.Checkpoint` alike, so ``isinstance`` tells the truth.

    A checkpoint is recognised only once :mod:`engine.checkpoints.checkpoint` is imported (it must be, for
    one to exist): this module stays below it and opening a file never loads it.
    """

    def __instancecheck__(cls, obj) -> bool:
        return super().__instancecheck__(obj) or (cls is safe_open and _is_checkpoint(type(obj)))

    def __subclasscheck__(cls, sub) -> bool:
        return super().__subclasscheck__(sub) or (cls is safe_open and _is_checkpoint(sub))


def _is_url(path) -> bool:
    """:func:`engine.base._files.is_url`, imported only for a name that can be a URL (a ``str``
    holding ``://``): a first open of a local file loads none of it."""
    if not isinstance(path, str) or "://" not in path:
        return False
    from engine.base._files import is_url

    return is_url(path)


def _is_checkpoint(kind) -> bool:
    """A :class:`~engine.checkpoints.checkpoint.Checkpoint` or a :class:`~engine.urls.remote_handle.RemoteHandle`."""
    if not isinstance(kind, type):
        return False
    checkpoint = sys.modules.get("engine.checkpoints.checkpoint")
    remote = sys.modules.get("engine.urls.remote_handle")
    return (checkpoint is not None and issubclass(kind, checkpoint.Checkpoint)) or (
        remote is not None and issubclass(kind, remote.RemoteHandle))


class safe_open(file_handle.safe_open, metaclass=_OpensBoth):  # noqa: N801 - the reference's spelling, for a drop-in replacement
    """:class:`engine.loading.file_handle.safe_open` for a file, and :class:`engine.checkpoints.checkpoint.Checkpoint`
    for an index or a directory: ``engine.safe_open(path)`` opens whatever a model ships as.

    Parameters and methods are those of :class:`engine.loading.file_handle.safe_open`; an index or a
    directory gives a :class:`~engine.checkpoints.checkpoint.Checkpoint` with the same methods across
    its shards; an ``http(s)://``, ``s3://`` or fsspec URL (a file, an index or a prefix) a
    :class:`~engine.urls.remote_handle.RemoteHandle` that reads only the bytes asked for (with
    ``cache_dir=``, from local copies it first downloads there).  All are instances of this
    class (``isinstance(f, engine.safe_open)``).
    """

    def __new__(cls, filename, *args, **kwargs):
        if cls is safe_open and _is_url(filename):
            from engine.urls.remote_handle import RemoteHandle

            return RemoteHandle(filename, *args, **kwargs)
        if cls is safe_open and is_checkpoint_path(filename):
            from engine.checkpoints.checkpoint import Checkpoint

            return Checkpoint(filename, *args, **kwargs)
        return super().__new__(cls)
