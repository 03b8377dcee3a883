"""Streaming, atomic writer of safetensors files.

The layout is the reference implementation's, byte for byte: tensors sorted by dtype code
descending then by name, a compact JSON header as ``serde_json`` writes it, padded with
spaces to a multiple of 8.  Tensor bytes go from the tensor's memory to the file in
slices of at most 64 MiB; the file appears under its name only once it is complete.

Three layers, each usable on its own:

- :func:`build_header` (:mod:`engine.format._header_encode`) turns ``(name, dtype code, shape,
  nbytes)`` entries into the header bytes and the file offset of every tensor;
- :class:`TensorWriter` (from :func:`open_writer`) writes tensors one at a time, in any
  order, into a temporary file and commits it atomically: the writer for generators;
- :func:`save_file` and :func:`save` write a whole mapping of numpy arrays or torch tensors
  (each turned into bytes by :mod:`engine.writing._tensor_bytes`).

This module is the writing itself: where each tensor's bytes go (small tensors batched into
one vectored write), when to start the background flush, and the atomic commit.  A whole
mapping is checked and laid out before a file is touched by :mod:`engine.writing._prepare`;
the positioned writes and the flush are :mod:`engine.writing._file_writes`.
"""

from __future__ import annotations

import io
import os
import stat
import sys
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Union

from engine.base._atomic import AtomicFile, sync_dir
from engine.base._atomic import umask as _umask
from engine.base._atomic import write_error as _write_error
from engine.base.dtypes import BY_NAME, DTYPES, NAMES
from engine.errors import SerializationError
from engine.format._header_encode import build_header, check_name, checked_shape, dtype_code, packed_nbytes
from engine.format.header import MAX_HEADER_SIZE
from engine.writing._file_writes import WRITEV_MAX, BackgroundSync, write_all, writev_all
from engine.writing._prepare import prepare
from engine.writing._tensor_bytes import Raw, host_chunks, tensor_bytes

__all__ = ["save_file", "save", "build_header", "open_writer", "TensorWriter", "tensor_sizes"]

PathLike = Union[str, "os.PathLike[str]"]

#: Largest single write, and the bound on any staging copy (byte swap, device to host).
#: A multiple of 8 so that slices never split an element.
_CHUNK = 64 << 20

_U8 = BY_NAME["U8"].code


# --------------------------------------------------------------------------- checks


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
    items, _, _ = prepare(tensors, metadata, max_header_size=sys.maxsize, checksums=False, chunk=_CHUNK)
    return {name: raw.nbytes for name, raw in items}


# (the positioned writes and the background flush themselves: engine.writing._file_writes)

#: Tensors smaller than this are gathered into one ``pwritev`` of up to ``_BATCH`` bytes;
#: larger ones are written on their own, as large writes already amortise the call.
_SMALL = 1 << 20
_BATCH = 8 << 20

#: Written bytes after which a background thread starts flushing them to disk, so that the
#: final fsync of an atomic save has only the tail left instead of the whole file.
_SYNC_EVERY = 256 << 20
#: Files smaller than this get no background flush: flushing while writing competes with
#: the writes (journal commits on the same file), which a smaller file does not win back
#: (saves of a few hundred MB measured slower with it: ``scripts/bench_save.py``).
_SYNC_FROM = 1 << 30


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
            check_name(name)
            code, dims = dtype_code(name, dtype), checked_shape(name, shape)
            rows.append((name, code, dims, packed_nbytes(name, code, dims)))
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
        self._syncer: BackgroundSync | None = None
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
            write_all(fd, memoryview(header), 0)
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

    def _raw_piece(self, name: str, entry: _Entry, data: Any) -> Raw:
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data).cast("B")
            return Raw(entry.code, (len(view),), len(view), None, host_chunks(view, 1))
        raw = tensor_bytes(name, data)
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
                self._syncer = BackgroundSync(self._fd)
                weakref.finalize(self, self._syncer.close)  # a dropped writer stops it too
            self._syncer.kick()
            self._unsynced = 0

    def _write_layout(self, items: list[tuple[str, Raw]]) -> None:
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
                writev_all(fd, [v for _, v in batch], self._entries[name0].offset)
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
            if view is not None and raw.nbytes < _SMALL and WRITEV_MAX > 1:
                if batch and (size + raw.nbytes > _BATCH or len(batch) >= WRITEV_MAX):
                    flush()
                if raw.nbytes:
                    batch.append((name, view))
                    size += raw.nbytes
                continue
            flush()
            self._write_raw(name, raw)
        flush()

    def _write_raw(self, name: str, raw: Raw) -> None:
        assert self._fd is not None
        offset = self._entries[name].offset + self._filled[name]
        try:
            for piece in raw.chunks(_CHUNK):
                write_all(self._fd, piece, offset)
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
        Every tensor the file will hold; ``dtype`` is an :mod:`engine.base.dtypes` code or a
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
    checksums: bool = False,
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
    checksums : bool, default False
        Record each tensor's CRC-32C in ``__metadata__`` (:mod:`engine.format.checksums`); the
        engine's loads verify them.  Costs one more read of each tensor's bytes (device
        tensors: one more copy to the host, slice by slice) before the file is written.

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
    items, header, layout = prepare(tensors, metadata, max_header_size=max_header_size, checksums=checksums,
                                   chunk=_CHUNK)
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
    checksums: bool = False,
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
    checksums : bool, default False
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
    items, header, layout = prepare(tensors, metadata, max_header_size=max_header_size, checksums=checksums,
                                   chunk=_CHUNK)
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
