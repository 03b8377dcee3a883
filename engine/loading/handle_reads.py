"""What an open :class:`~engine.loading.file_handle.safe_open` does with its tensors' bytes:
whole tensors (views of a mapping, or one load through the threaded pipeline), slices, and
loads into existing tensors.

Apart from :mod:`engine.loading.file_handle` so that opening a file and reading its header
(names, dtypes, shapes, metadata) loads none of this: it comes with the first tensor.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from engine.base import dtypes
from engine.base._files import PREFETCH_MIN_BYTES
from engine.format.verification import records_checksums, verification

if TYPE_CHECKING:
    from engine.format.header import HeaderTable

# a handle: engine.loading.file_handle.safe_open, which imports this module on first use (so
# this one does not import it, not even for its annotations)
Handle = Any

__all__ = ["get_rows_many", "load_into_many", "read_slice", "views", "held_mapping", "mapping", "mapping_for"]

# below this a slice is read on the calling thread: threads cost more than they save
_PARALLEL_SLICE_BYTES = 32 * 1024 * 1024


def read_slice(self: Handle, row: int, index):
    """``safe_open.get_slice``'s indexing: the bytes ``index`` covers of tensor ``row``
    (a view of the mapping for ``"mmap"``, owned memory read with ``preadv`` for ``"pread"``)."""
    from engine.io.reader import default_threads, pread_runs
    from engine.planning.plan import InvalidSliceError, plan_slice

    t = self._table
    code = int(t.codes[row])
    d = dtypes.DTYPES[code]
    name = t.names[row]
    if d.sub_byte:
        from engine.errors import SafetensorError

        raise SafetensorError(
            f"tensor {name!r} has the packed sub-byte dtype {d.name}; slice it after get_tensor()",
            reason="InvalidSlice",
            path=self._path,
            tensors=(name,),
        )
    try:
        # as the reference: numpy slices refuse bounds past an axis, torch slices clamp them
        plan = plan_slice(t.shapes[row], d.itemsize, index, strict_bounds=self._kind != "torch")
    except InvalidSliceError as err:
        raise InvalidSliceError(
            f"tensor {name!r} {list(t.shapes[row])}: {err.message}",
            reason="InvalidSlice",
            path=self._path,
            tensors=(name,),
        ) from None
    begin, end = int(t.begins[row]), int(t.ends[row])
    offset = 8 + t.header_size + begin
    sink = self._sink
    if self._backend == "mmap":
        # basic indexing of the mapped view selects without copying; only the pages the
        # selection touches are ever read
        whole = sink.view(mapping_for(self, (row,)), code, t.shapes[row], offset, end - begin)
        return sink.to_device(sink.finish(whole[plan.forward_index], plan.flip_squeezed, plan.result_shape))
    block = sink.empty(code, plan.out_shape, plan.nbytes)
    if plan.nbytes:
        threads = 1 if plan.nbytes < _PARALLEL_SLICE_BYTES else default_threads()
        fd = self._borrow()
        try:
            pread_runs(fd, sink.raw(block), plan.src, plan.run_bytes, offset, path=self._path, threads=threads)
        finally:
            self._give_back()
    return sink.to_device(sink.finish(block, plan.flip, plan.result_shape))


def held_mapping(self: Handle, fd: int):
    """The read-only mapping device loads copy out of (None: they ``pread``), made by the
    first and kept until the handle closes: a loop of ``get_tensor`` calls maps the file
    once, not once per key.  Call with the descriptor borrowed."""
    held = self._held
    if held is None:
        from engine.base._files import advise_sequential
        from engine.io.reader import close_mapping, copy_mapping

        advise_sequential(fd)  # once for the handle, not per load
        made = copy_mapping(fd)
        with self._lock:
            if self._held is None:
                self._held, made = (made if made is not None else False), None
            held = self._held
        if made:  # another thread made one first
            close_mapping(made)
    return held or None


def mapping(self: Handle):
    """The base that tensors of this handle view: its mapping (made by the first), as its sink
    hands views out of it."""
    base = self._base
    if base is None:
        fd = self._borrow()
        try:
            if self._network is None:
                from engine.base._files import advise_sequential, on_network_mount

                self._network = on_network_mount(fd)
                if self._network:
                    # there each fault of the mapping is a round trip for the read-ahead
                    # window around it: a doubled window halves them (as the reference
                    # advises its mapping; scripts/bench_netfs.py)
                    advise_sequential(fd)
            from engine.sinks import map_file

            mm = map_file(self._sink, fd)
        finally:
            self._give_back()
        self._mm = mm
        base = self._base = self._sink.map(mm)
    return base


def mapping_for(self: Handle, rows) -> object:
    """The mapping to view ``rows`` out of: this handle's, or a new private one where one
    of them was viewed before.  Views of one copy-on-write mapping share their writes,
    and the reference hands out independent arrays each time, so a second ``get_tensor``
    of a tensor whose first array was written to must still see the file's bytes.  The
    views handed out before keep their mapping alive."""
    with self._lock:
        if not self._handed.isdisjoint(rows):
            self._base = self._mm = None
            self._handed = set()
        self._handed.update(rows)
    return mapping(self)


@contextlib.contextmanager
def _borrowed(parts: list[tuple[Handle, list[int]]], held: bool = False):
    """:class:`engine.loading.loader.Part` of each (handle, rows), their descriptors kept open
    against a concurrent ``close()`` until the block ends; with ``held``, each with its
    handle's held mapping (device loads)."""
    from engine.loading.loader import Part

    taken: list[Handle] = []
    try:
        files = []
        for h, rows in parts:
            fd = h._borrow()
            taken.append(h)
            files.append(Part(fd, h.header, rows, h._path, mapping=held_mapping(h, fd) if held else None))
        yield files
    finally:
        for h in taken:
            h._give_back()


