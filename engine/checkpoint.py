"""Sharded checkpoints: ``model.safetensors.index.json`` and its shards as one checkpoint.

Hugging Face tools save a large model as shards ``model-00001-of-00004.safetensors`` ...
plus an index ``model.safetensors.index.json``::

    {"metadata": {"total_size": 123}, "weight_map": {"tensor name": "shard file name", ...}}

and a small one as a single ``model.safetensors`` with no index.  This module reads both
as one logical checkpoint (:func:`open_checkpoint`, :func:`read_checkpoint_info`);
:mod:`engine.shards` writes them (:func:`~engine.shards.save_sharded`, also importable from
here) with the file names, shard split and index JSON of ``huggingface_hub``/``transformers``.

The index is checked as strictly as a header: it must be a JSON object without duplicate
keys whose ``weight_map`` maps strings to strings; every shard name stays inside the
index's directory (no ``..``, no absolute path, no URL); every tensor the index lists is in
its shard, every tensor of a shard is in the index, and no name is in two shards.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, Union

from . import api
from ._files import open_regular
from .dtypes import BY_NAME
from .errors import CheckpointIndexError, MissingShardError, ReadError, SafetensorError, TensorNotFoundError
from .header import MAX_HEADER_SIZE, Header, TensorInfo, read_header

# the writing half lives in engine.shards; its names stay importable from here, imported on
# first use so that opening a checkpoint loads no writer
_FROM_SHARDS = frozenset(
    {"FILENAME_PATTERN", "ShardSplit", "index_json", "parse_size", "save_sharded", "split_into_shards"}
)


def __getattr__(name: str):
    if name in _FROM_SHARDS:
        from . import shards

        return getattr(shards, name)
    raise AttributeError(f"module 'engine.checkpoint' has no attribute {name!r}")

__all__ = [
    "SAFETENSORS_NAME",
    "INDEX_NAME",
    "CheckpointIndexError",
    "MissingShardError",
    "CheckpointInfo",
    "Checkpoint",
    "open_checkpoint",
    "read_checkpoint_info",
    "check_checkpoint",
    "parse_index",
    "index_problems",
    "check_shard_name",
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
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


# --------------------------------------------------------------------------- errors


# --------------------------------------------------------------------------- index


def check_shard_name(name: object, *, source: str | None = None) -> str:
    """Check that a shard name from an index stays inside the index's directory.

    Parameters
    ----------
    name : object
        A value of the index's ``weight_map``.
    source : str, optional
        The index, for messages.

    Returns
    -------
    str
        ``name``, unchanged: a relative path with ``/`` separators.

    Raises
    ------
    CheckpointIndexError
        ``reason="UnsafeShardName"``: empty, absolute (``/x``, ``C:\\x``), a URL or any
        ``scheme:``, a ``..`` or ``.`` component, a backslash, a NUL or a control character.

    Notes
    -----
    The check is lexical.  Symbolic links are followed as usual: the Hugging Face cache
    stores every shard as a link into its ``blobs/`` folder.
    """
    if not isinstance(name, str):
        raise CheckpointIndexError(
            f"shard names must be strings, got {type(name).__name__} {name!r}", reason="InvalidIndex", path=source
        )

    def unsafe(why: str) -> CheckpointIndexError:
        return CheckpointIndexError(f"shard name {name!r} {why}", reason="UnsafeShardName", path=source)

    if not name:
        raise unsafe("is empty")
    if _CONTROL.search(name):
        raise unsafe("holds a control character")
    if "\\" in name:
        raise unsafe("holds a backslash, which is a separator on Windows")
    if name.startswith("/") or re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", name):
        raise unsafe("is absolute or a URL; shard names are relative to the index's directory")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise unsafe("has an empty, '.' or '..' component; shards must lie in the index's directory")
    return name


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _DuplicateKey(Exception):
    pass


def parse_index(data: bytes | str, *, source: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse and check the JSON of a ``*.safetensors.index.json``.

    Parameters
    ----------
    data : bytes or str
        The whole index file.
    source : str, optional
        Its path or URL, for messages.

    Returns
    -------
    metadata : dict
        The index's ``metadata`` object (``{}`` when absent), e.g. ``{"total_size": ...}``.
    weight_map : dict of str to str
        Tensor name to shard name, in the index's order.

    Raises
    ------
    CheckpointIndexError
        ``InvalidIndex``: not UTF-8 JSON, a duplicate key anywhere, not an object,
        ``weight_map`` missing or not an object of strings, ``metadata`` not an object;
        ``UnsafeShardName``: see :func:`check_shard_name`.

    Notes
    -----
    Keys other than ``metadata`` and ``weight_map`` are ignored, as Hugging Face loaders do.
    """

    def invalid(message: str) -> CheckpointIndexError:
        return CheckpointIndexError(message, reason="InvalidIndex", path=source)

    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
        import json  # only for an index: opening one file needs no JSON decoder beyond the header's

        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as exc:
        raise invalid(f"the index is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except _DuplicateKey as exc:
        raise invalid(f"the index has the key {exc.args[0]!r} twice") from None
    except (ValueError, RecursionError) as exc:
        raise invalid(f"the index is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise invalid(f"the index must be a JSON object, got {type(doc).__name__}")
    if "weight_map" not in doc:
        raise invalid("the index has no 'weight_map'")
    weight_map = doc["weight_map"]
    if not isinstance(weight_map, dict):
        raise invalid(f"'weight_map' must be an object of tensor names to shard names, got {type(weight_map).__name__}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointIndexError(
                f"'weight_map' maps {name!r} to {shard!r}; shard names must be strings",
                reason="InvalidIndex",
                path=source,
                tensors=(name,),
            )
    for shard in set(weight_map.values()):
        check_shard_name(shard, source=source)
    metadata = doc.get("metadata", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise invalid(f"'metadata' must be an object, got {type(metadata).__name__}")
    return metadata, weight_map


def index_problems(
    weight_map: Mapping[str, str], headers: Mapping[str, Header], source: str | None
) -> list[CheckpointIndexError]:
    """Every disagreement between an index and its shards' headers.

    Parameters
    ----------
    weight_map : mapping of str to str
        The index's tensor name -> shard name.
    headers : mapping of str to Header
        Shard name -> its header, for every shard the index names.
    source : str or None
        The index, for messages.

    Returns
    -------
    list of CheckpointIndexError
        Empty when they agree; else one error per kind of disagreement (``TensorNotInShard``,
        ``TensorNotInIndex``, ``DuplicateTensor``), each naming the tensors involved.
    """
    problems: list[CheckpointIndexError] = []
    where: dict[str, list[str]] = {}
    for shard, header in headers.items():
        for name in header.names:
            where.setdefault(name, []).append(shard)
    for name, shards in where.items():
        if len(shards) > 1:
            problems.append(
                CheckpointIndexError(
                    f"tensor {name!r} is in {len(shards)} shards: {', '.join(map(repr, shards))}",
                    reason="DuplicateTensor",
                    path=source,
                    tensors=(name,),
                )
            )
    for name, shard in weight_map.items():
        if shard not in headers:
            continue  # a missing shard is reported on its own
        if name not in headers[shard]:
            actual = [s for s in where.get(name, ()) if s != shard]
            hint = f"; it is in {actual[0]!r}" if actual else ""
            problems.append(
                CheckpointIndexError(
                    f"the index places tensor {name!r} in {shard!r}, which does not hold it{hint}",
                    reason="TensorNotInShard",
                    path=source,
                    tensors=(name,),
                )
            )
    for shard, header in headers.items():
        extra = [n for n in header.names if n not in weight_map]
        if extra:
            shown = ", ".join(map(repr, extra[:5])) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
            problems.append(
                CheckpointIndexError(
                    f"shard {shard!r} holds tensors the index does not list: {shown}",
                    reason="TensorNotInIndex",
                    path=source,
                    tensors=extra,
                )
            )
    return problems


# --------------------------------------------------------------------------- layout


class _Layout(NamedTuple):
    source: str  # what the caller passed
    directory: str  # where shard names are resolved
    index_path: str | None  # path of the index, None for a single file
    files: list[str]  # shard names relative to directory (for a single file: its base name)


def _resolve(path: PathLike) -> _Layout:
    """Decide what ``path`` is: an index, a directory holding one, or a single file."""
    spath = os.fspath(path)
    if os.path.isdir(spath):
        for name in (SAFETENSORS_NAME, INDEX_NAME):
            # transformers' precedence: a single model.safetensors wins over an index
            if os.path.isfile(os.path.join(spath, name)):
                return _resolve(os.path.join(spath, name))._replace(source=spath)
        entries = sorted(os.listdir(spath))
        indexes = [e for e in entries if e.endswith(".safetensors.index.json")]
        files = [e for e in entries if e.endswith(".safetensors") and not e.startswith(".")]
        if len(indexes) == 1:
            return _resolve(os.path.join(spath, indexes[0]))._replace(source=spath)
        if not indexes and len(files) == 1:
            return _resolve(os.path.join(spath, files[0]))._replace(source=spath)
        found = indexes or files
        raise SafetensorError(
            f"the directory holds no {SAFETENSORS_NAME} or {INDEX_NAME}, and "
            + (f"{len(found)} candidates ({', '.join(found[:5])}); pass the one to open" if found else "no safetensors file"),
            reason="NoCheckpoint",
            path=spath,
        )
    directory = os.path.dirname(spath) or "."
    if spath.endswith(".json"):
        return _Layout(spath, directory, spath, [])
    return _Layout(spath, directory, None, [os.path.basename(spath)])


def _read_index(path: str, max_size: int) -> tuple[dict[str, Any], dict[str, str]]:
    with os.fdopen(open_regular(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_size:
            raise CheckpointIndexError(
                f"the index is {size} bytes, more than the limit of {max_size} (raise max_header_size)",
                reason="InvalidIndex",
                path=path,
            )
        data = f.read(max_size + 1)
    return parse_index(data, source=path)


def _missing(shard: str, layout: _Layout, exc: OSError) -> SafetensorError:
    where = f"listed in {layout.index_path}" if layout.index_path else "the checkpoint's file"
    return MissingShardError(f"shard {shard!r} ({where}) does not exist", path=os.path.join(layout.directory, shard))


def _pool_size(n: int, max_workers: int | None) -> int:
    return max(1, min(n, max_workers or _MAX_THREADS))


def _run_all(fn, items: list, max_workers: int | None, *, parallel: bool = True) -> list:
    """``fn(x)`` for every item, on a bounded pool when ``parallel``; each result, or the
    exception it raised (as ``_Failed``), so that every call finishes and is accounted for."""

    def call(x):
        try:
            return fn(x)
        except Exception as exc:
            return _Failed(exc)

    if not parallel or len(items) <= 1 or max_workers == 1:
        return [call(x) for x in items]
    from .reader import map_threads  # only for several shards: opening one file needs no pool

    return map_threads(call, items, _pool_size(len(items), max_workers), name="engine-shard")


def _run_adaptive(fn, items: list, max_workers: int | None) -> list:
    """Like :func:`_run_all`: the first item inline, the rest in parallel only if it was slow."""
    if not items:
        return []
    t0 = time.perf_counter()
    first = _run_all(fn, items[:1], max_workers)
    slow = time.perf_counter() - t0 > _SLOW_OPEN_S
    return first + _run_all(fn, items[1:], max_workers, parallel=slow)


class _Failed(NamedTuple):
    exc: Exception


def _map_threads(fn, items: list, max_workers: int | None) -> list:
    """``[fn(x) for x in items]``, adaptively parallel; the first exception (in item order) wins."""
    results = _run_adaptive(fn, items, max_workers)
    for r in results:
        if isinstance(r, _Failed):
            raise r.exc
    return results


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
    :func:`engine.remote.read_metadata` for URLs, so both describe a checkpoint alike.

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
        Shard name to its validated :class:`~engine.header.Header`, shards sorted by name.
    directory : str or None
        The local directory shard names resolve in (see :meth:`shard_path`); ``None`` for
        a remote checkpoint.
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
        """:class:`~engine.header.TensorInfo` of ``name`` (offsets are within its shard)."""
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


def _open_layout(path: PathLike, max_header_size: int) -> tuple[_Layout, dict[str, Any], dict[str, str]]:
    layout = _resolve(path)
    if layout.index_path is None:
        return layout, {}, {}
    metadata, weight_map = _read_index(layout.index_path, max_header_size)
    files = sorted(set(weight_map.values()))
    return layout._replace(files=files), metadata, weight_map


def _read_shard_header(layout: _Layout, shard: str, max_header_size: int) -> Header:
    try:
        return read_header(os.path.join(layout.directory, shard), max_header_size=max_header_size)
    except FileNotFoundError as exc:
        if layout.index_path is None:
            raise
        raise _missing(shard, layout, exc) from None


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
    layout, metadata, weight_map = _open_layout(path, max_header_size)
    headers = _map_threads(lambda s: _read_shard_header(layout, s, max_header_size), layout.files, max_workers)
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
        layout, metadata, weight_map = _open_layout(path, max_header_size)
    except CheckpointIndexError as exc:
        return [exc]
    problems: list[SafetensorError] = []
    headers: dict[str, Header] = {}
    for shard in layout.files:
        try:
            headers[shard] = _read_shard_header(layout, shard, max_header_size)
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


# --------------------------------------------------------------------------- reading


class Checkpoint:
    """A checkpoint (one file, or an index and its shards) open for reading; see
    :func:`open_checkpoint`.  The API of :class:`engine.safe_open`, across shards."""

    def __init__(
        self,
        path: PathLike,
        framework: str = "numpy",
        device: Any = "cpu",
        *,
        backend: str = "mmap",
        max_header_size: int = MAX_HEADER_SIZE,
        max_workers: int | None = None,
    ) -> None:
        layout, metadata, weight_map = _open_layout(path, max_header_size)
        self._layout = layout
        self._handles: dict[str, Any] = {}

        def open_one(shard: str):
            try:
                return api.safe_open(
                    os.path.join(layout.directory, shard),
                    framework=framework,
                    device=device,
                    backend=backend,
                    max_header_size=max_header_size,
                )
            except FileNotFoundError as exc:
                if layout.index_path is None:
                    raise
                raise _missing(shard, layout, exc) from None

        opened = _run_adaptive(open_one, layout.files, max_workers)
        failed = [r for r in opened if isinstance(r, _Failed)]
        if failed:
            for r in opened:
                if not isinstance(r, _Failed):
                    r.close()
            raise failed[0].exc
        self._handles = dict(zip(layout.files, opened, strict=True))
        headers = {shard: h.header for shard, h in self._handles.items()}
        if layout.index_path is not None:
            problems = index_problems(weight_map, headers, layout.index_path)
            if problems:
                self.close()
                raise problems[0]
            self.info = CheckpointInfo(
                layout.source, headers, index=layout.index_path, index_metadata=metadata, weight_map=weight_map,
                directory=layout.directory,
            )
        else:
            self.info = CheckpointInfo(layout.source, headers, directory=layout.directory)

    # -- context manager ---------------------------------------------------------------
    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close every shard; tensors already handed out stay valid."""
        for h in self._handles.values():
            h.close()

    # -- the reference's API -------------------------------------------------------------
    def keys(self) -> list[str]:
        """Tensor names across all shards, sorted."""
        return self.info.keys()

    def offset_keys(self) -> list[str]:
        """Tensor names shard by shard (sorted shards), in file order within each."""
        return [info.name for _, info in self.info.tensors()]

    def metadata(self) -> dict[str, str] | None:
        """``__metadata__`` entries common to every shard; see :meth:`CheckpointInfo.metadata`.

        The index's own ``metadata`` (``total_size``) is :attr:`index_metadata`.
        """
        return self.info.metadata()

    @property
    def index_metadata(self) -> dict[str, Any] | None:
        return self.info.index_metadata

    @property
    def weight_map(self) -> dict[str, str]:
        return dict(self.info.weight_map)

    @property
    def shards(self) -> list[str]:
        """Shard file names, sorted; the paths are relative to the index's directory."""
        return self.info.shards

    def handle(self, shard: str):
        """The :class:`engine.safe_open` handle of one shard."""
        return self._handles[shard]

    def __len__(self) -> int:
        return len(self.info)

    def __contains__(self, name: object) -> bool:
        return name in self.info

    def get_tensor(self, name: str):
        """The whole tensor ``name``, from its shard (a view for "mmap", owned for "pread")."""
        return self._handles[self.info.shard_of(name)].get_tensor(name)

    def get_slice(self, name: str):
        """A lazy slice handle on ``name`` in its shard (reads only what is indexed)."""
        return self._handles[self.info.shard_of(name)].get_slice(name)

    def get_tensors(self, names: Iterable[str] | None = None) -> dict:
        """Every tensor (or those in ``names``), every shard in one load.

        Parameters
        ----------
        names : iterable of str, optional
            The tensors to load; all of them when omitted.

        Returns
        -------
        dict
            Name to tensor, shard by shard (sorted shards), file order within a shard when
            ``names`` is omitted, else the order of ``names``.

        Raises
        ------
        TensorNotFoundError
            A name the checkpoint does not hold.
        ReadError
            A shard could not be read (``"pread"`` backend).

        Notes
        -----
        ``"mmap"`` on the CPU makes views of each shard's mapping, read ahead on several
        threads when cold.  Owned (``"pread"``) and device loads read every shard through
        one pipeline (one queue of reads over all files, one set of reader threads or
        staging slots, one allocation) instead of one per shard.
        Copies of tensor bytes as for :class:`engine.safe_open`: 0 with ``"mmap"``, 1 with
        ``"pread"``; on a device 2 on the copy path, 1 on the register path.
        """
        if names is None:
            parts = [(self._handles[s], self.info.headers[s].table.file_order()) for s in self.shards]
            wanted = None
        else:
            wanted = list(names)
            by_shard: dict[str, dict[int, None]] = {}  # ordered sets: a name asked twice is read once
            for name in wanted:
                shard = self.info.shard_of(name)
                by_shard.setdefault(shard, {})[self.info.headers[shard].table.index[name]] = None
            parts = [(self._handles[s], list(rows)) for s, rows in by_shard.items()]
        loaded: dict = {}
        for part in api.get_rows_many(parts):
            loaded.update(part)
        return loaded if wanted is None else {n: loaded[n] for n in wanted}

    def load_into(
        self,
        tensors: Mapping[str, Any],
        *,
        strict: bool = False,
        threads: int | None = None,
        chunk_bytes: int | None = None,
        gpu_path: str = "auto",
    ) -> list[str]:
        """Fill existing tensors in place from every shard, as one load; see
        :func:`engine.load_into`.

        Returns
        -------
        list of str
            The names filled, shard by shard (sorted shards), in file order within each.
        """
        return api.load_into_many(
            [self._handles[s] for s in self.shards], tensors, strict=strict, threads=threads,
            chunk_bytes=chunk_bytes, gpu_path=gpu_path, source=self.info.source,
        )

    def __repr__(self) -> str:
        return f"<engine.Checkpoint {self.info.source!r}: {len(self)} tensors in {len(self.shards)} files>"


def open_checkpoint(
    path: PathLike,
    framework: str = "numpy",
    device: Any = "cpu",
    *,
    backend: str = "mmap",
    max_header_size: int = MAX_HEADER_SIZE,
    max_workers: int | None = None,
) -> Checkpoint:
    """Open a single file, an index, or a directory as one checkpoint.

    Parameters
    ----------
    path : str or os.PathLike
        A ``.safetensors`` file, a ``*.safetensors.index.json``, or a directory (see
        :func:`read_checkpoint_info` for how one is chosen).
    framework : {"np", "numpy", "pt", "torch"}
        Kind of tensors handed out.
    device : str, int or torch.device, default "cpu"
        As for :class:`engine.safe_open`.
    backend : {"mmap", "pread"}, default "mmap"
        As for :class:`engine.safe_open`, for every shard.
    max_header_size : int, optional
        Largest header per shard, and largest index file, in bytes.
    max_workers : int, optional
        Threads opening shards (default: up to 8).  Loads need none of their own:
        :meth:`Checkpoint.get_tensors` reads every shard through one pipeline.

    Returns
    -------
    Checkpoint
        ``keys()``, ``metadata()``, ``get_tensor``, ``get_slice`` and ``get_tensors`` as on
        :class:`engine.safe_open`, routed to the right shard; a context manager.

    Raises
    ------
    CheckpointIndexError
        The index is malformed, names an unsafe shard path, or disagrees with the shards:
        a listed tensor absent from its shard, a shard's tensor absent from the index, one
        name in two shards.
    MissingShardError
        A shard named by the index does not exist (also a ``FileNotFoundError``).
    HeaderError
        A shard's header is invalid.
    OSError
        As ``open`` raises them.

    Notes
    -----
    Opening reads the index and every shard's header (``8 + N`` bytes each, shards in
    parallel) and keeps one file descriptor per shard open until :meth:`Checkpoint.close`.
    Copies of tensor bytes: as for :class:`engine.safe_open`.

    Examples
    --------
    >>> with open_checkpoint("Llama-3-8B/", framework="pt") as ckpt:  # doctest: +SKIP
    ...     w = ckpt.get_tensor("model.embed_tokens.weight")
    ...     state = ckpt.get_tensors()
    """
    return Checkpoint(
        path, framework, device, backend=backend, max_header_size=max_header_size, max_workers=max_workers
    )
