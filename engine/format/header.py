"""Read and validate the header of a safetensors file.

A safetensors file is an 8-byte little-endian length ``N``, ``N`` bytes of JSON, then the
data region.  :func:`read_header` reads exactly those ``8 + N`` bytes (never a tensor byte)
and checks every rule of the format, stricter than the reference implementation where the
reference is silent (duplicate keys, trailing garbage); fields of a tensor entry that the
format does not define are ignored, as by the reference (``strict=True`` rejects them).  The parsing itself
lives in the private Cython module :mod:`engine.format._header`.
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.base._files import file_size as _file_size_now
from engine.base._files import is_url, open_regular
from engine.base.dtypes import BITS, BY_NAME, NAMES
from engine.errors import HeaderError, ReadError, TensorNotFoundError
from engine.format import _header

# Slicer and TensorSlice are the handle's per-name lookups, native in the header's extension
# (see _slices.pxi); engine.loading.file_handle takes them from here
from engine.format._header import HeaderTable, Slicer, TensorSlice, header_length, parse_header

__all__ = [
    "MAX_HEADER_SIZE",
    "TensorInfo",
    "Header",
    "read_header",
    "read_header_fd",
    "parse_buffer",
    "parse_prefix",
    "parse_header",
    "header_length",
    "checked_length",
    "not_safetensors",
    "Slicer",
    "TensorSlice",
]

#: Largest header (the JSON part, in bytes) accepted unless ``max_header_size`` says otherwise.
MAX_HEADER_SIZE: int = _header.MAX_HEADER_SIZE



if TYPE_CHECKING:

    class _TensorInfoFields(NamedTuple):
        name: str
        dtype: str
        shape: tuple[int, ...]
        data_offsets: tuple[int, int]
else:
    # the same tuple class as typing.NamedTuple would make, without compiling each field's
    # string annotation at import, which typing.NamedTuple does on every first open
    _TensorInfoFields = collections.namedtuple("TensorInfo", ["name", "dtype", "shape", "data_offsets"])


class TensorInfo(_TensorInfoFields):
    """What the header says about one tensor: ``name``, ``dtype`` (the format's name, e.g.
    ``"BF16"``), ``shape``, and ``data_offsets``, ``[begin, end)`` relative to the start of
    the data region."""

    __slots__ = ()

    @property
    def code(self) -> int:
        """The dtype's code, an index into :data:`engine.base.dtypes.DTYPES`."""
        return BY_NAME[self.dtype].code

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in the data region."""
        return self.data_offsets[1] - self.data_offsets[0]

    @property
    def numel(self) -> int:
        """Number of elements (parameters)."""
        return math.prod(self.shape)


class Header:
    """A validated safetensors header.

    Built by :func:`read_header`, :func:`read_header_fd` or :func:`parse_buffer`; holds no
    file handle and no tensor bytes.  Mapping-like: ``len(h)``, ``name in h``, ``h[name]``
    (a :class:`TensorInfo`); iteration and :meth:`keys` give the names sorted, like the
    reference's ``safe_open.keys()``.

    Attributes
    ----------
    path : str or None
        The file, where there is one.
    file_size : int
        Bytes in the whole file (or buffer).
    header_size : int
        ``N``, bytes of the JSON header (padding included).
    data_start : int
        Offset of the data region from the start of the file, ``8 + N``.
    data_size : int
        Bytes in the data region.
    metadata : dict of str to str, or None
        The ``__metadata__`` entry; ``None`` when the header has none.
    table : engine.format._header.HeaderTable
        The compact table: names, dtype codes, shapes, offsets, file order.
    """

    __slots__ = ("path", "file_size", "table", "_sorted", "_infos", "_dtype_names")

    def __init__(self, table: HeaderTable, *, file_size: int, path: str | None = None) -> None:
        self.table = table
        self.file_size = file_size
        self.path = path
        self._sorted: list[str] | None = None
        self._dtype_names: list[str] | None = None
        self._infos: list[TensorInfo] | None = None

    # -- sizes ---------------------------------------------------------------------------
    @property
    def header_size(self) -> int:
        return self.table.header_size

    @property
    def data_start(self) -> int:
        return 8 + self.table.header_size

    @property
    def data_size(self) -> int:
        return self.table.data_size

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (the data region's size)."""
        return self.table.data_size

    @property
    def metadata(self) -> dict[str, str] | None:
        return self.table.metadata

    # -- names ---------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Tensor names in header order (a copy)."""
        return list(self.table.names)

    def keys(self) -> list[str]:
        """Tensor names sorted, like the reference's ``safe_open.keys()``."""
        if self._sorted is None:
            self._sorted = sorted(self.table.names)
        return list(self._sorted)

    @property
    def dtypes(self) -> list[str]:
        """Dtype names (``"BF16"``, ...) in header order, parallel to ``table.shapes`` (a
        copy, as :attr:`names` is: changing it changes nothing here).

        With ``table.names`` and ``table.shapes`` this reads every tensor's dtype and shape
        without one Python object per tensor beyond those lists.
        """
        if self._dtype_names is None:
            self._dtype_names = self.table.dtype_names()
        return list(self._dtype_names)

    def offset_keys(self) -> list[str]:
        """Tensor names in file order (by data offset)."""
        names = self.table.names
        return [names[row] for row in self.table.file_order()]

    def __len__(self) -> int:
        return len(self.table.names)

    def __contains__(self, name: object) -> bool:
        return name in self.table.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    # -- tensors -------------------------------------------------------------------------
    def _info(self, row: int) -> TensorInfo:
        if self._infos is not None:
            return self._infos[row]
        return self.table.row(row, TensorInfo)

    def __getitem__(self, name: str) -> TensorInfo:
        # kept flat: this is the per-tensor hot path of every loader
        try:
            row = self.table.index[name]
        except (KeyError, TypeError):
            raise self._not_found(name) from None
        if self._infos is not None:
            return self._infos[row]
        return self.table.row(row, TensorInfo)

    def info(self, name: str) -> TensorInfo:
        """Same as ``header[name]``."""
        return self[name]

    def get(self, name: str, default: Any = None) -> Any:
        """``header[name]``, or ``default`` when there is no such tensor."""
        row = self.table.index.get(name)
        return default if row is None else self._info(row)

    def infos(self) -> list[TensorInfo]:
        """Every :class:`TensorInfo`, in header order (built once, in C, then cached)."""
        if self._infos is None:
            self._infos = self.table.rows(TensorInfo)
        return list(self._infos)

    def items(self) -> list[tuple[str, TensorInfo]]:
        """``(name, TensorInfo)`` pairs in header order."""
        if self._infos is None:
            pairs = self.table.items(TensorInfo)
            self._infos = [info for _, info in pairs]
            return pairs
        return list(zip(self.table.names, self._infos, strict=True))

    def values(self) -> list[TensorInfo]:
        """Same as :meth:`infos`."""
        return self.infos()

    def _not_found(self, name: object) -> TensorNotFoundError:
        return TensorNotFoundError.for_name(name, self.table.names, where="file", path=self.path)

    # -- summaries -----------------------------------------------------------------------
    def parameters(self) -> dict[str, int]:
        """Element count per dtype name (in dtype-code order), plus ``"total"``."""
        out: dict[str, int] = {}
        total = 0
        for code, size in self.table.bytes_per_code().items():
            # nbytes * 8 == numel * bits exactly (the header check guarantees it)
            count = size * 8 // BITS[code]
            out[NAMES[code]] = count
            total += count
        out["total"] = total
        return out

    def to_dict(self) -> dict[str, Any]:
        """The header as JSON-able data, in header order, ``__metadata__`` first if present."""
        out: dict[str, Any] = {}
        if self.metadata is not None:
            out["__metadata__"] = dict(self.metadata)
        for info in self.infos():
            out[info.name] = {
                "dtype": info.dtype,
                "shape": list(info.shape),
                "data_offsets": list(info.data_offsets),
            }
        return out

    def __repr__(self) -> str:
        where = f" {self.path!r}" if self.path else ""
        return f"<Header{where}: {len(self)} tensors, {self.data_size} data bytes>"


