"""A checkpoint's layout and contents from its headers alone: which files an index, a
directory or a single file stands for (:func:`resolve`), and :class:`CheckpointInfo`,
:func:`read_checkpoint_info` and :func:`check_checkpoint`, which read the index and ``8 + N``
header bytes of every shard and no tensor.  :mod:`engine.checkpoints.checkpoint` opens the shards.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, NamedTuple, Union

from engine.base._files import is_url
from engine.base._threads import map_threads
from engine.base.dtypes import BY_NAME
from engine.errors import (
    CheckpointIndexError,
    MissingShardError,
    ReadError,
    SafetensorError,
    TensorNotFoundError,
)
from engine.format.checkpoint_index import index_problems, read_index
from engine.format.header import MAX_HEADER_SIZE, Header, TensorInfo, read_header

__all__ = [
    "SAFETENSORS_NAME", "INDEX_NAME", "Layout", "resolve", "open_layout", "read_shard_header", "missing_shard",
    "map_shards", "CheckpointInfo", "read_checkpoint_info", "check_checkpoint",
]

PathLike = Union[str, "os.PathLike[str]"]

#: The single-file name and the index name that Hugging Face tools look for.
SAFETENSORS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Above a few shards, more threads only queue on the same disk.
_MAX_THREADS = 8
# Opening a local shard takes tens of microseconds, less than handing it to a thread; a
# first shard slower than this (a network file system, a cold disk) opens the rest in
# parallel.
_SLOW_OPEN_S = 0.002


# --------------------------------------------------------------------------- layout


class Layout(NamedTuple):
    source: str  # what the caller passed
    directory: str  # where shard names are resolved
    index_path: str | None  # path of the index, None for a single file
    files: list[str]  # shard names relative to directory (for a single file: its base name)


def resolve(path: PathLike) -> Layout:
    """Decide what ``path`` is: an index, a directory holding one, or a single file."""
    spath = os.fspath(path)
    if is_url(spath):  # this floor has no network client: say where one is
        raise ReadError("a URL, and engine.checkpoints.checkpoint reads local checkpoints; engine.read_checkpoint_info, "
                        "engine.open_checkpoint and engine.urls.remote.read_metadata take URLs",
                        reason="LocalPathExpected", path=spath)
    if os.path.isdir(spath):
        for name in (SAFETENSORS_NAME, INDEX_NAME):
            # transformers' precedence: a single model.safetensors wins over an index
            if os.path.isfile(os.path.join(spath, name)):
                return resolve(os.path.join(spath, name))._replace(source=spath)
        entries = sorted(os.listdir(spath))
        indexes = [e for e in entries if e.endswith(".safetensors.index.json")]
        files = [e for e in entries if e.endswith(".safetensors") and not e.startswith(".")]
        if len(indexes) == 1:
            return resolve(os.path.join(spath, indexes[0]))._replace(source=spath)
        if not indexes and len(files) == 1:
            return resolve(os.path.join(spath, files[0]))._replace(source=spath)
        found = indexes or files
        raise SafetensorError(
            f"the directory holds no {SAFETENSORS_NAME} or {INDEX_NAME}, and "
            + (f"{len(found)} candidates ({', '.join(found[:5])}); pass the one to open" if found else "no safetensors file"),
            reason="NoCheckpoint",
            path=spath,
        )
    # "" for a bare file name: joined with it, a shard's path is shown as the user wrote it
    # ("x.safetensors", not "./x.safetensors")
    directory = os.path.dirname(spath)
    if spath.endswith(".json"):
        return Layout(spath, directory, spath, [])
    return Layout(spath, directory, None, [os.path.basename(spath)])


def missing_shard(shard: str, layout: Layout, exc: OSError) -> SafetensorError:
    where = f"listed in {layout.index_path}" if layout.index_path else "the checkpoint's file"
    return MissingShardError(f"shard {shard!r} ({where}) does not exist", path=os.path.join(layout.directory, shard))


def map_shards(fn, shards: list[str], max_workers: int | None, undo=None) -> list:
    """``[fn(s) for s in shards]``: the first inline, the rest on threads only if it was slow."""
    return map_threads(fn, shards, max(1, min(len(shards), max_workers or _MAX_THREADS)), name="engine-shard",
                       inline_under=_SLOW_OPEN_S, undo=undo)


# --------------------------------------------------------------------------- info


def _parameters(headers: Iterable[Header]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for header in headers:
        for dtype, count in header.parameters().items():
            if dtype != "total":
                counts[dtype] = counts.get(dtype, 0) + count
    out = {d: counts[d] for d in sorted(counts, key=lambda d: BY_NAME[d].code)}
    out["total"] = sum(counts.values())
    return out


class CheckpointInfo:
    """The headers of a checkpoint (one file, or an index and its shards); no tensor bytes.

    Built by :func:`read_checkpoint_info` for local paths and by
    :func:`engine.urls.remote.read_metadata` for URLs, so both describe a checkpoint alike.

    Attributes
    ----------
    source : str
        The path or URL given.
    index : str or None
        The index's path or URL; ``None`` for a single file.
    index_metadata : dict or None
        The index's ``metadata`` object (``{"total_size": ...}``); ``None`` without index.
    weight_map : dict of str to str
        Tensor name to shard name (for a single file, every name to its base name).
    headers : dict of str to Header
        Shard name to its validated :class:`~engine.format.header.Header`, shards sorted by name.
    directory : str or None
        The local directory shard names resolve in (see :meth:`shard_path`; ``""`` is the
        working directory); ``None`` for a remote checkpoint.
    """

    __slots__ = ("source", "index", "index_metadata", "weight_map", "headers", "directory")

    def __init__(
        self,
        source: str,
        headers: dict[str, Header],
        *,
        index: str | None = None,
        index_metadata: dict[str, Any] | None = None,
        weight_map: dict[str, str] | None = None,
        directory: str | None = None,
    ) -> None:
        self.source = source
        self.index = index
        self.directory = directory
        self.index_metadata = index_metadata
        self.headers = dict(sorted(headers.items()))
        if weight_map is None:
            weight_map = {name: shard for shard, h in self.headers.items() for name in h.names}
        self.weight_map = weight_map

    @property
    def is_sharded(self) -> bool:
        """True when the checkpoint has an index."""
        return self.index is not None

    @property
    def shards(self) -> list[str]:
        """Shard names, sorted (one name for a single file)."""
        return list(self.headers)

    def shard_path(self, shard: str) -> str:
        """The local path of ``shard`` (one of :attr:`shards`).

        Raises
        ------
        KeyError
            ``shard`` is not a shard of this checkpoint.
        ValueError
            The checkpoint is remote: its shards have no local path.
        """
        if shard not in self.headers:
            raise KeyError(shard)
        if self.directory is None:
            raise ValueError(f"{self.source!r} is not a local checkpoint: its shards have no local path")
        return os.path.join(self.directory, shard)

    def keys(self) -> list[str]:
        """Tensor names, sorted, across all shards."""
        return sorted(self.weight_map)

    def __len__(self) -> int:
        return len(self.weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self.weight_map

    def __iter__(self):
        return iter(self.keys())

    def shard_of(self, name: str) -> str:
        """The shard holding ``name``; raises :class:`~engine.errors.TensorNotFoundError`."""
        try:
            return self.weight_map[name]
        except (KeyError, TypeError):
            raise self._not_found(name) from None

    def _not_found(self, name: object) -> TensorNotFoundError:
        return TensorNotFoundError.for_name(name, self.weight_map, where="checkpoint", path=self.source)

    def __getitem__(self, name: str) -> TensorInfo:
        """:class:`~engine.format.header.TensorInfo` of ``name`` (offsets are within its shard)."""
        return self.headers[self.shard_of(name)][name]

    def tensors(self) -> list[tuple[str, TensorInfo]]:
        """``(shard, TensorInfo)`` for every tensor: shards sorted, file order within each."""
        out = []
        for shard, header in self.headers.items():
            table = header.table
            for row in table.file_order():
                out.append((shard, header[table.names[row]]))
        return out

    def parameters(self) -> dict[str, int]:
        """Element count per dtype name (in dtype-code order) plus ``"total"``, all shards."""
        return _parameters(self.headers.values())

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in all shards (the index's ``total_size`` when it is exact)."""
        return sum(h.data_size for h in self.headers.values())

    @property
    def file_size(self) -> int:
        """Bytes of all shard files together."""
        return sum(h.file_size for h in self.headers.values())

    def metadata(self) -> dict[str, str] | None:
        """The shards' ``__metadata__``: the entries every shard carries with the same value.

        ``None`` when no shard has metadata.  For a single file, that file's metadata.
        """
        metas = [h.metadata for h in self.headers.values()]
        if all(m is None for m in metas):
            return None
        common = dict(metas[0] or {})
        for m in metas[1:]:
            m = m or {}
            common = {k: v for k, v in common.items() if m.get(k) == v}
        return common

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description: for a single file its header (as ``Header.to_dict``); for
        a sharded checkpoint ``{"metadata", "weight_map", "shards": {name: header}}``."""
        if not self.is_sharded:
            return next(iter(self.headers.values())).to_dict()
        return {
            "metadata": self.index_metadata,
            "weight_map": dict(self.weight_map),
            "shards": {shard: h.to_dict() for shard, h in self.headers.items()},
        }

    def __repr__(self) -> str:
        kind = f"{len(self.headers)} shards" if self.is_sharded else "1 file"
        return f"<CheckpointInfo {self.source!r}: {len(self)} tensors in {kind}>"


def open_layout(path: PathLike, max_header_size: int) -> tuple[Layout, dict[str, Any], dict[str, str]]:
    layout = resolve(path)
    if layout.index_path is None:
        return layout, {}, {}
    metadata, weight_map = read_index(layout.index_path, max_header_size)
    files = sorted(set(weight_map.values()))
    return layout._replace(files=files), metadata, weight_map


def read_shard_header(layout: Layout, shard: str, max_header_size: int) -> Header:
    try:
        return read_header(os.path.join(layout.directory, shard), max_header_size=max_header_size)
    except FileNotFoundError as exc:
        if layout.index_path is None:
            raise
        raise missing_shard(shard, layout, exc) from None


def read_checkpoint_info(
    path: PathLike, *, max_header_size: int = MAX_HEADER_SIZE, max_workers: int | None = None
) -> CheckpointInfo:
    """Read and check the headers of a checkpoint: a file, an index, or a directory.

    Parameters
    ----------
    path : str or os.PathLike
        A ``.safetensors`` file; a ``*.safetensors.index.json``; or a directory holding
        ``model.safetensors`` or ``model.safetensors.index.json`` (the single file wins when
        both exist, as in ``transformers``), else exactly one index or one ``.safetensors``.
    max_header_size : int, optional
        Largest header accepted per shard, and largest index file.
    max_workers : int, optional
        Threads reading shard headers (default: up to 8).

    Returns
    -------
    CheckpointInfo

    Raises
    ------
    CheckpointIndexError
        The index breaks a rule or disagrees with the shards (see the module docs).
    MissingShardError
        A shard named by the index does not exist.
    HeaderError, ReadError
        A shard's header is invalid.
    SafetensorError
        A directory with no (or no unambiguous) checkpoint in it.
    OSError
        The file, index or directory cannot be read.

    Notes
    -----
    Reads the index and ``8 + N`` header bytes of every shard; copies of tensor bytes: 0.
    """
    layout, metadata, weight_map = open_layout(path, max_header_size)
    headers = map_shards(lambda s: read_shard_header(layout, s, max_header_size), layout.files, max_workers)
    by_shard = dict(zip(layout.files, headers, strict=True))
    if layout.index_path is None:
        return CheckpointInfo(layout.source, by_shard, directory=layout.directory)
    problems = index_problems(weight_map, by_shard, layout.index_path)
    if problems:
        raise problems[0]
    return CheckpointInfo(layout.source, by_shard, index=layout.index_path, index_metadata=metadata,
                          weight_map=weight_map, directory=layout.directory)


def check_checkpoint(path: PathLike, *, max_header_size: int = MAX_HEADER_SIZE) -> list[SafetensorError]:
    """Every format problem of a checkpoint, instead of the first one.

    Parameters
    ----------
    path : str or os.PathLike
        As for :func:`read_checkpoint_info`.
    max_header_size : int, optional
        As for :func:`read_checkpoint_info`.

    Returns
    -------
    list of SafetensorError
        Empty when every shard parses, every shard's tensors tile its data region exactly
        (the region check) and the index agrees with the shards.  An unreadable or invalid
        index is the only problem reported when it occurs (nothing can be checked without it).

    Raises
    ------
    OSError
        Only for a path that cannot be opened at all (missing file or directory).
    """
    try:
        layout, metadata, weight_map = open_layout(path, max_header_size)
    except CheckpointIndexError as exc:
        return [exc]
    problems: list[SafetensorError] = []
    headers: dict[str, Header] = {}
    for shard in layout.files:
        try:
            headers[shard] = read_shard_header(layout, shard, max_header_size)
        except SafetensorError as exc:
            problems.append(exc)
        except OSError as exc:
            if layout.index_path is None:
                raise
            err = ReadError(f"cannot read shard {shard!r}: {exc}", reason="IoError", path=os.path.join(layout.directory, shard))
            problems.append(err)
    if layout.index_path is not None:
        problems.extend(index_problems(weight_map, headers, layout.index_path))
    return problems
