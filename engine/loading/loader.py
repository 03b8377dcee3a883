"""Loads through the threaded pipeline: ``stream`` and owned loads (``load_into``, which fills
existing tensors, is :mod:`engine.loading.fill`), and the parts they share with it: a file's
:class:`Part`, one key space over several files, one pipeline run over them.

A file that shrinks during a load raises :class:`~engine.errors.ReadError`, never SIGBUS:
reads are ``pread`` or copies out of a populated mapping under a SIGBUS guard, on the host
and into a device's page-locked chunks alike.

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
  several threads before it returns (:func:`engine.io.reader.prefetch_mapping`), instead of
  page by page as the caller touches them.
* GPU: ``stream`` / ``load_file(device="cuda")``: the native chunk ring, small page-locked
  chunks filled by native copy threads while the DMAs out of the full ones run (see
  :mod:`engine.loading.pipeline`, :mod:`engine.gpu.device_ring`).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from engine.base import dtypes
from engine.base._files import advise_sequential, open_regular
from engine.errors import MissingDependencyError, NonFiniteError
from engine.format.checksums import Checks, verifying
from engine.format.header import MAX_HEADER_SIZE, Header, read_header_fd
from engine.gpu import device_ring
from engine.gpu.geometry import geometry_for
from engine.io.reader import IOV_MAX
from engine.loading import pipeline
from engine.loading import sink_for as get_sink
from engine.loading._selection import select_file, select_files
from engine.loading.cpu_stats import StatsCollector
from engine.loading.load_hooks import plan as onload_plan
from engine.planning.plan import DEFAULT_CHUNK_BYTES, plan_reads

__all__ = ["stream", "stream_parts", "load_file", "load_parts", "Part", "open_file", "key_bases", "run_parts", "sink_for",
           "prepare_ring", "prepare_device", "load_finite"]


def open_file(path) -> tuple[int, str]:
    """A descriptor of the regular file ``path``, and its name as a string."""
    path = os.fspath(path)
    return open_regular(path), path  # a FIFO or device is refused, never waited on


class Part(NamedTuple):
    """One file's share of a load: an open descriptor, its header, the rows to read (file
    order reads fastest) and the file's name for errors.  A remote file has ``fd`` -1 and
    ``ranges`` (see :class:`engine.loading.pipeline.Source`)."""

    fd: int
    header: Header
    rows: list[int]
    path: str | None = None
    ranges: Callable[[int, Sequence[memoryview]], None] | None = None
    mapping: object = None  # a read-only mapping of the file held by the caller (see pipeline.Source)


def key_bases(parts: Sequence[Part]) -> list[int]:
    """One key space over every file of a load: part ``i``'s row ``r`` is key ``bases[i] + r``."""
    bases, base = [], 0
    for p in parts:
        bases.append(base)
        base += len(p.header.table.names)
    return bases


def _destination(sink, parts: Sequence[Part], bases: list[int], per_tensor: bool):
    """Tensors for every row of every part, keyed ``bases[i] + row`` (on a device, an
    allocation each, or one for all with ``per_tensor=False``); returns (key -> tensor, Destination)."""
    specs = []
    for p, b in zip(parts, bases, strict=True):
        t = p.header.table
        specs += [(b + r, int(t.codes[r]), t.shapes[r], int(t.ends[r]) - int(t.begins[r])) for r in p.rows]
    if sink.on_device:
        tensors, targets, ops = sink.allocate_device(specs, per_tensor)
        return tensors, pipeline.Destination(device_targets=targets, device_ops=ops)
    if len(parts) == 1:
        begins: Any = parts[0].header.table.begins  # keys are rows
    else:
        # distinct files never count as neighbours when the host block is packed
        begins = {
            b + r: (i << 50) + int(p.header.table.begins[r])
            for i, (p, b) in enumerate(zip(parts, bases, strict=True))
            for r in p.rows
        }
    tensors, views = sink.allocate(specs, begins)
    return tensors, pipeline.Destination(host_views=views, fresh=True)


