"""Tensors as the writer sees them: a numpy array or a torch tensor (on any device) turned
into its format dtype, logical shape and little-endian bytes, handed out in bounded slices
(byte-swapped on big-endian hosts, copied to the host from a device), and the check that no
two tensors given share memory.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from engine.base.dtypes import BY_NAME, from_numpy, from_torch
from engine.errors import DeviceError, SerializationError, SharedTensorsError

__all__ = ["Raw", "tensor_bytes", "host_chunks", "check_shared"]

_F4 = BY_NAME["F4"].code


class Raw(NamedTuple):
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


def tensor_bytes(name: str, x: Any) -> Raw:
    """The one place that turns a numpy array or torch tensor into a :class:`Raw`."""
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


def _raw_numpy(name: str, a: np.ndarray) -> Raw:
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
    return Raw(code, tuple(a.shape), a.nbytes, None, host_chunks(view, swap), view if swap == 1 else None)


def _raw_torch(name: str, t: Any, torch: Any) -> Raw:
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
        return Raw(code, shape, 0, None, host_chunks(empty, 1), empty)
    t = t.detach()
    if t.is_conj() or t.is_neg():
        # A lazy conjugate/negation bit is not in memory: write the resolved values, copied
        # only when this tensor's turn comes.
        def resolved(limit: int) -> Iterator[memoryview]:
            return _raw_torch(name, t.resolve_conj().resolve_neg(), torch).chunks(limit)

        return Raw(code, shape, nbytes, span, resolved)
    swap = _swap_unit(t.element_size(), t.is_complex()) if sys.byteorder == "big" else 1
    # as_strided, not reshape: a contiguous tensor may carry any stride on a dimension of
    # size 1, which view(uint8) refuses.
    flat = t.as_strided((t.numel(),), (1,)).view(torch.uint8)
    if t.device.type == "cpu":
        view = memoryview(flat.numpy())
        return Raw(code, shape, nbytes, span, host_chunks(view, swap), view if swap == 1 else None)
    return Raw(code, shape, nbytes, span, _device_chunks(flat, swap, torch))


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


def host_chunks(view: memoryview, swap: int) -> Callable[[int], Iterator[memoryview]]:
    """``chunks(limit)`` over host memory ``view``: slices of at most ``limit`` bytes, byte-swapped by ``swap``-byte units."""
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


def check_shared(items: list[tuple[str, Raw]]) -> None:
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