def load_into_many(handles: list[Handle], tensors, *, source: str | None = None, **options) -> list[str]:
    """:func:`engine.load_into` from several open handles (a checkpoint's shards) as one
    load; ``options`` as :func:`engine.loading.fill.fill_parts` takes them."""
    from engine.loading.fill import fill_parts

    with _borrowed([(h, []) for h in handles]) as files, verification(handles[0]._verify if handles else None):
        return fill_parts(files, tensors, source=source, **options)


def get_rows_many(parts: list[tuple[Handle, list[int]]]) -> list[dict]:
    """The tensors of ``rows`` (name -> tensor) of each of several open handles, which share
    one framework, device and backend (a checkpoint's shards).

    ``"mmap"`` on the CPU makes views of each file's mapping (read ahead on several threads
    when cold).  Everything else (owned ``"pread"`` loads, CUDA) is one load across every
    file: one queue of reads, one set of threads or one chunk ring, one allocation
    (:func:`engine.loading.loader.load_parts`).

    Copies of tensor bytes: ``"mmap"`` 0; ``"pread"`` 1 (page cache to owned memory); a
    CUDA device 2 (see :mod:`engine.loading.pipeline`).
    """
    if not parts:
        return []
    for h, _ in parts:
        h._check_open()
    sink = parts[0][0]._sink
    if parts[0][0]._backend == "mmap" and not sink.on_device:
        outs = []
        for h, rows in parts:
            t = h._table  # not h.header: a first tensor makes no Header
            base = mapping_for(h, rows)
            start = 8 + t.header_size
            columns = _columns(t, rows)
            _, begins, ends = columns
            spans = [(start + int(begins[r]), start + int(ends[r])) for r in rows]
            if sum(hi - lo for lo, hi in spans) >= PREFETCH_MIN_BYTES and not h._network:
                # a cold file is read on several threads in large pieces, not page by page as
                # the caller touches it (a warm one costs a mincore call per 32 MiB); a small
                # load (a tool's first tensor) needs none of the reader.  Not on a network or
                # FUSE mount: there a populate runs one read-ahead window at a time through
                # the mount, and the caller's own copy, faulting on all its threads with the
                # doubled window, is faster (scripts/bench_netfs.py)
                from engine.io.reader import prefetch_mapping

                prefetch_mapping(h._mm, spans)
            checks = _checks_of(h) if h._verify else None
            if checks is not None:
                # zero copies here: the check is one read of the mapped bytes, before any view
                # is handed out (it also reads a cold file in)
                checks.verify_views(h._mm, start, rows, begins, ends)
            outs.append(views(sink, base, t, rows, start, path=h._path, columns=columns))
    else:
        # owned memory and CUDA: the threaded pipeline, never a mapping (imported here:
        # opening a file and reading its header need none of it)
        from engine.loading.loader import load_parts

        with _borrowed(parts, held=sink.on_device) as files, verification(parts[0][0]._verify):
            got = load_parts(files, sink)
        outs = [{h._table.names[r]: g[r] for r in rows} for (h, rows), g in zip(parts, got, strict=True)]
    if getattr(sink, "moves", False):  # a torch device reached with .to() (mps, xpu, ...)
        outs = [{name: sink.to_device(x) for name, x in out.items()} for out in outs]
    return outs


def _columns(table, rows) -> tuple:
    """(codes, begins, ends) to index by row: Python lists when ``rows`` is much of the
    table (indexing the arrays would build a numpy scalar per field; one ``tolist`` per
    column is cheaper), else the arrays themselves (a few rows of a large file must not
    pay for converting every row)."""
    if len(rows) * 8 >= len(table.names):
        return table.codes.tolist(), table.begins.tolist(), table.ends.tolist()
    return table.codes, table.begins, table.ends


def views(sink, base, table: HeaderTable, rows, data_start: int, path=None, columns=None) -> dict:
    """Tensors of ``rows`` as zero-copy views of ``base``, whose byte ``data_start`` is the
    first byte of the data region (a mapped file, the bytes of a whole file, or a copy of its
    data region); keyed by name, in the order of ``rows``.

    ``columns``: the table's (codes, begins, ends) as :func:`_columns` gave them, when the
    caller has them already.  Raises ``UnrepresentableTensorError`` naming the tensor (and
    ``path``) for a valid entry the framework cannot build."""
    t = table
    names, shapes = t.names, t.shapes
    codes, begins, ends = columns if columns is not None else _columns(t, rows)
    view = sink.view
    out = {}
    for r in rows:
        b = int(begins[r])
        try:
            out[names[r]] = view(base, int(codes[r]), shapes[r], data_start + b, int(ends[r]) - b)
        except Exception as err:  # noqa: BLE001 - the engine's error is imported by the first one
            from engine.errors import UnrepresentableTensorError

            if not isinstance(err, UnrepresentableTensorError):
                raise
            raise UnrepresentableTensorError(
                f"tensor {names[r]!r}: {err.message}", reason=err.reason, path=path, tensors=(names[r],)
            ) from None
    return out


def _checks_of(h: Handle):
    """:meth:`engine.format.checksums.Checks.of`, imported when first needed: a handle's first
    open of a file (with or without checksums) imports none of the checksum code, and nor does
    a load from a file that records none."""
    if not records_checksums(h._table.metadata):
        return None
    from engine.format.checksums import Checks

    return Checks.of(h.header, h._path)