_TEXT_BYTES = frozenset(range(0x20, 0x7F)) | {0x09, 0x0A, 0x0D}


def not_safetensors(prefix: bytes, content_type: str | None = None, *, remote: bool = False) -> str | None:
    """Name what a file whose 8-byte length failed its checks is instead, or ``None``.

    Parameters
    ----------
    prefix : bytes
        The file's first 8 bytes.
    content_type : str, optional
        The HTTP ``Content-Type`` of the body, where there is one.
    remote : bool, default False
        Phrase the advice for a download (a URL) rather than for a local file.

    Returns
    -------
    str or None
        ``"a Git LFS pointer file, not the weights (...)"``, ``"an HTML page, ..."``,
        ``"JSON, ..."`` or ``"a text file, ..."``; ``None`` when the bytes are not text,
        whatever they are.

    Notes
    -----
    Eight bytes of text read as a little-endian length are at least ``0x0909090909090909``
    (about 6.5e17), so no real safetensors file starts with text: the answer never names a
    damaged safetensors file as something else.  An HTML ``Content-Type`` is trusted as is.
    """
    head = bytes(prefix[:8])
    is_html_type = bool(content_type) and "html" in content_type.lower()  # type: ignore[union-attr]
    if not is_html_type and (len(head) < 8 or not _TEXT_BYTES.issuperset(head)):
        return None
    if head.startswith(b"version "):
        if remote:
            return ("a Git LFS pointer file, not the weights (on the Hugging Face Hub use a /resolve/ URL, "
                    "not /raw/ or /blob/)")
        return "a Git LFS pointer file, not the weights (fetch them with `git lfs pull`)"
    stripped = head.lstrip()
    if is_html_type or stripped[:1] == b"<":
        return "an HTML page, not a safetensors file (an error or login page?)"
    if stripped[:1] in (b"{", b"["):
        return "JSON, not a safetensors file"
    return "a text file, not a safetensors file"