def _sources(parts: Sequence[Part], bases: list[int], chunk_bytes: int | None,
             verify: bool | None = None) -> list[pipeline.Source]:
    # the checksums a part's header records, compared as its tensors land (unless the load
    # skips them: verify False, or None and engine.format.checksums.verification(False))
    verify = verifying() if verify is None else verify
    return [
        pipeline.Source(
            p.fd, p.path,
            plan_reads(p.header.table.begins, p.header.table.ends, p.rows, p.header.data_start,
                       chunk_bytes or DEFAULT_CHUNK_BYTES, IOV_MAX),
            b,
            p.ranges,
            p.mapping,
            Checks.of(p.header, p.path) if verify else None,
        )
        for p, b in zip(parts, bases, strict=True)
    ]


def run_parts(parts: Sequence[Part], bases: list[int], destination, *, threads: int | None, **options) -> None:
    """The reads of every part into ``destination`` (keyed as :func:`key_bases` says), one pipeline."""
    for p in parts:
        if p.ranges is None and p.mapping is None:  # a held mapping's owner advised its file once
            advise_sequential(p.fd)
    pipeline.run_sources(
        _sources(parts, bases, options.pop("chunk_bytes", None), options.pop("verify", None)),
        destination,
        threads=threads,
        **options,
    )


def load_parts(
    parts: Sequence[Part],
    sink,
    *,
    threads: int | None = None,
    chunk_bytes: int | None = None,
    per_tensor: bool = True,
    gpu_path: str = "auto",
    slot_bytes: int | None = None,
) -> list[dict[int, Any]]:
    """Read the rows of one or more open files into new tensors of ``sink``, as one load.

    Every file's reads go into one queue served by one set of reader threads (host
    destinations) or one chunk ring (devices): the shards of a checkpoint share them
    instead of each starting its own.  Host destinations are one allocation; device
    destinations one per tensor unless ``per_tensor=False``.  Returns, per part,
    row -> tensor.  Device loads: ``threads`` copy threads of the ring (default its
    geometry's), ``gpu_path`` and ``slot_bytes`` as in
    :func:`engine.loading.pipeline.run_sources`.

    Copies of tensor bytes: host destinations 1 (page cache to the tensor); device
    destinations 2 (page cache to a page-locked chunk, DMA).
    """
    bases = key_bases(parts)
    if all(p.ranges is None for p in parts):
        # the ring (a process's first, or one closed since) is set up while the tensors are
        # allocated: the load waits for it, not for both one after the other
        prepare_ring(sink, slot_bytes, threads)
    tensors, destination = _destination(sink, parts, bases, per_tensor)
    run_parts(parts, bases, destination, threads=threads, chunk_bytes=chunk_bytes, gpu_path=gpu_path,
              slot_bytes=slot_bytes)
    if len(parts) == 1:
        return [tensors]
    return [{r: tensors[b + r] for r in p.rows if b + r in tensors} for p, b in zip(parts, bases, strict=True)]


_DONE = object()


def sink_for(framework: str, device: Any = "cpu"):
    """:func:`engine.loading.sink_for`: the sink of a framework name, one not
    installed named as a :class:`~engine.errors.MissingDependencyError`.  Through this
    module's ``get_sink``, where a test puts an emulated device's sink."""
    return get_sink(framework, device)


def _need_kernels(stats: bool, quantize) -> None:
    """Statistics and int8 on the way need the Numba kernels: say so before a byte is read."""
    if not stats and quantize is None:
        return
    try:
        from engine.numerics import kernels  # noqa: F401
    except ModuleNotFoundError as exc:
        feature = "stream(stats=True)" if stats else "stream(quantize=...)"
        raise MissingDependencyError.of(exc, f"{feature} (the Numba kernels)") from None


