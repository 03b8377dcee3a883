"""``safe_open``: the reference's file handle, stricter and faster.

A handle parses and validates the header once (see :mod:`engine.format.header`), then hands out
tensors through one of two backends:

``"mmap"`` (default)
    The file is mapped once; every tensor is a zero-copy view of the mapping.  numpy arrays
    and torch tensors are writable, as the reference's are: the mapping is private
    (copy-on-write), so a write copies only the page it touches and never reaches the file.  Fastest when the file is in the page cache and the
    caller reads only part of it.  Like any mapping, a file truncated by another process
    while mapped can crash the process (SIGBUS); use ``"pread"`` where files can change.
``"pread"``
    Owned, writable memory filled with ``preadv`` (GIL released, several threads for large
    reads); no mapping.  For network file systems and for callers that need private memory.
"""

from __future__ import annotations

import _thread
import os
from typing import TYPE_CHECKING, Any, NoReturn

import engine.loading as frameworks  # the package: a load's framework names
from engine.format._header import MAX_HEADER_SIZE, Slicer, TensorSlice, open_regular, read_table, verifying

if TYPE_CHECKING:
    from engine.format.header import Header

__all__ = ["safe_open", "TensorSlice"]

_BACKENDS = ("mmap", "pread")


class safe_open:  # noqa: N801 - the reference's spelling, for a drop-in replacement
    """Open a safetensors file for lazy, validated access.

    Parameters
    ----------
    filename : str or os.PathLike
        The file.  (``engine.safe_open`` also opens a ``model.safetensors.index.json`` or a
        directory holding a checkpoint, as an :class:`engine.checkpoints.checkpoint.Checkpoint`.)
    framework : {"np", "numpy", "pt", "torch"}
        Kind of tensors handed out.
    device : str, int or torch.device, default "cpu"
        Where torch tensors go (``"cuda:0"``, ``0``, ...).  numpy arrays are always on the CPU.
    backend : {"mmap", "pread"}, default "mmap"
        See the module documentation.
    max_header_size : int, default 100,000,000
        Largest header accepted, in bytes; raise it for legitimate giant headers.
    verify_checksums : bool, optional
        Check each whole tensor (``get_tensor``, ``get_tensors``) against the CRC-32C its
        file records (:mod:`engine.format.checksums`) before handing it out; default True
        (``engine.format.checksums.verification`` changes the default).  Files without checksums
        are read as before.  Slices are not checked (they read part of a tensor).

    Raises
    ------
    HeaderError
        The header breaks a rule of the format; ``.reason`` says which.
    FileNotFoundError, PermissionError
        As ``open`` raises them.
    DeviceError
        A device that the framework cannot use.
    ChecksumError
        From ``get_tensor``/``get_tensors``: a tensor's bytes do not match its recorded
        checksum (the other tensors still load), or the checksum entry is malformed.

    Notes
    -----
    Copies of tensor bytes: ``"mmap"`` 0 (views of the page cache); ``"pread"`` 1 (page
    cache to owned memory).  A CUDA device, whatever the backend: 2 (page cache to a
    page-locked chunk, then DMA).
    Opening reads only the 8 + N header bytes.

    Examples
    --------
    >>> with engine.safe_open("model.safetensors", framework="pt") as f:  # doctest: +SKIP
    ...     w = f.get_slice("lm_head.weight")[:, :1024]
    """

    def __init__(
        self,
        filename,
        framework: str = "numpy",
        device: Any = "cpu",
        *,
        backend: str = "mmap",
        max_header_size: int = MAX_HEADER_SIZE,
        verify_checksums: bool | None = None,
    ) -> None:
        path = os.fspath(filename)
        # opened without blocking and checked to be a regular file (a FIFO would hang)
        self._setup(path, open_regular(path), framework, device, backend, max_header_size, verify_checksums)

    def _setup(self, path: str, fd: int, framework, device, backend: str, max_header_size: int,
               verify_checksums: bool | None = None) -> None:
        """Take ownership of the open ``fd`` (closed on failure) and read its header."""
        # whole tensors are checked against the file's checksums, where it records them
        # (engine.format.checksums), unless this handle or the code around its opening says not to
        self._verify = verifying() if verify_checksums is None else bool(verify_checksums)
        # Reads borrow the descriptor (see _borrow): close() never frees the number while a
        # read on another thread still uses it, so a reused number cannot feed another file's
        # bytes into that read.
        self._lock = _thread.allocate_lock()
        self._users = 0
        self._closing = False
        self._fd: int | None = fd
        self._path = path
        self._base = None
        self._mm = None
        self._held: object = None  # device loads' read-only mapping (False: they pread)
        self._handed: set[int] = set()  # rows viewed out of the current mapping
        self._network: bool | None = None  # on a network or FUSE mount; asked at the first mapping
        self._header: Header | None = None  # made from the table on first use (see ``header``)
        self._keys: list[str] | None = None  # the names sorted, on the first keys()
        try:
            if backend not in _BACKENDS:
                from engine.errors import SafetensorError

                raise SafetensorError(
                    f"unknown backend {backend!r}; expected one of {_BACKENDS}", reason="InvalidBackend"
                )
            self._kind = frameworks.sink_kind(framework, device)
            self._device = device
            # The sink (and numpy, and the torch sink's module) comes with the first tensor,
            # not at open: a tool that reads only names, dtypes, shapes and metadata never
            # pays for it.  torch on the CPU is imported now, as the reference imports it,
            # so that a missing torch fails here; any other torch or CuPy device is checked
            # now by making its sink, so that a bad device fails here too.
            self._sink_obj = None
            if self._kind == "torch" and str(device) == "cpu":
                try:
                    import torch  # noqa: F401 - the check; free where torch is loaded already
                except ModuleNotFoundError as exc:
                    from engine.errors import MissingDependencyError

                    raise MissingDependencyError.for_framework(exc, framework) from None
            elif self._kind != "numpy":
                self._sink_obj = frameworks.sink_for(framework, device)
            self._backend = backend
            self._size = size = os.fstat(fd).st_size
            table = read_table(fd, size, max_header_size, path)
            if table is None:
                # a length that fails its checks, or a short read: the full reader names
                # which (a Git LFS pointer, an HTML page, a truncated file ...)
                from engine.format.header import read_header_fd

                self._header = read_header_fd(fd, path=path, file_size=size, max_header_size=max_header_size)
                table = self._header.table
        except BaseException:
            self.close()
            raise
        self._table = table
        # per-name lookups are the hot path of callers that walk every key: get_slice is a
        # C callable bound to this handle (see engine.format._slices.pxi)
        self._index = table.index
        self.get_slice = Slicer(self, table)  # type: ignore[method-assign]

    @property
    def header(self) -> Header:
        """The file's validated :class:`~engine.format.header.Header`, made on first use: an
        open that only lists names, dtypes, shapes and metadata reads them from the table."""
        header = self._header
        if header is None:
            from engine.format.header import Header

            header = self._header = Header(self._table, file_size=self._size, path=self._path)
        return header

    # -- context manager -------------------------------------------------------------
    def __enter__(self) -> safe_open:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the file.  Tensors already handed out stay valid (a mapping lives as
        long as any view of it).

        Safe while other threads read through this handle: reads already under way finish
        with the right bytes (the descriptor is closed when the last of them ends), and
        reads started after ``close()`` raise ``SafetensorError`` (``reason="FileClosed"``).
        """
        slicer = self.__dict__.get("get_slice")
        if slicer is not None:
            slicer.closed = True
        held = None
        with self._lock:
            self._base = self._mm = None
            self._closing = True
            fd = self._fd if self._users == 0 else None
            if fd is not None:
                self._fd = None
                held, self._held = self._held, None
        if fd is not None:
            _close_held(held)
            os.close(fd)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _check_open(self) -> None:
        if self._closing:
            from engine.errors import SafetensorError

            raise SafetensorError("the file is closed", reason="FileClosed", path=self._path)

    def _borrow(self) -> int:
        """The descriptor, kept open until the matching :meth:`_give_back`."""
        with self._lock:
            if self._closing:
                from engine.errors import SafetensorError

                raise SafetensorError("the file is closed", reason="FileClosed", path=self._path)
            self._users += 1
            return self._fd  # type: ignore[return-value]  # not None while not closing

    def _give_back(self) -> None:
        fd = held = None
        with self._lock:
            self._users -= 1
            if self._closing and self._users == 0 and self._fd is not None:
                fd, self._fd = self._fd, None
                held, self._held = self._held, None
        if fd is not None:
            _close_held(held)
            os.close(fd)

    # -- the reference's API -----------------------------------------------------------
    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        self._check_open()
        if self._keys is None:
            self._keys = sorted(self._table.names)
        return list(self._keys)

    def offset_keys(self) -> list[str]:
        """Tensor names in the order of their bytes in the file."""
        self._check_open()
        return self.header.offset_keys()

    def metadata(self) -> dict[str, str] | None:
        """The ``__metadata__`` mapping, or None when the file has none."""
        self._check_open()
        md = self._table.metadata
        return dict(md) if md is not None else None

    def _row(self, name: str) -> int:
        row = self._index.get(name)
        if row is None or self._closing:
            self._missing(name)
        return row

    def _missing(self, name) -> NoReturn:
        """Raise what a lookup of ``name`` that found no open tensor must raise."""
        self._check_open()
        from engine.errors import TensorNotFoundError

        raise TensorNotFoundError.for_name(name, self._table.names, where="file", path=self._path)

    @property
    def _sink(self):
        """This handle's sink, made on first use for numpy and CPU torch (see ``_setup``)."""
        sink = self._sink_obj
        if sink is None:  # CPU sinks hold no state: a second one made by a racing thread is as good
            sink = self._sink_obj = frameworks.sink_for(self._kind, self._device)
        return sink

    def get_tensor(self, name: str):
        """The whole tensor ``name`` (a view for "mmap", owned memory for "pread")."""
        return self._get_rows([self._row(name)])[name]

    def get_tensors(self) -> dict:
        """Every tensor, keyed by name, in file order."""
        return self._get_rows(self._table.file_order())

    def get_slice(self, name: str) -> TensorSlice:  # replaced per handle by a C callable
        """A lazy slice handle: ``f.get_slice(name)[0:8, ::2]`` reads only those bytes."""
        return self.__dict__["get_slice"](name)

    # -- internals ---------------------------------------------------------------------
    def _get_rows(self, rows: list[int]) -> dict:
        from engine.loading.handle_reads import get_rows_many

        return get_rows_many([(self, rows)])[0]

    def _read_slice(self, row: int, index):
        from engine.loading.handle_reads import read_slice

        return read_slice(self, row, index)

    def __repr__(self) -> str:
        state = "closed" if self._closing else f"{len(self._table.names)} tensors"
        return f"<engine.safe_open {self._path!r} {self._kind} {self._backend} ({state})>"


def _close_held(held) -> None:
    if held:
        from engine.io.reader import close_mapping

        close_mapping(held)