def checked_length(
    prefix, file_size: int, max_header_size: int = MAX_HEADER_SIZE, *, content_type: str | None = None,
    remote: bool = False,
) -> int:
    """:func:`header_length`, whose error names a file that is not safetensors at all.

    A Git LFS pointer, an HTML page, JSON or any text saved as ``.safetensors`` (or served
    for one) raises ``HeaderError`` with ``reason="NotSafetensors"`` naming what it is
    (see :func:`not_safetensors`), not a header length it never meant.  Local files and
    downloads (:mod:`engine.urls.remote`) share this one check.
    """
    try:
        return header_length(prefix, file_size, max_header_size)
    except HeaderError:
        what = not_safetensors(prefix, content_type, remote=remote) if file_size >= 8 else None
        if what is None:
            raise
        where = "the server sent" if remote else "the file is"
        raise HeaderError(
            f"{where} {what}; its first bytes {bytes(prefix[:8])!r} are not a header length",
            reason="NotSafetensors",
        ) from None


def _set_path(err: HeaderError, path: str | None) -> None:
    """Name the file in an error raised below (str(err) starts with the path)."""
    if path is not None and err.path is None:
        err.path = path


def _pread_exact(fd: int, size: int, offset: int, path: str | None) -> bytes:
    """``size`` bytes at ``offset``; a file that ends early raises ReadError, never loops."""
    data = os.pread(fd, size, offset)
    if len(data) == size:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        chunk = os.pread(fd, size - got, offset + got)
        if not chunk:
            now = _file_size_now(fd)
            held = f"the file holds {now} bytes" if now is not None else f"the file ended at offset {offset + got}"
            raise ReadError(
                f"{held}, too few for its header ({size} bytes at offset {offset}); "
                "it is shorter than it claims or was truncated",
                reason="ShortRead",
                path=path,
                offset=offset,
                size=size,
            )
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_header_fd(
    fd: int,
    *,
    path: str | os.PathLike[str] | None = None,
    file_size: int | None = None,
    max_header_size: int = MAX_HEADER_SIZE,
    strict: bool = False,
) -> Header:
    """Read and validate the header of an already-open file.

    Parameters
    ----------
    fd : int
        A file descriptor open for reading; it supports ``os.pread`` and is not moved,
        closed or otherwise touched.
    path : str or os.PathLike, optional
        Name of the file, for messages and ``Header.path``.
    file_size : int, optional
        Size of the file; taken from ``os.fstat(fd)`` when omitted.
    max_header_size : int, optional
        Largest header length ``N`` accepted (default :data:`MAX_HEADER_SIZE`).
    strict : bool, default False
        Reject fields of a tensor entry other than ``dtype``, ``shape`` and
        ``data_offsets``; by default they are checked to be JSON and ignored, as the
        reference ignores them.

    Returns
    -------
    Header

    Raises
    ------
    HeaderError
        The header breaks a rule of the format; ``.reason`` names which, ``.path`` is set.
    ReadError
        The file ends before ``8 + N`` bytes (it shrank after ``file_size`` was taken).
    OSError
        Reading failed.

    Notes
    -----
    Reads exactly ``8 + N`` bytes with two ``os.pread`` calls; copies of tensor bytes: 0.
    Memory: the ``N`` header bytes plus the table (about 100 bytes per tensor).
    """
    spath = os.fspath(path) if path is not None else None
    if file_size is None:
        file_size = os.fstat(fd).st_size
    try:
        prefix = _pread_exact(fd, min(8, file_size), 0, spath)
        n = checked_length(prefix, file_size, max_header_size)
        buf = _pread_exact(fd, n, 8, spath)
        table = parse_header(buf, file_size - 8 - n, strict)
    except HeaderError as err:
        _set_path(err, spath)
        raise
    return Header(table, file_size=file_size, path=spath)


