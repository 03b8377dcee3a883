"""Loads into existing tensors: ``load_into`` and its shards' form, ``fill_parts``.

Every destination is checked against the file's dtype, shape and layout
(:func:`check_destination`) before a byte is read; the reads then go straight into the
destinations' memory through the pipeline (host threads or, for CUDA destinations, the chunk
ring), one load per device.  A failed load says which destinations were filled before it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.base import dtypes
from engine.errors import DeviceError, SafetensorError, TensorMismatchError, TensorNotFoundError
from engine.format.header import MAX_HEADER_SIZE, read_header_fd
from engine.loading import pipeline
from engine.loading.loader import Part, key_bases, open_file, run_parts
from engine.sinks import fill_target

__all__ = ["load_into", "fill_parts", "check_destination"]


def load_into(
    path,
    tensors: Mapping[str, Any],
    *,
    strict: bool = False,
    threads: int | None = None,
    chunk_bytes: int | None = None,
    max_header_size: int = MAX_HEADER_SIZE,
    gpu_path: str = "auto",
) -> list[str]:
    """Fill existing tensors in place from a file (a model's parameters, on CPU or CUDA).

    Parameters
    ----------
    path : str or os.PathLike
    tensors : mapping of str to numpy.ndarray, torch.Tensor or cupy.ndarray
        Destinations, contiguous and writable, with the file's shapes and dtypes (for
        sub-byte dtypes: ``uint8`` of the packed shape).
    strict : bool, default False
        Also fail when the file holds tensors that ``tensors`` does not name.
    gpu_path : {"auto", "copy"}, default "auto"
        CUDA destinations: see :func:`engine.loading.loader.stream`.

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
    allocation); CUDA destinations 2 (page cache to a page-locked chunk, then DMA).
    """
    fd, spath = open_file(path)
    try:
        header = read_header_fd(fd, path=spath, file_size=os.fstat(fd).st_size, max_header_size=max_header_size)
        return fill_parts(
            [Part(fd, header, [], spath)], tensors, strict=strict, threads=threads, chunk_bytes=chunk_bytes,
            gpu_path=gpu_path,
        )
    finally:
        os.close(fd)


def check_destination(target, table, row: int, path: str | None) -> None:
    """Raise :class:`~engine.errors.TensorMismatchError` unless ``target`` (a
    :func:`engine.sinks.fill_target`) can take row ``row`` of ``table`` whole: the file's dtype
    (sub-byte: its packed bytes as ``uint8``, or the framework's own packed dtype) and shape,
    contiguous and writable."""
    name = table.names[row]
    nbytes = int(table.ends[row]) - int(table.begins[row])
    want_code = int(table.codes[row])
    want_shape = dtypes.packed_shape(want_code, table.shapes[row], nbytes)
    if dtypes.DTYPES[want_code].sub_byte and not target.accepts(want_code):
        want_code = dtypes.BY_NAME["U8"].code
    if not target.accepts(want_code) or target.shape != tuple(want_shape):
        raise TensorMismatchError(
            f"tensor {name!r}: the file has {dtypes.NAMES[int(table.codes[row])]}{list(table.shapes[row])}, "
            f"the destination is {dtypes.NAMES[target.code]}{list(target.shape)}",
            path=path,
            tensors=(name,),
        )
    if not target.ok_layout:
        raise TensorMismatchError(
            f"tensor {name!r}: the destination must be contiguous and writable", path=path, tensors=(name,)
        )


def fill_parts(
    files: Sequence[Part],
    tensors: Mapping[str, Any],
    *,
    strict: bool = False,
    threads: int | None = None,
    chunk_bytes: int | None = None,
    gpu_path: str = "auto",
    source: str | None = None,
    cancel: threading.Event | None = None,
) -> list[str]:
    """:func:`load_into` over one or more open files (a checkpoint's shards) as one load.
    ``cancel`` is set as soon as a read fails (the other readers' waits may watch it).

    The parts' ``rows`` are ignored: the rows are those ``tensors`` names.  A name is looked
    up in the files in order.  Every destination is checked before anything is read.
    ``source`` names the whole (a checkpoint directory) in errors about several files.
    Returns the names filled, file by file, in file order within each.
    """
    where = source if source is not None or len(files) != 1 else files[0].path
    found: dict[str, tuple[int, int]] = {}
    for name in tensors:
        for i, f in enumerate(files):
            row = f.header.table.index.get(name)
            if row is not None:
                found[name] = (i, row)
                break
    missing = [n for n in tensors if n not in found]
    if missing:
        raise TensorNotFoundError(
            f"{len(missing)} destination tensor(s) not in the file: {missing[:5]}", path=where, tensors=missing
        )
    if strict:
        extra = [n for f in files for n in f.header.table.names if n not in tensors]
        if extra:
            raise TensorNotFoundError(
                f"{len(extra)} tensor(s) of the file have no destination: {extra[:5]}", path=where, tensors=extra
            )
    host: list[list[int]] = [[] for _ in files]
    empty: list[str] = []  # destinations of 0 bytes
    device: dict[Any, list[list[int]]] = {}
    fill: dict[str, Any] = {}  # name -> engine.sinks fill target
    ops: dict[Any, Any] = {}
    for name, dst in tensors.items():
        i, row = found[name]
        f = files[i]
        t = f.header.table
        target = fill[name] = fill_target(dst)
        if target.device is not None and target.device not in ops:
            ops[target.device] = target.device_ops()
        if target.device is not None and ops[target.device] is None:
            raise DeviceError(
                f"tensor {name!r}: load_into fills CPU or CUDA memory, and the destination is on {target.where!r}",
                reason="UnsupportedDevice", path=f.path, tensors=(name,),
            )
        check_destination(target, t, row, f.path)
        if int(t.ends[row]) == int(t.begins[row]):
            empty.append(name)  # filled before anything is read
        rows = device.setdefault(target.device, [[] for _ in files]) if target.device is not None else host
        rows[i].append(row)

    def parts_of(rows: list[list[int]]) -> list[Part]:
        out = []
        for f, r in zip(files, rows, strict=True):
            begins = f.header.table.begins
            out.append(Part(f.fd, f.header, sorted(r, key=lambda x: int(begins[x])), f.path, f.ranges))
        return out

    def targets(parts: list[Part], bases: list[int], on_device: bool) -> dict[int, Any]:
        out = {}
        for p, b in zip(parts, bases, strict=True):
            t = p.header.table
            for r in p.rows:
                if int(t.ends[r]) > int(t.begins[r]):
                    target = fill[t.names[r]]
                    out[b + r] = target.device_bytes() if on_device else target.host_bytes()
        return out

    filled = list(empty)

    def tracked(parts: list[Part], bases: list[int]) -> Callable[[int], None]:
        keys = {b + r: p.header.table.names[r] for p, b in zip(parts, bases, strict=True) for r in p.rows}
        return lambda key: filled.append(keys[key])

    options: dict[str, Any] = {"threads": threads, "chunk_bytes": chunk_bytes, "cancel": cancel}
    try:
        if any(host):
            parts = parts_of(host)
            bases = key_bases(parts)
            run_parts(parts, bases, pipeline.Destination(host_views=targets(parts, bases, False)),
                      on_complete=tracked(parts, bases), **options)
        for dev, rows in device.items():
            parts = parts_of(rows)
            bases = key_bases(parts)
            dest = pipeline.Destination(device_targets=targets(parts, bases, True), device_ops=ops[dev])
            run_parts(parts, bases, dest, gpu_path=gpu_path, on_complete=tracked(parts, bases), **options)
    except SafetensorError as err:
        # the caller must be able to tell complete destinations from partly written ones
        err.filled = sorted(filled)  # type: ignore[attr-defined]
        note = f" ({len(filled)} of {len(tensors)} destinations were filled before the failure: see .filled)"
        err.message = f"{err.message}{note}"
        err.args = (err.message,)
        raise
    wanted: list[set[int]] = [set() for _ in files]
    for i, row in found.values():
        wanted[i].add(row)
    return [f.header.table.names[r] for f, w in zip(files, wanted, strict=True) for r in f.header.table.file_order()
            if r in w]
