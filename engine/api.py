"""``safe_open``: the reference's file handle, stricter and faster.

A handle parses and validates the header once (see :mod:`engine.header`), then hands out
tensors through one of two backends:

``"mmap"`` (default)
    The file is mapped once; every tensor is a zero-copy view of the mapping.  numpy views
    are read-only; torch tensors are writable views of a private (copy-on-write) mapping,
    so writes never reach the file.  Fastest when the file is in the page cache and the
    caller reads only part of it.  Like any mapping, a file truncated by another process
    while mapped can crash the process (SIGBUS); use ``"pread"`` where files can change.
``"pread"``
    Owned, writable memory filled with ``preadv`` (GIL released, several threads for large
    reads); no mapping.  For network file systems and for callers that need private memory.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Optional

from . import dtypes
from .errors import SafetensorError, TensorNotFoundError
from .header import MAX_HEADER_SIZE, Header, read_header_fd
from .loader import load_rows
from .plan import InvalidSliceError, plan_slice
from .reader import default_threads, pread_runs, prefetch_mapping
from .sinks import get_sink

__all__ = ["safe_open", "TensorSlice"]

_BACKENDS = ("mmap", "pread")
# below this a slice is read on the calling thread: threads cost more than they save
_PARALLEL_SLICE_BYTES = 32 * 1024 * 1024


class safe_open:  # noqa: N801 - the reference's spelling, for a drop-in replacement
    """Open a safetensors file for lazy, validated access.

    Parameters
    ----------
    filename : str or os.PathLike
        The file; or a ``model.safetensors.index.json``, or a directory holding a checkpoint,
        which opens as an :class:`engine.checkpoint.Checkpoint` with the same methods.
    framework : {"np", "numpy", "pt", "torch"}
        Kind of tensors handed out.
    device : str, int or torch.device, default "cpu"
        Where torch tensors go (``"cuda:0"``, ``0``, ...).  numpy arrays are always on the CPU.
    backend : {"mmap", "pread"}, default "mmap"
        See the module documentation.
    max_header_size : int, default 100,000,000
        Largest header accepted, in bytes; raise it for legitimate giant headers.

    Raises
    ------
    HeaderError
        The header breaks a rule of the format; ``.reason`` says which.
    FileNotFoundError, PermissionError
        As ``open`` raises them.
    DeviceError
        A device that the framework cannot use.

    Notes
    -----
    Copies of tensor bytes: ``"mmap"`` 0 (views of the page cache); ``"pread"`` 1 (page
    cache to owned memory); a CUDA device adds the host-to-device copy.  Opening reads only
    the 8 + N header bytes.

    Examples
    --------
    >>> with engine.safe_open("model.safetensors", framework="pt") as f:  # doctest: +SKIP
    ...     w = f.get_slice("lm_head.weight")[:, :1024]
    """

    def __new__(cls, filename, *args, **kwargs):
        # an index or a directory is one logical checkpoint over several files
        if cls is safe_open:
            path = os.fspath(filename)
            if path.endswith(".json") or os.path.isdir(path):
                from .checkpoint import Checkpoint

                return Checkpoint(path, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        filename,
        framework: str = "numpy",
        device: Any = "cpu",
        *,
        backend: str = "mmap",
        max_header_size: int = MAX_HEADER_SIZE,
    ) -> None:
        if backend not in _BACKENDS:
            raise SafetensorError(f"unknown backend {backend!r}; expected one of {_BACKENDS}", reason="InvalidBackend")
        self._sink = get_sink(framework, device)
        self._path = os.fspath(filename)
        self._backend = backend
        self._fd: Optional[int] = os.open(self._path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._base = None
        self._mm = None
        try:
            size = os.fstat(self._fd).st_size
            self.header: Header = read_header_fd(
                self._fd, path=self._path, file_size=size, max_header_size=max_header_size
            )
        except BaseException:
            self.close()
            raise
        # per-name lookups are the hot path of callers that walk every key
        self._index = self.header.table.index
        self._shapes = self.header.table.shapes

    # -- context manager -------------------------------------------------------------
    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the file.  Tensors already handed out stay valid (a mapping lives as
        long as any view of it)."""
        self._base = self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _check_open(self) -> int:
        if self._fd is None:
            raise SafetensorError("the file is closed", reason="FileClosed", path=self._path)
        return self._fd

    # -- the reference's API -----------------------------------------------------------
    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return self.header.keys()

    def offset_keys(self) -> list[str]:
        """Tensor names in the order of their bytes in the file."""
        return self.header.offset_keys()

    def metadata(self) -> Optional[dict[str, str]]:
        """The ``__metadata__`` mapping, or None when the file has none."""
        md = self.header.metadata
        return dict(md) if md is not None else None

    def _row(self, name: str) -> int:
        row = self._index.get(name)
        if row is None:
            raise TensorNotFoundError.for_name(name, self.header.table.names, where="file", path=self._path)
        return row

    def _mapping(self):
        if self._base is None:
            fd = self._check_open()
            mm = mmap.mmap(fd, 0, access=self._sink.mmap_access)
            self._base = self._sink.map(mm)
            self._mm = mm
        return self._base

    def get_tensor(self, name: str):
        """The whole tensor ``name`` (a view for "mmap", owned memory for "pread")."""
        return self._get_rows([self._row(name)])[name]

    def get_tensors(self) -> dict:
        """Every tensor, keyed by name, in file order."""
        return self._get_rows(self.header.table.order.tolist())

    def get_slice(self, name: str) -> "TensorSlice":
        """A lazy slice handle: ``f.get_slice(name)[0:8, ::2]`` reads only those bytes."""
        return TensorSlice(self, self._row(name))

    # -- internals ---------------------------------------------------------------------
    def _get_rows(self, rows: list[int]) -> dict:
        fd = self._check_open()
        t = self.header.table
        names = t.names
        sink = self._sink
        if self._backend == "mmap" and not sink.on_device:
            base = self._mapping()
            # a cold file is read on several threads in large pieces, not page by page as
            # the caller touches it (a warm one costs a mincore call per 32 MiB)
            start = self.header.data_start
            prefetch_mapping(self._mm, [(start + int(t.begins[r]), start + int(t.ends[r])) for r in rows])
            return views(sink, base, self.header, rows, start)
        # owned memory and devices: the threaded pipeline, never a mapping
        got = load_rows(fd, self.header, rows, sink, path=self._path)
        return {names[r]: got[r] for r in rows}

    def _read_slice(self, row: int, index):
        t = self.header.table
        code = int(t.codes[row])
        d = dtypes.DTYPES[code]
        name = t.names[row]
        if d.sub_byte:
            raise SafetensorError(
                f"tensor {name!r} has the packed sub-byte dtype {d.name}; slice it after get_tensor()",
                reason="InvalidSlice",
                path=self._path,
                tensors=(name,),
            )
        try:
            plan = plan_slice(t.shapes[row], d.itemsize, index)
        except InvalidSliceError as err:
            raise InvalidSliceError(
                f"tensor {name!r} {list(t.shapes[row])}: {err.message}",
                reason="InvalidSlice",
                path=self._path,
                tensors=(name,),
            ) from None
        begin, end = int(t.begins[row]), int(t.ends[row])
        offset = self.header.data_start + begin
        sink = self._sink
        if self._backend == "mmap":
            # basic indexing of the mapped view selects without copying; only the pages the
            # selection touches are ever read
            whole = sink.view(self._mapping(), code, t.shapes[row], offset, end - begin)
            return sink.to_device(sink.finish(whole[plan.forward_index], plan.flip_squeezed, plan.result_shape))
        block = sink.empty(code, plan.out_shape, plan.nbytes)
        if plan.nbytes:
            threads = 1 if plan.nbytes < _PARALLEL_SLICE_BYTES else default_threads()
            pread_runs(self._check_open(), sink.raw(block), plan.src, plan.run_bytes, offset,
                       path=self._path, threads=threads)
        return sink.to_device(sink.finish(block, plan.flip, plan.result_shape))

    def __repr__(self) -> str:
        state = "closed" if self._fd is None else f"{len(self.header)} tensors"
        return f"<engine.safe_open {self._path!r} {self._sink.name} {self._backend} ({state})>"


