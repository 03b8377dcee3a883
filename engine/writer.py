"""Streaming, atomic writer of safetensors files.

The layout is the reference implementation's, byte for byte: tensors sorted by dtype code
descending then by name, a compact JSON header as ``serde_json`` writes it, padded with
spaces to a multiple of 8.  Tensor bytes go from the tensor's memory to the file in
slices of at most 64 MiB; the file appears under its name only once it is complete.

Three layers, each usable on its own:

- :func:`build_header` turns ``(name, dtype code, shape, nbytes)`` entries into the header
  bytes and the file offset of every tensor;
- :class:`TensorWriter` (from :func:`open_writer`) writes tensors one at a time, in any
  order, into a temporary file and commits it atomically: the writer for generators;
- :func:`save_file` and :func:`save` write a whole mapping of numpy arrays or torch tensors.
"""

from __future__ import annotations

import errno
import io
import json
import operator
import os
import stat
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Union

import numpy as np

from ._atomic import AtomicFile, sync_dir
from ._atomic import umask as _umask
from ._atomic import write_error as _write_error
from ._files import IOV_MAX
from .dtypes import BITS, BY_NAME, DTYPES, NAMES, code_of, from_numpy, from_torch
from .errors import DeviceError, SerializationError, SerializationTypeError, SharedTensorsError
from .header import MAX_HEADER_SIZE

__all__ = ["save_file", "save", "build_header", "open_writer", "TensorWriter", "tensor_sizes"]

PathLike = Union[str, "os.PathLike[str]"]

#: Largest single write, and the bound on any staging copy (byte swap, device to host).
#: A multiple of 8 so that slices never split an element.
_CHUNK = 64 << 20

_METADATA_KEY = "__metadata__"
_U8 = BY_NAME["U8"].code
_F4 = BY_NAME["F4"].code


# --------------------------------------------------------------------------- header


def build_header(
    entries: Iterable[tuple[str, int, Sequence[int], int]],
    metadata: Mapping[str, str] | None = None,
    *,
    max_header_size: int = MAX_HEADER_SIZE,
) -> tuple[bytes, list[tuple[int, int]]]:
    """Header bytes and tensor placement for a file holding ``entries``.

    Parameters
    ----------
    entries : iterable of (name, dtype_code, shape, nbytes)
        One tuple per tensor, in any order.  ``dtype_code`` is an :mod:`engine.dtypes`
        code (a format name such as ``"BF16"`` is accepted too); ``shape`` counts elements,
        also for the sub-byte dtypes; ``nbytes`` must equal the shape's packed size.
    metadata : mapping of str to str, optional
        Written as ``__metadata__``, first and in the mapping's order.  ``None`` omits the
        key; an empty mapping writes ``"__metadata__":{}`` as the reference does.
    max_header_size : int, default 100,000,000
        Largest header (JSON and padding, in bytes) written; the readers' limit of the same
        name, so that a file this writes is one they accept.

    Returns
    -------
    header : bytes
        The 8-byte little-endian length, the JSON and its space padding: the first
        ``len(header)`` bytes of the file.
    layout : list of (int, int)
        ``(index into entries, absolute file offset)`` for every tensor, in layout order:
        writing the tensors in this order after the header fills the file front to back.
        The file is ``len(header) + sum(nbytes)`` bytes long.

    Raises
    ------
    SerializationError
        A name that is not a string, is ``__metadata__``, is not UTF-8 encodable or occurs
        twice; an unknown dtype; a negative dimension; ``nbytes`` that does not match the
        shape, or a sub-byte tensor that does not end on a byte boundary; metadata keys or
        values that are not strings; ``reason="HeaderTooLarge"``: a header longer than
        ``max_header_size``, which readers would refuse.

    Notes
    -----
    Layout and JSON follow the reference: dtype code descending (the codes follow its
    dtype enum), then name in code-point order (which is UTF-8 byte order); strings
    escaped as by ``json.dumps(ensure_ascii=False)``, which escapes exactly what
    ``serde_json`` escapes.  No padding between tensors: descending codes put the larger
    item sizes first, so every tensor stays aligned to its item size.
    """
    checked = []
    seen = set()
    for index, (name, dtype, shape, nbytes) in enumerate(entries):
        _check_name(name)
        if name in seen:
            raise SerializationError(
                f"tensor {name!r} is listed twice", reason="DuplicateKey", tensors=(name,)
            )
        seen.add(name)
        code = _code(name, dtype)
        shape = _shape(name, shape)
        expected = _packed_nbytes(name, code, shape)
        if operator.index(nbytes) != expected:
            raise SerializationError(
                f"tensor {name!r}: {nbytes} bytes given, {NAMES[code]}{list(shape)} takes {expected}",
                reason="TensorInvalidInfo",
                tensors=(name,),
            )
        checked.append((-code, name, index, shape, expected))
    checked.sort()

    doc: dict[str, Any] = {}
    if metadata is not None:
        doc[_METADATA_KEY] = _check_metadata(metadata)
    layout = []
    begin = 0
    for neg_code, name, index, shape, nbytes in checked:
        doc[name] = {"dtype": NAMES[-neg_code], "shape": list(shape), "data_offsets": [begin, begin + nbytes]}
        layout.append((index, begin))
        begin += nbytes

    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > max_header_size:
        raise SerializationError(
            f"the header would take {len(text)} bytes, more than the limit of {max_header_size} that "
            "readers accept (fewer tensors per file, shorter names or metadata; or raise max_header_size "
            "here and when reading)",
            reason="HeaderTooLarge",
        )
    start = 8 + len(text)
    return len(text).to_bytes(8, "little") + text, [(index, start + offset) for index, offset in layout]