def stream(
    path,
    *,
    framework: str = "pt",
    device: Any = "cpu",
    stats: bool = False,
    quantize=None,
    max_header_size: int = MAX_HEADER_SIZE,
    **options,
) -> Iterator[tuple]:
    """Yield ``(name, tensor)`` as each tensor of a file (or of several files) finishes loading.

    Parameters
    ----------
    path : str or os.PathLike, or a list of them
        One file, or the shards of a checkpoint: several files are read as one pipeline
        (one queue of reads, one device allocation), not one after the other.
    framework : {"pt", "torch", "np", "numpy"}
    device : str, int or torch.device, default "cpu"
        Destination device for torch (``"cuda:0"``, ``0``, any torch device); numpy is
        always "cpu".  The default is the reference's, so ``stream(path)`` works anywhere.
    names, patterns, predicate, layers
        Selection, see :func:`engine.planning.plan.select_rows`; by default every tensor.  Across
        several files a name or pattern must be found in at least one of them.
    threads : int, optional
        Native threads that split each batch of reads (CPU destinations) or copy threads of
        the chunk ring (GPU destinations): default every core, or the ring's geometry.  With ``stats=True`` on the CPU, the worker
        threads that read and fold (default one per core, 2 to 8).
    chunk_bytes : int, optional
        Bytes per read request (default 16 MiB).
    per_tensor : bool, default True
        On a GPU: one allocation per tensor from the framework's allocator, as the reference
        makes them.  ``False`` puts every tensor of the load in one allocation, each with a
        storage of its own over its range; torch's ``record_stream`` records nothing on such
        storages, so a consumer that reads them on a side stream keeps them until that work is done.
    stats : bool, default False
        Also compute each tensor's :class:`~engine.statistics.Stats` (needs Numba; one file
        only).  The reader threads read each piece in 256 KiB windows and summarise every
        window right after it lands, while it is still in the core's L2 cache, in one native call without
        the GIL; per-thread partial results merge when the tensor is complete.  There is no
        second pass over memory.  ``None`` for dtypes the kernel does not summarise (FP8,
        sub-byte, complex).  On a GPU, F64/F32/F16/BF16 tensors are summarised on the
        device instead, by CUDA kernels launched on each tensor as the chunk ring reports
        it landed, while the following chunks are copied (see :mod:`engine.loading.load_hooks`);
        other dtypes are folded on the CPU from the file as each is handed out.
    quantize : None, "int8" or engine.quantize.Int8, optional
        Quantize the selected tensors (default selection: F32/F16/BF16 weights of 2 or more
        dimensions, not embeddings; one scale per row) to symmetric int8 while loading,
        bit-identical to :func:`engine.quantize_int8`; each is yielded as a
        :class:`~engine.quantize.QuantizedTensor`.  On a GPU the quantization runs on the
        device as each tensor lands, and only a bounded window of source-dtype scratch is
        held there (:data:`engine.loading.load_hooks.STAGING_BYTES` plus at most twice the largest
        quantized tensor).
    gpu_path : {"auto", "copy"}, default "auto"
        GPU destinations: both copy through the native chunk ring (:mod:`engine.gpu.device_ring`;
        its geometry from ``ENGINE_RING``).  ``"register"`` was removed (see
        :mod:`engine.loading.pipeline`).
    slot_bytes : int, optional
        GPU destinations: bytes per page-locked chunk (default
        :func:`engine.gpu.geometry.default_geometry`).
    verify_checksums : bool, optional
        Check each tensor against the CRC-32C its file records (:mod:`engine.format.checksums`)
        before yielding it (default True; files without checksums do no checksum work).  A
        mismatch raises :class:`~engine.errors.ChecksumError`; the failed tensor is never
        yielded.
    check_finite : bool, default False
        Fail the load with :class:`~engine.errors.NonFiniteError` (naming the tensor and the
        NaN/+Inf/-Inf counts) on the first floating tensor holding NaN or Inf, before it is
        yielded.  The counts come from the statistics of ``stats=True`` (needs Numba; one
        file; local files): folded on the CPU as the bytes land, by the device kernels on a
        GPU.

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
    (page cache to a page-locked chunk, then DMA to the device).  ``stats=True`` adds no
    copy: the kernels read the bytes where they landed (on a GPU, the tensors the device
    does not summarise are read once more from the page cache, through a 4 MiB buffer);
    ``quantize="int8"`` on a GPU lands the source bytes in a device scratch buffer instead
    of a tensor, the same two copies.  Page-locked host memory of a GPU
    load: the ring's chunks (128 MiB by default, 256 MiB at most unless ``ENGINE_RING`` asks
    for more), whatever the model's size; unlocked a moment after the load ends (see
    :mod:`engine.loading.pipeline`).  Breaking out of the loop stops the
    readers, joins their threads, unlocks and releases everything, and closes the files.
    """
    unknown = set(options) - _STREAM_OPTIONS
    if unknown:  # as a signature would, at the call rather than at the first tensor
        raise TypeError(f"stream() got unexpected keyword arguments: {sorted(unknown)}")
    return _stream(path, framework, device, stats, quantize, max_header_size, options)


