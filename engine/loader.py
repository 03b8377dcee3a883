"""Loads through the threaded pipeline: ``stream``, owned loads and ``load_into``.

Every path here reads with ``preadv`` from worker threads and never maps the file, so a
file that shrinks during a load raises :class:`~engine.errors.ReadError`, never SIGBUS.

Which path to use
-----------------
* Warm page cache, CPU, reading part of a file: ``safe_open(..., backend="mmap")`` (no copy).
* Private writable CPU memory, network file systems, files that may change: the owned load
  (``backend="pread"``), one copy from the page cache straight into the tensors.
* Cold cache: any of them.  The owned load and ``load_into`` read in large sequential
  requests on several threads with sequential read-ahead advice, through the page cache.
  (``scripts/bench_reader.py --only fresh`` compares bare buffered reads with ``O_DIRECT``;
  direct reads need aligned offsets, sizes and memory, which tensors in a file do not
  have, so they would cost a bounce copy.)  A mapped load of a cold file has the selected ranges read into the mapping on
  several threads before it returns (:func:`engine.reader.prefetch_mapping`), instead of
  page by page as the caller touches them.
* GPU: ``stream`` / ``load_file(device="cuda")``: pinned staging ring, reads overlapped with
  host-to-device copies.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

from . import dtypes, pipeline
from .errors import SafetensorError, TensorMismatchError, TensorNotFoundError
from .header import MAX_HEADER_SIZE, Header, read_header_fd
from .plan import DEFAULT_CHUNK_BYTES, plan_reads, select_rows
from .reader import IOV_MAX, default_threads, pread_into
from .sinks import get_sink

__all__ = ["stream", "load_into", "load_rows"]


def _open(path) -> tuple[int, str]:
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    return fd, path


def _advise_sequential(fd: int) -> None:
    # a larger kernel read-ahead window helps a cold page cache and costs nothing on a warm one
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass


def _destination(sink, header: Header, rows: list[int], per_tensor: bool):
    """Allocate the tensors of ``rows`` for ``sink``; returns (row -> tensor, Destination)."""
    t = header.table
    specs = [(r, int(t.codes[r]), t.shapes[r], int(t.ends[r]) - int(t.begins[r])) for r in rows]
    if sink.on_device:
        tensors, targets, ops = sink.allocate_device(specs, per_tensor)
        return tensors, pipeline.Destination(device_targets=targets, device_ops=ops)
    tensors, views = sink.allocate(specs, t.begins)
    return tensors, pipeline.Destination(host_views=views)


def load_rows(
    fd: int,
    header: Header,
    rows: list[int],
    sink,
    *,
    path: Optional[str] = None,
    threads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    per_tensor: bool = False,
    on_complete: Optional[Callable[[int], None]] = None,
    cancel: Optional[threading.Event] = None,
    destination=None,
    fill=None,
) -> dict[int, Any]:
    """Read ``rows`` of an open file into new tensors of ``sink``; returns row -> tensor."""
    if destination is None:
        tensors, destination = _destination(sink, header, rows, per_tensor)
    else:
        tensors, destination = destination
    requests = plan_reads(
        header.table.begins, header.table.ends, rows, header.data_start, chunk_bytes or DEFAULT_CHUNK_BYTES, IOV_MAX
    )
    pipeline.run(
        fd,
        requests,
        destination,
        path=path,
        threads=threads or default_threads(),
        chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES,
        on_complete=on_complete,
        cancel=cancel,
        fill=fill,
    )
    return tensors


_DONE = object()


def stream(
    path,
    *,
    framework: str = "pt",
    device: Any = "cuda",
    names: Optional[Iterable[str]] = None,
    patterns: Union[str, Iterable[str], None] = None,
    predicate: Optional[Callable[[str], bool]] = None,
    layers=None,
    threads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    per_tensor: bool = False,
    stats: bool = False,
    max_header_size: int = MAX_HEADER_SIZE,
) -> Iterator[tuple]:
    """Yield ``(name, tensor)`` as each tensor of a file finishes loading.

    Parameters
    ----------
    path : str or os.PathLike
    framework : {"pt", "torch", "np", "numpy"}
    device : str, int or torch.device, default "cuda"
        Destination device for torch; numpy is always "cpu".
    names, patterns, predicate, layers
        Selection, see :func:`engine.plan.select_rows`; by default every tensor.
    threads : int, optional
        Reader threads (default: one per core, 2 to 8).
    chunk_bytes : int, optional
        Bytes per read request (default 16 MiB); also the size of each staging slot.
    per_tensor : bool, default False
        On a GPU: one allocation per tensor instead of one per file.
    stats : bool, default False
        Also compute each tensor's :class:`~engine.statistics.Stats` (needs Numba).  The
        reader threads read each piece in 256 KiB windows and summarise every window right
        after it lands, while it is still in the core's L2 cache, in one native call without
        the GIL; per-thread partial results merge when the tensor is complete.  There is no
        second pass over memory.  ``None`` for dtypes the kernel does not summarise (FP8,
        sub-byte, complex).

    Yields
    ------
    (str, tensor) or (str, tensor, Stats or None)
        In completion order, which is close to file order.

    Raises
    ------
    HeaderError, ReadError, TensorNotFoundError, DeviceError

    Notes
    -----
    Copies of tensor bytes: CPU destinations 1 (page cache to tensor); GPU destinations 2
    (page cache to a pinned staging slot, then DMA to the device).  ``stats=True`` adds no
    copy: the kernels read the bytes where they landed.  Host staging memory on a
    GPU load is ``threads * 2 * chunk_bytes``.  Breaking out of the loop stops the readers,
    joins their threads and releases the file and the staging buffers.
    """
    sink = get_sink(framework, device)
    fd, spath = _open(path)
    cancel = threading.Event()
    worker: Optional[threading.Thread] = None
    try:
        header = read_header_fd(fd, path=spath, file_size=os.fstat(fd).st_size, max_header_size=max_header_size)
        rows = _select(header, spath, names, patterns, predicate, layers)
        _advise_sequential(fd)
        tensors, destination = _destination(sink, header, rows, per_tensor)
        t = header.table
        collector = _StatsCollector(header, rows, spath) if stats else None

        def result(row):
            if collector is None:
                return t.names[row], tensors[row]
            return t.names[row], tensors[row], collector.result(row)

        # tensors with no bytes are complete before anything is read
        for r in rows:
            if int(t.ends[r]) == int(t.begins[r]):
                yield result(r)
        done: "queue.SimpleQueue" = queue.SimpleQueue()

        def work() -> None:
            try:
                load_rows(
                    fd, header, rows, sink, path=spath, threads=threads, chunk_bytes=chunk_bytes,
                    on_complete=done.put, cancel=cancel, destination=(tensors, destination),
                    fill=collector.fill if collector is not None else None,
                )
                done.put(_DONE)
            except BaseException as exc:  # handed to the consumer
                done.put(exc)

        worker = threading.Thread(target=work, name="engine-stream", daemon=True)
        worker.start()
        while True:
            item = done.get()
            if item is _DONE:
                break
            if isinstance(item, BaseException):
                raise item
            yield result(item)
    finally:
        cancel.set()
        if worker is not None:
            worker.join()
        os.close(fd)


class _StatsCollector:
    """Statistics of tensors as their pieces are read, on the reader threads.

    Its :meth:`fill` is the pipeline's read hook.  A piece of at least ``WINDOW`` bytes is
    read and summarised in one native call, a window at a time, so that the kernel finds
    each window in the L2 cache where the read just left it (summarising a whole 16 MiB
    request after reading it would fetch it back from memory).  Smaller pieces are read
    together with one ``preadv`` and summarised right after.  Each reader thread has its
    own accumulator per tensor; they merge when the tensor is complete.
    """

    #: bytes per window: well inside a core's L2 with room for the kernel's scratch
    WINDOW = 256 << 10

    def __init__(self, header: Header, rows: list[int], path: Optional[str]) -> None:
        from . import statistics

        self._new = statistics.Accumulator
        self._empty = statistics.Stats.empty()
        self.path = path
        t = header.table
        self.kind: dict[int, str] = {}
        for r in rows:
            d = dtypes.DTYPES[int(t.codes[r])]
            if not d.sub_byte and d.name in statistics.SUPPORTED_NAMES:
                self.kind[r] = d.name
        self._acc: dict[int, dict[int, Any]] = {}  # row -> thread id -> Accumulator

    def _accumulator(self, row: int):
        per_thread = self._acc.setdefault(row, {})  # atomic: both threads get the same dict
        me = threading.get_ident()
        acc = per_thread.get(me)
        if acc is None:  # only this thread adds its own key
            acc = per_thread[me] = self._new(self.kind[row])
        return acc

    def fill(self, fd: int, req, targets: list) -> None:
        import numpy as np

        kind = self.kind
        run: list = []  # small pieces, contiguous in the file, read together
        run_offset = req.offset

        def flush() -> None:
            if run:
                pread_into(fd, run_offset, [v for _, v in run], path=self.path)
                for row, v in run:
                    if row in kind:
                        self._accumulator(row).add(v)
                run.clear()

        for p, view in zip(req.pieces, targets, strict=True):
            if p.nbytes < self.WINDOW or p.row not in kind:
                if not run:
                    run_offset = req.offset + p.request_offset
                run.append((p.row, view))
                continue
            flush()
            offset = req.offset + p.request_offset
            dest = np.frombuffer(view, np.uint8)
            acc = self._accumulator(p.row)
            done = acc.read(fd, offset, dest, self.WINDOW)
            if done < p.nbytes:  # a short read or an error: read the rest the usual way
                pread_into(fd, offset + done, [view[done:]], path=self.path)
                acc.add(view[done:])
        flush()

    def result(self, row: int):
        """Statistics of a complete tensor (asked once per tensor: its accumulators go)."""
        if row not in self.kind:
            return None
        out = self._empty
        for acc in self._acc.pop(row, {}).values():
            out = out.merge(acc.result())
        return out


def _select(header: Header, path: str, names, patterns, predicate, layers) -> list[int]:
    try:
        return select_rows(header.table, names, patterns=patterns, predicate=predicate, layers=layers)
    except SafetensorError as err:
        err.path = path
        raise


def _code_of(x) -> tuple[int, tuple, bool, bool]:
    """(dtype code, shape, contiguous, on a device) of a numpy array or torch tensor."""
    import numpy as np

    if isinstance(x, np.ndarray):
        return dtypes.from_numpy(x.dtype), x.shape, x.flags.c_contiguous and x.flags.writeable, False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return dtypes.from_torch(x.dtype), tuple(x.shape), x.is_contiguous(), x.device.type != "cpu"
    raise TensorMismatchError(f"cannot load into a {type(x).__name__}; expected a numpy array or torch tensor")


def load_into(
    path,
    tensors: Mapping[str, Any],
    *,
    strict: bool = False,
    threads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    max_header_size: int = MAX_HEADER_SIZE,
) -> list[str]:
    """Fill existing tensors in place from a file (a model's parameters, on CPU or CUDA).

    Parameters
    ----------
    path : str or os.PathLike
    tensors : mapping of str to numpy.ndarray or torch.Tensor
        Destinations, contiguous and writable, with the file's shapes and dtypes (for
        sub-byte dtypes: ``uint8`` of the packed shape).
    strict : bool, default False
        Also fail when the file holds tensors that ``tensors`` does not name.

    Returns
    -------
    list of str
        The names filled, in file order.

    Raises
    ------
    TensorNotFoundError
        A destination name that the file does not hold (or, with ``strict``, the reverse).
    TensorMismatchError
        A destination of the wrong shape, dtype or layout; nothing is read then.

    Notes
    -----
    Copies of tensor bytes: CPU destinations 1 (page cache to the tensor, no staging, no
    allocation); CUDA destinations 2 (through the pinned staging ring).
    """
    fd, spath = _open(path)
    try:
        header = read_header_fd(fd, path=spath, file_size=os.fstat(fd).st_size, max_header_size=max_header_size)
        t = header.table
        missing = [n for n in tensors if n not in t.index]
        if missing:
            raise TensorNotFoundError(
                f"{len(missing)} destination tensor(s) not in the file: {missing[:5]}", path=spath, tensors=missing
            )
        if strict:
            extra = [n for n in t.names if n not in tensors]
            if extra:
                raise TensorNotFoundError(
                    f"{len(extra)} tensor(s) of the file have no destination: {extra[:5]}", path=spath, tensors=extra
                )
        host_rows, device_rows = [], []
        for name, dst in tensors.items():
            row = t.index[name]
            code, shape, ok_layout, on_device = _code_of(dst)
            nbytes = int(t.ends[row]) - int(t.begins[row])
            want_code = int(t.codes[row])
            want_shape = dtypes.packed_shape(want_code, t.shapes[row], nbytes)
            if dtypes.DTYPES[want_code].sub_byte:
                want_code = dtypes.BY_NAME["U8"].code
            if code != want_code or tuple(shape) != tuple(want_shape):
                raise TensorMismatchError(
                    f"tensor {name!r}: the file has {dtypes.NAMES[int(t.codes[row])]}{list(t.shapes[row])}, "
                    f"the destination is {dtypes.NAMES[code]}{list(shape)}",
                    path=spath,
                    tensors=(name,),
                )
            if not ok_layout:
                raise TensorMismatchError(
                    f"tensor {name!r}: the destination must be contiguous and writable", path=spath, tensors=(name,)
                )
            (device_rows if on_device else host_rows).append(row)
        _advise_sequential(fd)
        names = t.names
        if host_rows:
            host_rows.sort(key=lambda r: int(t.begins[r]))
            views = {r: _host_bytes(tensors[names[r]]) for r in host_rows if int(t.ends[r]) > int(t.begins[r])}
            load_rows(fd, header, host_rows, None, path=spath, threads=threads, chunk_bytes=chunk_bytes,
                      destination=({}, pipeline.Destination(host_views=views)))
        if device_rows:
            from .sinks.torch import TorchCudaOps

            by_device: dict = {}
            for r in sorted(device_rows, key=lambda r: int(t.begins[r])):
                by_device.setdefault(tensors[names[r]].device, []).append(r)
            for device, rows in by_device.items():
                targets = {r: _device_bytes(tensors[names[r]]) for r in rows}
                load_rows(fd, header, rows, None, path=spath, threads=threads, chunk_bytes=chunk_bytes,
                          destination=({}, pipeline.Destination(device_targets=targets,
                                                                device_ops=TorchCudaOps(device))))
        return [names[r] for r in sorted(host_rows + device_rows, key=lambda r: int(t.begins[r]))]
    finally:
        os.close(fd)


def _host_bytes(x) -> memoryview:
    import numpy as np

    if isinstance(x, np.ndarray):
        return memoryview(x.reshape(-1).view(np.uint8))
    import torch

    return memoryview(x.detach().reshape(-1).view(torch.uint8).numpy())


def _device_bytes(x):
    import torch

    return x.detach().reshape(-1).view(torch.uint8)