def _check_name(name: object) -> None:
    if not isinstance(name, str):
        raise SerializationTypeError(
            f"tensor names must be strings, got {type(name).__name__} {name!r}", reason="InvalidTensorName"
        )
    if name == _METADATA_KEY:
        raise SerializationError(
            f"{_METADATA_KEY!r} is reserved for metadata and cannot name a tensor",
            reason="InvalidTensorName",
            tensors=(name,),
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SerializationError(
            f"tensor name {name!r} cannot be encoded as UTF-8 ({exc.reason})",
            reason="InvalidTensorName",
            tensors=(name,),
        ) from None


def _check_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(metadata, Mapping):
        raise SerializationTypeError(
            f"metadata must be a mapping of str to str, got {type(metadata).__name__}",
            reason="InvalidMetadata",
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise SerializationTypeError(
                f"metadata keys and values must be strings, got {key!r}: {value!r}", reason="InvalidMetadata"
            )
        try:
            key.encode("utf-8")
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise SerializationError(
                f"metadata {key!r}: {value!r} cannot be encoded as UTF-8", reason="InvalidMetadata"
            ) from None
    return dict(metadata)


def _code(name: str, dtype: int | str) -> int:
    try:
        code = code_of(dtype) if isinstance(dtype, str) else operator.index(dtype)
    except (SerializationError, TypeError):
        code = -1
    if not 0 <= code < len(DTYPES):
        raise SerializationError(
            f"tensor {name!r}: unknown dtype {dtype!r}", reason="InvalidDtype", tensors=(name,)
        )
    return code


def _shape(name: str, shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        dims = (-1,)
    if any(d < 0 for d in dims):
        raise SerializationError(
            f"tensor {name!r}: invalid shape {shape!r}", reason="InvalidShape", tensors=(name,)
        )
    return dims


def _packed_nbytes(name: str, code: int, shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    bits = numel * BITS[code]
    if bits % 8:
        raise SerializationError(
            f"tensor {name!r}: {NAMES[code]}{list(shape)} does not end on a byte boundary",
            reason="MisalignedSlice",
            tensors=(name,),
        )
    return bits // 8


# --------------------------------------------------------------------------- tensors


class _Raw(NamedTuple):
    """A tensor as the writer sees it: format dtype, logical shape and its bytes."""

    code: int
    shape: tuple[int, ...]
    nbytes: int
    #: (address space, first byte, end) of a torch tensor's memory, None otherwise; used
    #: to find tensors that share memory.
    span: tuple[object, int, int] | None
    #: chunks(limit) yields the little-endian bytes as 'B' memoryviews of at most ``limit``
    #: bytes; each is valid until the next is requested (staging buffers are reused).
    chunks: Callable[[int], Iterator[memoryview]]
    #: the bytes as they are in memory, when they can be written without staging (host
    #: memory, little-endian); several such tensors go to the file in one system call
    direct: memoryview | None = None


def _raw(name: str, x: Any) -> _Raw:
    """The one place that turns a numpy array or torch tensor into a :class:`_Raw`."""
    if isinstance(x, np.ndarray):
        return _raw_numpy(name, x)
    # A torch tensor exists only once torch is imported: numpy-only callers never import it.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _raw_torch(name, x, torch)
    raise SerializationError(
        f"tensor {name!r}: expected a numpy array or a torch tensor, got {type(x).__module__}.{type(x).__qualname__}",
        reason="UnsupportedType",
        tensors=(name,),
    )


def _raw_numpy(name: str, a: np.ndarray) -> _Raw:
    code = _named(name, from_numpy, a.dtype)
    if not a.flags.c_contiguous:
        raise SerializationError(
            f"tensor {name!r} is not C-contiguous; pass np.ascontiguousarray(...) to write it",
            reason="NonContiguous",
            tensors=(name,),
        )
    big = a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and sys.byteorder == "big")
    swap = _swap_unit(a.dtype.itemsize, a.dtype.kind == "c") if big else 1
    # no span: numpy arrays have no storages to alias, and the reference writes an array
    # given under two names twice, as asked
    # reshape(-1) of a C-contiguous array is a view; uint8 because the buffer protocol
    # refuses ml_dtypes' types.
    view = a.reshape(-1).view(np.uint8).data
    return _Raw(code, tuple(a.shape), a.nbytes, None, _host_chunks(view, swap), view if swap == 1 else None)


def _raw_torch(name: str, t: Any, torch: Any) -> _Raw:
    if t.layout != torch.strided:
        raise SerializationError(
            f"tensor {name!r} is {t.layout}; only dense tensors can be written (use .to_dense())",
            reason="SparseTensor",
            tensors=(name,),
        )
    if t.device.type == "meta":
        # a RuntimeError, as torch's own "Cannot copy out of meta tensor" that the reference lets through
        raise DeviceError(
            f"tensor {name!r} is on the meta device: Cannot copy out of meta tensor; it has no data",
            reason="NoData",
            tensors=(name,),
        )
    if not t.is_contiguous():
        raise SerializationError(
            f"tensor {name!r} is not contiguous; pass .contiguous() to write it",
            reason="NonContiguous",
            tensors=(name,),
        )
    code = _named(name, from_torch, t.dtype)
    shape = tuple(t.shape)
    if code == _F4:  # float4_e2m1fn_x2 counts bytes; the format counts values, two per byte
        if not shape:
            raise SerializationError(
                f"tensor {name!r}: a float4_e2m1fn_x2 scalar cannot be written",
                reason="MisalignedSlice",
                tensors=(name,),
            )
        shape = shape[:-1] + (shape[-1] * 2,)
    nbytes = t.numel() * t.element_size()
    span = None
    if nbytes:
        start = t.data_ptr()
        space = "cpu" if t.device.type == "cpu" else str(t.device)
        span = (space, start, start + nbytes)
    if not nbytes:
        empty = memoryview(b"")
        return _Raw(code, shape, 0, None, _host_chunks(empty, 1), empty)
    t = t.detach()
    if t.is_conj() or t.is_neg():
        # A lazy conjugate/negation bit is not in memory: write the resolved values, copied
        # only when this tensor's turn comes.
        def resolved(limit: int) -> Iterator[memoryview]:
            return _raw_torch(name, t.resolve_conj().resolve_neg(), torch).chunks(limit)

        return _Raw(code, shape, nbytes, span, resolved)
    swap = _swap_unit(t.element_size(), t.is_complex()) if sys.byteorder == "big" else 1
    # as_strided, not reshape: a contiguous tensor may carry any stride on a dimension of
    # size 1, which view(uint8) refuses.
    flat = t.as_strided((t.numel(),), (1,)).view(torch.uint8)
    if t.device.type == "cpu":
        view = memoryview(flat.numpy())
        return _Raw(code, shape, nbytes, span, _host_chunks(view, swap), view if swap == 1 else None)
    return _Raw(code, shape, nbytes, span, _device_chunks(flat, swap, torch))


def _named(name: str, convert: Callable[[Any], int], dtype: Any) -> int:
    try:
        return convert(dtype)
    except SerializationError as exc:
        raise SerializationError(
            f"tensor {name!r}: {exc.message}", reason=exc.reason, tensors=(name,)
        ) from None


def _swap_unit(itemsize: int, complex_: bool) -> int:
    # complex numbers are two floats, each swapped on its own
    return itemsize // 2 if complex_ else itemsize


def _swapped(piece: memoryview, unit: int) -> memoryview:
    if unit == 1:
        return piece
    return np.frombuffer(piece, dtype=f"u{unit}").byteswap().view(np.uint8).data


def _host_chunks(view: memoryview, swap: int) -> Callable[[int], Iterator[memoryview]]:
    def chunks(limit: int) -> Iterator[memoryview]:
        for start in range(0, len(view), limit):
            yield _swapped(view[start : start + limit], swap)

    return chunks


def _device_chunks(flat: Any, swap: int, torch: Any) -> Callable[[int], Iterator[memoryview]]:
    def chunks(limit: int) -> Iterator[memoryview]:
        n = flat.numel()
        if not n:
            return
        # One staging buffer per tensor, reused for every slice; pinned so that the copy is
        # a DMA (torch's host allocator caches the block across tensors).
        staging = torch.empty(min(n, limit), dtype=torch.uint8, pin_memory=flat.device.type == "cuda")
        host = memoryview(staging.numpy())
        for start in range(0, n, limit):
            size = min(limit, n - start)
            # non_blocking=False: returns once the bytes are on the host
            staging[:size].copy_(flat[start : start + size])
            yield _swapped(host[:size], swap)

    return chunks


def _prepare(
    tensors: Mapping[str, Any], metadata: Mapping[str, str] | None, max_header_size: int = MAX_HEADER_SIZE
) -> tuple[list[tuple[str, _Raw]], bytes, list[tuple[int, int]]]:
    """Validate everything, before any file is touched; return the items, header and layout."""
    if not isinstance(tensors, Mapping):
        raise SerializationError(
            f"expected a mapping of names to tensors, got {type(tensors).__name__}", reason="UnsupportedType"
        )
    items = []
    for name, x in tensors.items():
        _check_name(name)
        items.append((name, _raw(name, x)))
    _check_shared(items)
    header, layout = build_header(
        ((name, r.code, r.shape, r.nbytes) for name, r in items), metadata, max_header_size=max_header_size
    )
    return items, header, layout


def tensor_sizes(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> dict[str, int]:
    """Check ``tensors`` and ``metadata`` as :func:`save_file` does, without writing.

    Parameters
    ----------
    tensors : mapping of str to numpy.ndarray or torch.Tensor
        As for :func:`save_file`.
    metadata : mapping of str to str, optional
        As for :func:`save_file`.

    Returns
    -------
    dict of str to int
        Bytes of each tensor, in the mapping's order.

    Raises
    ------
    SerializationError
        What :func:`save_file` refuses before writing, except the header size (which
        depends on how the tensors are split into files).

    Notes
    -----
    Reads no tensor bytes (a device tensor is not copied); memory: a few objects per tensor.
    """
    items, _, _ = _prepare(tensors, metadata, max_header_size=sys.maxsize)
    return {name: raw.nbytes for name, raw in items}


def _check_shared(items: list[tuple[str, _Raw]]) -> None:
    """Reject tensors whose bytes overlap: O(n log n) by sorting address ranges."""
    spans = sorted((r.span, name) for name, r in items if r.span is not None)
    groups: list[list[str]] = []
    group: list[str] = []
    space, end = None, 0
    for (this_space, start, stop), name in spans:
        if this_space == space and start < end:
            group.append(name)
            end = max(end, stop)
            continue
        if len(group) > 1:
            groups.append(group)
        group, space, end = [name], this_space, stop
    if len(group) > 1:
        groups.append(group)
    if groups:
        shown = "; ".join(", ".join(repr(n) for n in g) for g in groups)
        raise SharedTensorsError(
            f"tensors share memory, which would store the same bytes twice: {shown}. "
            "Save one of each group, or .clone()/.copy() the others",
            reason="SharedMemory",
            tensors=[n for g in groups for n in g],
        )


# --------------------------------------------------------------------------- files


if hasattr(os, "pwrite"):

    def _write_at(fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

else:  # pragma: no cover - Windows

    def _write_at(fd: int, data: memoryview, offset: int) -> int:
        os.lseek(fd, offset, os.SEEK_SET)
        return os.write(fd, data)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = _write_at(fd, data, offset)
        if written <= 0:  # a full disk can show as a zero-length write
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        data = data[written:]
        offset += written


# one buffer per call where there is no pwritev (Windows, macOS before 11)
_IOV_MAX = IOV_MAX if hasattr(os, "pwritev") else 1


#: Tensors smaller than this are gathered into one ``pwritev`` of up to ``_BATCH`` bytes;
#: larger ones are written on their own, as large writes already amortise the call.
_SMALL = 1 << 20
_BATCH = 8 << 20


def _writev_at(fd: int, views: list[memoryview], offset: int) -> int:
    return os.pwritev(fd, views, offset)


def _writev_all(fd: int, views: list[memoryview], offset: int) -> None:
    """``pwritev`` of ``views`` (back to back in the file from ``offset``), partial writes resumed."""
    views = list(views)
    while views:
        written = _writev_at(fd, views, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if written:
            views[0] = views[0][written:]


#: Written bytes after which a background thread starts flushing them to disk, so that the
#: final fsync of an atomic save has only the tail left instead of the whole file.
_SYNC_EVERY = 256 << 20
#: Files smaller than this get no background flush: flushing while writing competes with
#: the writes (journal commits on the same file), which a smaller file does not win back
#: (548 MB saved about 3x slower with it: BENCHMARKS.md, "Saves", scripts/bench_save.py).
_SYNC_FROM = 1 << 30


class _BackgroundSync:
    """Runs ``fdatasync`` on a thread while the writer goes on filling the page cache.

    Writing and flushing then overlap: a save costs about the longer of the two instead of
    their sum.  ``os.fdatasync`` releases the GIL.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.wake = threading.Event()
        self.pending = False
        self.closing = False
        self.error: OSError | None = None
        self.thread = threading.Thread(target=self._run, name="engine-fsync", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            # a flush asked for before close() still runs: what was kicked is flushed
            if self.pending:
                self.pending = False
                try:
                    os.fdatasync(self.fd)
                except OSError as exc:  # reported by close(), which commit() calls
                    self.error = exc
                    return
            if self.closing:
                return

    def kick(self) -> None:
        self.pending = True
        self.wake.set()

    def close(self) -> OSError | None:
        self.closing = True
        self.wake.set()
        self.thread.join()
        return self.error


class _Entry(NamedTuple):
    code: int
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # absolute, in the file


class TensorWriter:
    """A safetensors file being written tensor by tensor; see :func:`open_writer`."""

    def __init__(
        self,
        path: PathLike,
        entries: Iterable[tuple[str, int | str, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
        *,
        fsync: bool = True,
        max_header_size: int = MAX_HEADER_SIZE,
    ) -> None:
        rows = []
        for name, dtype, shape in entries:
            _check_name(name)
            code, dims = _code(name, dtype), _shape(name, shape)
            rows.append((name, code, dims, _packed_nbytes(name, code, dims)))
        header, layout = build_header(rows, metadata, max_header_size=max_header_size)
        placed = {rows[i][0]: _Entry(rows[i][1], rows[i][2], rows[i][3], offset) for i, offset in layout}
        self._open(path, header, placed, fsync)

    @classmethod
    def _from_header(
        cls, path: PathLike, header: bytes, entries: dict[str, _Entry], fsync: bool
    ) -> TensorWriter:
        self = cls.__new__(cls)
        self._open(path, header, entries, fsync)
        return self

    def _open(self, path: PathLike, header: bytes, entries: dict[str, _Entry], fsync: bool) -> None:
        self.path = os.fspath(path)
        self._fsync = fsync
        self._syncer: _BackgroundSync | None = None
        self._unsynced = 0
        self._background = fsync and len(header) + sum(e.nbytes for e in entries.values()) >= _SYNC_FROM
        self._entries = entries  # in layout order
        self._filled = dict.fromkeys(entries, 0)
        self._fd: int | None = None

        # Through a symlink, replace its target (as an in-place write would), not the link.
        self._dest = os.path.realpath(self.path)
        try:
            mode = stat.S_IMODE(os.stat(self._dest).st_mode)
        except FileNotFoundError:
            # owner-only, as the reference writes them (weights are often private)
            mode = 0o600 & ~_umask()
        except OSError as exc:
            raise _write_error("inspect the destination", self.path, exc) from exc
        try:
            self._file = AtomicFile(self._dest, mode)
        except OSError as exc:
            raise _write_error("create a temporary file", self.path, exc) from exc
        fd = self._fd = self._file.fd
        assert fd is not None
        # A writer dropped without commit() or abort() must not leave its temporary file.
        self._finalizer = weakref.finalize(self, self._file.discard)
        try:
            _write_all(fd, memoryview(header), 0)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, OSError):
                raise _write_error("write the header", self.path, exc) from exc
            raise

    @property
    def names(self) -> list[str]:
        """Tensor names in layout order."""
        return list(self._entries)

    @property
    def missing(self) -> list[str]:
        """Names of the tensors not (completely) written yet, in layout order."""
        return [n for n, e in self._entries.items() if self._filled[n] < e.nbytes]

    @property
    def closed(self) -> bool:
        """True once committed or aborted."""
        return self._fd is None

    def write(self, name: str, data: Any) -> None:
        """Write ``data`` as tensor ``name``, or as its next bytes.

        Parameters
        ----------
        name : str
            One of the names given to :func:`open_writer`; any order.
        data : numpy.ndarray, torch.Tensor or bytes-like
            An array or tensor of the declared dtype (``uint8`` also for the sub-byte
            dtypes), or raw little-endian bytes.  A tensor may be written in several
            pieces, front to back; a piece as large as the whole tensor must have its
            declared shape.

        Raises
        ------
        SerializationError
            Unknown name, wrong dtype or shape, more bytes than declared, or the writer is
            closed.  The writer stays usable.
        WriteError
            The write failed; the temporary file is removed and the writer closed.

        Notes
        -----
        Copies of tensor bytes and memory are as for :func:`save_file`.
        """
        if self._fd is None:
            raise SerializationError("the writer is closed", reason="Closed", path=self.path)
        entry = self._entries.get(name)
        if entry is None:
            raise SerializationError(
                f"tensor {name!r} was not declared to open_writer",
                reason="UnknownTensor",
                tensors=(name,),
                path=self.path,
            )
        raw = self._raw_piece(name, entry, data)
        done = self._filled[name]
        if done + raw.nbytes > entry.nbytes:
            raise SerializationError(
                f"tensor {name!r}: {done + raw.nbytes} bytes written, {entry.nbytes} declared",
                reason="TensorInvalidInfo",
                tensors=(name,),
                path=self.path,
            )
        self._write_raw(name, raw)

    def _raw_piece(self, name: str, entry: _Entry, data: Any) -> _Raw:
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data).cast("B")
            return _Raw(entry.code, (len(view),), len(view), None, _host_chunks(view, 1))
        raw = _raw(name, data)
        packed = DTYPES[entry.code].sub_byte and raw.code == _U8
        if raw.code != entry.code and not packed:
            raise SerializationError(
                f"tensor {name!r} is {NAMES[raw.code]}, declared {NAMES[entry.code]}",
                reason="InvalidDtype",
                tensors=(name,),
                path=self.path,
            )
        if raw.nbytes == entry.nbytes and not packed and raw.shape != entry.shape:
            raise SerializationError(
                f"tensor {name!r} has shape {list(raw.shape)}, declared {list(entry.shape)}",
                reason="InvalidShape",
                tensors=(name,),
                path=self.path,
            )
        return raw

    def _written(self, nbytes: int) -> None:
        """Account for ``nbytes`` more in the page cache; start a background flush when due."""
        self._unsynced += nbytes
        if self._background and self._unsynced >= _SYNC_EVERY:
            assert self._fd is not None
            if self._syncer is None:
                self._syncer = _BackgroundSync(self._fd)
                weakref.finalize(self, self._syncer.close)  # a dropped writer stops it too
            self._syncer.kick()
            self._unsynced = 0

    def _write_layout(self, items: list[tuple[str, _Raw]]) -> None:
        """Write whole tensors that follow each other in the file, in file order.

        Runs of small tensors (under 1 MiB) whose bytes need no staging go out in one
        ``pwritev`` each (up to ``IOV_MAX`` tensors or 8 MiB), so a checkpoint of many small
        tensors costs a few system calls instead of one per tensor; the others go through
        :meth:`_write_raw`.
        """
        fd = self._fd
        assert fd is not None
        batch: list[tuple[str, memoryview]] = []
        size = 0

        def flush() -> None:
            nonlocal size
            if not batch:
                return
            name0 = batch[0][0]
            try:
                _writev_all(fd, [v for _, v in batch], self._entries[name0].offset)
            except BaseException as exc:
                self.abort()
                if isinstance(exc, OSError):
                    names = ", ".join(repr(n) for n, _ in batch[:3]) + (", ..." if len(batch) > 3 else "")
                    raise _write_error(f"write tensors {names}", self.path, exc) from exc
                raise
            for n, v in batch:
                self._filled[n] = len(v)
            self._written(size)
            batch.clear()
            size = 0

        for name, raw in items:
            view = raw.direct
            if view is not None and raw.nbytes < _SMALL and _IOV_MAX > 1:
                if batch and (size + raw.nbytes > _BATCH or len(batch) >= _IOV_MAX):
                    flush()
                if raw.nbytes:
                    batch.append((name, view))
                    size += raw.nbytes
                continue
            flush()
            self._write_raw(name, raw)
        flush()

    def _write_raw(self, name: str, raw: _Raw) -> None:
        assert self._fd is not None
        offset = self._entries[name].offset + self._filled[name]
        try:
            for piece in raw.chunks(_CHUNK):
                _write_all(self._fd, piece, offset)
                offset += len(piece)
                self._filled[name] += len(piece)
                n = len(piece)
                del piece  # else a staging copy lives on while the next one is made
                self._written(n)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, OSError):
                raise _write_error(f"write tensor {name!r}", self.path, exc) from exc
            raise

    def commit(self) -> None:
        """Finish the file and move it into place.

        Raises
        ------
        SerializationError
            Some tensors were not completely written; nothing is left behind.
        WriteError
            Syncing or renaming failed; nothing is left behind, and a previous file at the
            destination is intact.
        """
        if self._fd is None:
            raise SerializationError("the writer is closed", reason="Closed", path=self.path)
        missing = self.missing
        if missing:
            self.abort()
            raise SerializationError(
                f"tensors not written: {', '.join(map(repr, missing))}",
                reason="TensorIncomplete",
                tensors=missing,
                path=self.path,
            )
        fd, self._fd = self._fd, None
        try:
            background_error = self._stop_syncer()
            if background_error is not None:
                raise background_error
            if self._fsync:
                os.fsync(fd)
            self._file.commit()
        except BaseException as exc:
            self._file.discard()
            self._finalizer.detach()
            if isinstance(exc, OSError):
                raise _write_error("finish the file", self.path, exc) from exc
            raise
        self._finalizer.detach()
        if self._fsync:
            try:
                sync_dir(os.path.dirname(self._dest))
            except OSError as exc:
                raise _write_error("sync the directory (the file is in place)", self.path, exc) from exc

    def _stop_syncer(self) -> OSError | None:
        syncer, self._syncer = self._syncer, None
        return syncer.close() if syncer is not None else None

    def abort(self) -> None:
        """Discard the temporary file; the destination is untouched.  Idempotent."""
        self._stop_syncer()
        fd, self._fd = self._fd, None
        if fd is not None:
            self._finalizer.detach()
            self._file.discard()

    def __enter__(self) -> TensorWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def __repr__(self) -> str:
        state = (
            "closed" if self._fd is None else f"{len(self.missing)} of {len(self._entries)} tensors to write"
        )
        return f"<TensorWriter {self.path!r}: {state}>"


def open_writer(
    path: PathLike,
    entries: Iterable[tuple[str, int | str, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = True,
    max_header_size: int = MAX_HEADER_SIZE,
) -> TensorWriter:
    """Open a safetensors file for writing tensor by tensor, e.g. from a generator.

    Parameters
    ----------
    path : str or os.PathLike
        Destination.  Nothing appears there before :meth:`TensorWriter.commit`.
    entries : iterable of (name, dtype, shape)
        Every tensor the file will hold; ``dtype`` is an :mod:`engine.dtypes` code or a
        format name (``"F32"``); ``shape`` counts elements.
    metadata : mapping of str to str, optional
        Header metadata, as for :func:`save_file`.
    fsync : bool, default True
        As for :func:`save_file`.
    max_header_size : int, default 100,000,000
        As for :func:`save_file`.

    Returns
    -------
    TensorWriter
        Call ``write(name, data)`` for every tensor, in any order, then ``commit()``; or
        ``abort()``.  As a context manager it commits on normal exit and aborts on an
        exception.

    Raises
    ------
    SerializationError
        Invalid entries or metadata (see :func:`build_header`).
    WriteError
        The temporary file could not be created or the header written.

    Notes
    -----
    The header is written at once; each ``write`` goes to the tensor's own offset
    (``pwrite``), so tensors can arrive in any order and each can be freed right after.
    The bytes match :func:`save_file` for the same tensors.  Memory: the header and one
    bookkeeping entry per tensor.

    Examples
    --------
    >>> with open_writer("out.safetensors", [("w", "F32", (2, 2))]) as w:  # doctest: +SKIP
    ...     w.write("w", np.eye(2, dtype=np.float32))
    """
    return TensorWriter(path, entries, metadata, fsync=fsync, max_header_size=max_header_size)


# --------------------------------------------------------------------------- public


def save_file(
    tensors: Mapping[str, Any],
    filename: PathLike,
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = True,
    max_header_size: int = MAX_HEADER_SIZE,
) -> None:
    """Write tensors to a safetensors file, atomically.

    Parameters
    ----------
    tensors : mapping of str to numpy.ndarray or torch.Tensor
        Contiguous, dense tensors that do not share memory.  numpy arrays of any byte
        order and the ml_dtypes types (``bfloat16``, ``float8_*``); torch tensors on any
        device, including ``float8_*`` and ``float4_e2m1fn_x2``.  Both kinds may be mixed.
    filename : str or os.PathLike
        Destination.  An existing file keeps its permission bits; a new one gets
        ``0o600 & ~umask`` (owner only, as the reference writes it).  A symlink's target
        is replaced.
    metadata : mapping of str to str, optional
        Header ``__metadata__``, written in the mapping's order.
    fsync : bool, default True
        Sync the file before renaming it into place and the directory after.  ``False``
        is faster and still atomic for readers, but a power loss may leave an empty or
        partial file under the name.
    max_header_size : int, default 100,000,000
        Largest header written, the limit of the same name that readers apply (the
        reference's 100 MB); a larger header raises ``SerializationError`` with
        ``reason="HeaderTooLarge"`` before anything is written.

    Raises
    ------
    SerializationError
        Before anything is written: a name that is not a string, is ``__metadata__`` or is
        not UTF-8 encodable; a value that is not an array or tensor; an unsupported dtype;
        a non-contiguous, sparse or meta tensor; torch tensors whose bytes overlap (views
        of one another; empty tensors never count; numpy arrays under two names are written
        twice, as the reference writes them); metadata that is not str to str; a header
        larger than ``max_header_size`` (``reason="HeaderTooLarge"``).
    WriteError
        Creating, writing, syncing or renaming failed.  The temporary file is removed and
        a previous file at ``filename`` is intact; ``__cause__`` is the original error and
        ``errno`` is copied from it.

    Notes
    -----
    Readers see the old file or the new one, never a partial file.  On Linux the file is
    written as an unnamed file in the destination's directory (``O_TMPFILE``) and linked
    into place once complete, so a process killed mid-save leaves nothing behind; where
    that is not available it is written as ``.<name>.<pid>.<random>.tmp`` and renamed over
    ``filename``, and the next save to the same destination removes such temporaries of
    writers that no longer run (never a live writer's: each holds a lock on its own).  On
    any exception, ``KeyboardInterrupt`` included, the temporary file is removed and the
    exception re-raised.

    Copies of tensor bytes: 0 for CPU little-endian arrays and tensors, which are written
    from their own memory in slices of at most 64 MiB; 1 for big-endian numpy arrays
    (byte-swapped slice by slice), for device tensors (each slice copied into one pinned
    host buffer) and for conjugate/negative-bit torch views (resolved as a whole, one
    tensor at a time).

    Memory: independent of the total size.  Apart from those per-slice staging buffers
    (at most 64 MiB, one at a time) the writer holds the header and a few objects per
    tensor; saving a 2 GB dict allocates no buffer in proportion to it.  The written pages
    sit in the OS page cache, not in the process.
    """
    items, header, layout = _prepare(tensors, metadata, max_header_size)
    entries = {
        items[i][0]: _Entry(items[i][1].code, items[i][1].shape, items[i][1].nbytes, offset)
        for i, offset in layout
    }
    writer = TensorWriter._from_header(filename, header, entries, fsync)
    try:
        writer._write_layout([items[index] for index, _ in layout])
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def save(
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
    *,
    max_header_size: int = MAX_HEADER_SIZE,
) -> bytes:
    """The bytes of a safetensors file holding ``tensors``.

    Parameters
    ----------
    tensors : mapping of str to numpy.ndarray or torch.Tensor
        As for :func:`save_file`.
    metadata : mapping of str to str, optional
        As for :func:`save_file`.
    max_header_size : int, default 100,000,000
        As for :func:`save_file`.

    Returns
    -------
    bytes
        Identical to the file :func:`save_file` writes.

    Raises
    ------
    SerializationError
        As for :func:`save_file`.

    Notes
    -----
    The result is allocated once at its final size (zero pages from ``calloc``) and each
    tensor's bytes are copied into it once, in layout order; on CPython the buffer becomes
    the returned ``bytes`` without a further copy.  Peak memory: the tensors plus the
    result plus, for big-endian or device tensors, one staging slice of at most 64 MiB.
    """
    items, header, layout = _prepare(tensors, metadata, max_header_size)
    total = len(header) + sum(raw.nbytes for _, raw in items)
    # BytesIO adopts an unshared bytes object as its buffer, writes into it in place and
    # hands it back from getvalue() when the size matches: one allocation, no final copy.
    out = io.BytesIO(bytes(total))
    out.write(header)
    for index, offset in layout:
        out.seek(offset)
        for piece in items[index][1].chunks(_CHUNK):
            out.write(piece)
            del piece  # else a staging copy lives on while the next one is made
    return out.getvalue()