def read_header(
    path: str | os.PathLike[str], *, max_header_size: int = MAX_HEADER_SIZE, strict: bool = False
) -> Header:
    """Read and validate the header of a safetensors file.

    Parameters
    ----------
    path : str or os.PathLike
        The file.
    max_header_size : int, optional
        Largest header length ``N`` accepted (default :data:`MAX_HEADER_SIZE`, 100 MB like
        the reference); raise it for files with very many tensors.
    strict : bool, default False
        Reject fields of a tensor entry beyond ``dtype``, ``shape`` and ``data_offsets``
        (by default ignored, as by the reference).

    Returns
    -------
    Header
        Names, dtypes, shapes, offsets and metadata; no tensor bytes.

    Raises
    ------
    HeaderError
        The header breaks a rule of the format; ``.reason`` names which (the reference's
        error names), ``.position`` the byte within the header for syntax errors, and
        ``str(err)`` names the file and the tensors involved.
    ReadError
        The file is shorter than ``8 + N`` bytes when read; it is a FIFO, device or socket
        (``reason="NotRegularFile"``, refused without blocking); a symlink loop
        (``reason="SymlinkLoop"``).
    OSError
        The file cannot be opened or read.

    Notes
    -----
    Opens the file, reads 8 bytes, then exactly ``N`` bytes with ``os.pread``, and closes
    it: copies of tensor bytes: 0.  Parsing is a single pass over the header in C with the
    GIL released; a header of 100,000 tensors parses in a few tens of milliseconds.

    Examples
    --------
    >>> h = read_header("model.safetensors")  # doctest: +SKIP
    >>> h["lm_head.weight"].shape  # doctest: +SKIP
    (32000, 4096)
    """
    spath = os.fspath(path)
    if is_url(spath):  # this floor has no network client: say where one is
        raise ReadError("a URL, and engine.format.header.read_header reads local files; engine.read_header and "
                        "engine.urls.remote.read_header take URLs", reason="LocalPathExpected", path=spath)
    fd = open_regular(spath)
    try:
        return read_header_fd(fd, path=spath, max_header_size=max_header_size, strict=strict)
    finally:
        os.close(fd)


def parse_prefix(
    prefix: bytes, *, file_size: int, path: str | os.PathLike[str] | None = None,
    max_header_size: int = MAX_HEADER_SIZE,
) -> Header:
    """The header of a file whose first ``8 + N`` bytes, ``prefix``, were read elsewhere (a
    rank of a group load that holds the file hands them to one that does not).

    Parameters
    ----------
    prefix : bytes
        The file's first ``8 + N`` bytes: the length and the JSON header.
    file_size : int
        Bytes in the whole file.
    path : str or os.PathLike, optional
        Name of the file, for messages and ``Header.path``.
    max_header_size : int, optional

    Returns
    -------
    Header

    Raises
    ------
    HeaderError
        The header breaks a rule of the format, or ``prefix`` holds fewer than ``8 + N`` bytes.
    """
    spath = os.fspath(path) if path is not None else None
    try:
        n = checked_length(prefix[:8], file_size, max_header_size)
        if len(prefix) < 8 + n:
            raise HeaderError(f"the header's {n} bytes were not all given ({len(prefix) - 8} came)",
                              reason="InvalidHeaderLength")
        table = parse_header(prefix[8 : 8 + n], file_size - 8 - n, False)
    except HeaderError as err:
        _set_path(err, spath)
        raise
    return Header(table, file_size=file_size, path=spath)


def parse_buffer(
    buffer: Any,
    *,
    path: str | os.PathLike[str] | None = None,
    max_header_size: int = MAX_HEADER_SIZE,
    strict: bool = False,
) -> Header:
    """Parse the header of a whole safetensors file held in memory.

    Parameters
    ----------
    buffer : bytes-like
        The whole file: ``bytes``, ``bytearray``, ``mmap.mmap``, ``memoryview`` or any
        C-contiguous buffer.
    path : str or os.PathLike, optional
        Name of the file, for messages and ``Header.path``.
    max_header_size : int, optional
        Largest header length ``N`` accepted.
    strict : bool, default False
        Reject unknown fields in tensor entries (see :func:`read_header_fd`).

    Returns
    -------
    Header
        ``header.data_start`` is where the data region begins within ``buffer``.

    Raises
    ------
    HeaderError
        The header breaks a rule of the format.

    Notes
    -----
    The header is scanned in place and no reference to ``buffer`` is kept, so an ``mmap``
    can be closed afterwards.  Copies of tensor bytes: 0; copies of header bytes: 0.
    """
    spath = os.fspath(path) if path is not None else None
    with memoryview(buffer) as mv:
        if mv.ndim != 1 or mv.itemsize != 1 or not mv.c_contiguous:
            with mv.cast("B") as flat:
                return parse_buffer(flat, path=spath, max_header_size=max_header_size, strict=strict)
        size = mv.nbytes
        try:
            n = checked_length(mv[:8], size, max_header_size)
            with mv[8 : 8 + n] as head:
                table = parse_header(head, size - 8 - n, strict)
        except HeaderError as err:
            _set_path(err, spath)
            raise
    return Header(table, file_size=size, path=spath)