def views(sink, base, header: Header, rows, data_start: int) -> dict:
    """Tensors of ``rows`` as zero-copy views of ``base``, whose byte ``data_start`` is the
    first byte of the data region (a mapped file, the bytes of a whole file, or a copy of its
    data region); keyed by name, in the order of ``rows``."""
    t = header.table
    names, codes, shapes, begins, ends = t.names, t.codes, t.shapes, t.begins, t.ends
    view = sink.view
    out = {}
    for r in rows:
        b = int(begins[r])
        out[names[r]] = view(base, int(codes[r]), shapes[r], data_start + b, int(ends[r]) - b)
    return out


class TensorSlice:
    """Lazy handle on one tensor, as returned by :meth:`safe_open.get_slice`.

    Indexing (ints, negative ints, slices with steps, ``...``) reads only the bytes the
    index covers.
    """

    __slots__ = ("_handle", "_row")

    def __init__(self, handle: safe_open, row: int) -> None:
        self._handle = handle
        self._row = row

    def get_shape(self) -> list[int]:
        return list(self._handle._shapes[self._row])

    def get_dtype(self) -> str:
        return self._handle.header.dtypes[self._row]

    @property
    def shape(self) -> tuple[int, ...]:
        return self._handle._shapes[self._row]

    @property
    def dtype(self) -> str:
        return self.get_dtype()

    def __len__(self) -> int:
        shape = self.shape
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return shape[0]

    def __getitem__(self, index):
        return self._handle._read_slice(self._row, index)

    def __repr__(self) -> str:
        name = self._handle.header.table.names[self._row]
        return f"<TensorSlice {name!r} {self.get_dtype()}{list(self.shape)}>"