def _stream(path, framework, device, stats, quantize, max_header_size, options) -> Iterator[tuple]:
    many = not isinstance(path, (str, bytes, os.PathLike))
    paths = list(path) if many else [path]
    if (stats or quantize is not None) and len(paths) != 1:
        raise ValueError("stats=True and quantize= stream one file at a time")
    sink_for(framework, device)  # an unknown framework or device fails before a file is opened
    _need_kernels(stats, quantize)
    opened: list[tuple[int, str]] = []
    try:
        for p in paths:
            opened.append(open_file(p))
        files = [
            Part(fd, read_header_fd(fd, path=sp, file_size=os.fstat(fd).st_size, max_header_size=max_header_size),
                 [], sp)
            for fd, sp in opened
        ]
        # the selection and load options (names, patterns, threads, gpu_path, ...) as
        # stream_parts takes them
        yield from stream_parts(files, many=many, framework=framework, device=device, stats=stats,
                                quantize=quantize, **options)
    finally:
        for fd, _ in opened:
            os.close(fd)


def stream_parts(
    files: Sequence[Part],
    *,
    many: bool,
    framework: str = "pt",
    device: Any = "cpu",
    names: Iterable[str] | None = None,
    patterns: str | Iterable[str] | None = None,
    predicate: Callable[[str], bool] | None = None,
    layers=None,
    threads: int | None = None,
    chunk_bytes: int | None = None,
    per_tensor: bool = True,
    stats: bool = False,
    quantize=None,
    gpu_path: str = "auto",
    slot_bytes: int | None = None,
    cancel: threading.Event | None = None,
    verify_checksums: bool | None = None,
    check_finite: bool = False,
) -> Iterator[tuple]:
    """:func:`stream` over files whose headers are read (local and open, or remote with
    ``ranges``); the parts' ``rows`` are ignored, the selection chooses them.  ``many``:
    the files are the shards of one checkpoint (a name must be found in some file) rather
    than one file.  ``cancel`` is set when the load fails or ends (the readers' waits may
    watch it).  The caller closes the files after the generator is done."""
    if (stats or quantize is not None or check_finite) and len(files) != 1:
        raise ValueError("stats=True, check_finite=True and quantize= stream one file at a time")
    if (stats or check_finite) and any(f.ranges is not None for f in files):
        raise ValueError("stats=True and check_finite=True fold statistics while reading local files; load a "
                         "remote file, then call engine.stats on its tensors")
    sink = sink_for(framework, device)
    # check_finite: the statistics of every tensor, folded as it lands (CPU) or by the device
    # kernels after its copy (a GPU), and a tensor holding NaN or Inf fails the load
    yield_stats, stats = stats, stats or check_finite
    _need_kernels(stats, quantize)
    verify = verifying() if verify_checksums is None else bool(verify_checksums)
    cancel = cancel if cancel is not None else threading.Event()
    worker: threading.Thread | None = None
    hooks = None
    headers = [f.header for f in files]
    spaths = [f.path or "" for f in files]
    try:
        if many:
            selected = select_files(headers, spaths, names, patterns, predicate, layers)
        else:
            selected = [select_file(headers[0], spaths[0], names, patterns, predicate, layers)]
        parts = [f._replace(rows=rows) for f, rows in zip(files, selected, strict=True)]
        bases = key_bases(parts)
        where = {b + r: (i, r) for i, (p, b) in enumerate(zip(parts, bases, strict=True)) for r in p.rows}
        # statistics and quantization on the way (one file: its keys are its rows)
        hooks = None if many else onload_plan(
            headers[0], selected[0], sink, stats=stats, quantize=quantize, path=spaths[0]
        )
        if hooks is not None and sink.on_device:
            tensors, destination = hooks.destination(headers[0], selected[0], per_tensor)
        else:
            tensors, destination = _destination(sink, parts, bases, per_tensor)
        collector = None
        # a device load (the chunk ring): its copy threads are native, so no read hook; device
        # kernels are launched as tensors land, the CPU fold reads the file at hand-out
        ring = destination.on_device
        if stats:
            rows0 = selected[0] if hooks is None else hooks.host_stats_rows(selected[0])
            collector = StatsCollector(headers[0], rows0, spaths[0])

        def result(key):
            i, r = where[key]
            name = headers[i].table.names[r]
            tensor = tensors.get(key) if hooks is None else hooks.tensor(r, tensors.get(key))
            if getattr(sink, "moves", False):  # a torch device reached with .to() (mps, xpu, ...)
                tensor = sink.to_device(tensor)
            if collector is None:
                return name, tensor
            if hooks is not None and hooks.has_device_stats(r):
                found = hooks.stats(r)
            else:
                if ring:  # the ring's copy threads are native: the CPU fold reads the file at hand-out
                    t = headers[i].table
                    collector.fold_file(files[i].fd, headers[i].data_start + int(t.begins[r]),
                                        int(t.ends[r]) - int(t.begins[r]), r)
                found = collector.result(r)
            if check_finite:
                _finite_or_raise(found, name, dtypes.NAMES[int(headers[i].table.codes[r])], spaths[i])
            return (name, tensor, found) if yield_stats else (name, tensor)

        def landed(key):
            if hooks is not None:
                hooks.landed(where[key][1])
            done.put(key)

        # tensors with no bytes are complete before anything is read (their checksum, where
        # the file records one, must be that of no bytes)
        for key, (i, r) in where.items():
            t = headers[i].table
            if int(t.ends[r]) == int(t.begins[r]):
                if verify and (c := Checks.of(headers[i], spaths[i] or None)) is not None:
                    c.verify(r, 0)
                yield result(key)
        done: queue.SimpleQueue = queue.SimpleQueue()

        def work() -> None:
            try:
                run_parts(
                    parts, bases, destination, threads=threads, chunk_bytes=chunk_bytes,
                    on_complete=landed, cancel=cancel,
                    fill=collector.fill if collector is not None and not ring else None,
                    gpu_path=gpu_path, slot_bytes=slot_bytes,
                    verify=verify,
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
        if hooks is not None:
            hooks.close()


def _finite_or_raise(found, name: str, dtype: str, path: str) -> None:
    """Raise NonFiniteError for a floating tensor whose statistics count NaN or Inf."""
    if found is None or not dtype.startswith(("F", "BF")):  # integers and BOOL hold no NaN
        return
    bad = found.nan_count + found.posinf_count + found.neginf_count
    if bad:
        raise NonFiniteError(
            f"tensor {name!r} ({dtype}) holds {bad} non-finite value(s): {found.nan_count} NaN, "
            f"{found.posinf_count} +Inf, {found.neginf_count} -Inf",
            path=path or None, tensors=(name,), nan_count=found.nan_count, posinf_count=found.posinf_count,
            neginf_count=found.neginf_count)


_STREAM_OPTIONS = frozenset({"names", "patterns", "predicate", "layers", "threads", "chunk_bytes", "per_tensor",
                              "gpu_path", "slot_bytes", "verify_checksums", "check_finite"})


def load_file(path, sink, *, max_header_size: int = MAX_HEADER_SIZE, slot_bytes: int | None = None) -> dict[str, Any]:
    """Every tensor of one file as new tensors of ``sink`` (owned host memory or a device),
    by name in file order: the short path of ``engine.torch.load_file(f, device="cuda")``
    and of owned loads, with no handle in between.

    Copies of tensor bytes: host 1 (page cache to the tensor); a device 2 (page cache to a
    page-locked chunk, DMA).
    """
    fd, spath = open_file(path)
    try:
        header = read_header_fd(fd, path=spath, file_size=os.fstat(fd).st_size, max_header_size=max_header_size)
        rows = list(header.table.file_order())
        got = load_parts([Part(fd, header, rows, spath)], sink, slot_bytes=slot_bytes)[0]
    finally:
        os.close(fd)
    names = header.table.names
    if getattr(sink, "moves", False):  # a torch device reached with .to() (mps, xpu, ...)
        return {names[r]: sink.to_device(got[r]) for r in rows}
    return {names[r]: got[r] for r in rows}


def prepare_ring(sink, slot_bytes: int | None = None, threads: int | None = None, remote: bool = False) -> None:
    """Start setting up the ring a device load of ``sink`` will take, on a thread of its own
    (nothing for a CPU sink or a device the ring cannot drive): the load that follows waits
    for it rather than setting one up after its other preparations.  ``remote``: the ring of
    a load of remote files (whose ``threads`` are connections, not the ring's)."""
    ops = _ring_ops(sink)
    if ops is not None:
        g = geometry_for(slot_bytes) if remote else geometry_for(slot_bytes, threads)
        device_ring.prepare(ops, g, background=True, linger=True)


def _ring_ops(sink):
    """The copy ring's device operations of a CUDA sink, or None (a CPU sink, a device the
    ring cannot drive)."""
    ring_ops = getattr(sink, "ring_ops", None) if sink.on_device else None
    ops = ring_ops() if ring_ops is not None else None
    return ops if ops is not None and device_ring.supports(ops) else None


def prepare_device(device: Any = "cuda", *, framework: str = "pt", wait: bool = True) -> float | None:
    """Set up the engine's copy ring for a CUDA device ahead of the first load.

    A process's first load to a device otherwise sets the ring up itself: its copy threads,
    its events and its page-locked chunks (128 MiB by default, locked in a few calls).  An
    inference server can call this at start, while it does other work (``wait=False``), so
    that its first load starts copying at once.  The ring is kept until a load takes it;
    after that it lingers as after any load (see :func:`engine.keep_staging`).

    Parameters
    ----------
    device : str, int or torch.device, default "cuda"
        A CUDA device of ``framework``.
    framework : {"pt", "torch", "cupy"}, default "pt"
    wait : bool, default True
        Return once the ring is ready; with False the set-up runs on a thread of its own (a
        load that starts meanwhile waits for it, and never sets up a second ring).

    Returns
    -------
    float or None
        Seconds the page-locking took (0.0 when a ring was set up already); None with
        ``wait=False``.

    Raises
    ------
    ValueError
        ``device`` is not a CUDA device.
    DeviceError
        The CUDA runtime cannot be found, or the ring cannot be set up.
    """
    ops = _ring_ops(sink_for(framework, device))
    if ops is None:
        raise ValueError(f"prepare_device needs a CUDA device, not {device!r}")
    took = device_ring.prepare(ops, background=not wait)
    return None if took is None else took[0]


def load_finite(filename, framework: str, device, verify_checksums) -> dict:
    """The framework modules' ``load_file(check_finite=True)``: one :func:`stream` with the
    NaN/Inf check, its tensors returned in file order."""
    from engine.format.header import read_header

    got = dict(stream(filename, framework=framework, device=device, check_finite=True,
                      verify_checksums=verify_checksums))
    return {name: got[name] for name in read_header(filename).offset_keys()}
