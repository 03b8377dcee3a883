"""torch destination: tensors over a private mapping, or owned tensors, on CPU or CUDA."""

from __future__ import annotations

import mmap
import warnings

import torch

from .. import dtypes
from ..errors import DeviceError
from . import _cudart


def _contiguous_strides(shape: tuple) -> tuple:
    strides = []
    step = 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


class TorchSink:
    name = "torch"
    # torch tensors are writable, as the reference hands them out: a private (copy-on-write)
    # mapping lets callers write without touching the file
    mmap_access = mmap.ACCESS_COPY

    def __init__(self, device="cpu") -> None:
        try:
            self.device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        except (RuntimeError, TypeError) as exc:
            raise DeviceError(f"invalid torch device {device!r}: {exc}") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise DeviceError(f"device {device!r} asked for, but torch sees no CUDA device")
        if self.device.type not in ("cpu", "cuda"):
            raise DeviceError(f"device {device!r}: the engine loads torch tensors to 'cpu' or 'cuda' only")
        self.on_device = self.device.type != "cpu"

    def map(self, buffer):
        """Views over a writable buffer (a private mapping of the file, or owned bytes)."""
        return _MappedStorage(torch.frombuffer(buffer, dtype=torch.uint8))

    def view(self, base: "_MappedStorage", code: int, shape: tuple, offset: int, nbytes: int) -> torch.Tensor:
        return base.view(code, dtypes.packed_shape(code, shape, nbytes), offset, nbytes)

    def allocate(self, specs, file_begins):
        """Owned CPU tensors for ``specs`` = [(row, code, shape, nbytes)], views of one block.

        Returns (row -> tensor, row -> writable byte memoryview).
        """
        from . import host_block, pack_offsets

        offsets, total = pack_offsets(specs, file_begins)
        block = host_block(total)
        base = self.map(block)
        whole = memoryview(block)
        tensors, views = {}, {}
        for (row, code, shape, nbytes), off in zip(specs, offsets):
            tensors[row] = base.view(code, dtypes.packed_shape(code, shape, nbytes), off, nbytes)
            if nbytes:
                views[row] = whole[off : off + nbytes]
        return tensors, views

    def empty(self, code: int, shape: tuple, nbytes: int) -> torch.Tensor:
        return torch.empty(dtypes.packed_shape(code, shape, nbytes), dtype=dtypes.torch_dtype(code))

    @staticmethod
    def raw(t: torch.Tensor) -> memoryview:
        """Writable byte view of an owned contiguous CPU tensor (no copy)."""
        if t.numel() == 0:
            return memoryview(bytearray())
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())

    @staticmethod
    def finish(t, flip: tuple, result_shape: tuple):
        if flip:
            t = torch.flip(t, flip)  # torch has no negative strides: this copies
        return t.reshape(result_shape)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.to(self.device)

    def allocate_device(self, specs, per_tensor: bool = False):
        """(row -> device tensor, row -> uint8 target, DeviceOps) for a device load."""
        tensors, targets = allocate_device(specs, self.device, per_tensor)
        return tensors, targets, TorchCudaOps(self.device)


class _MappedStorage:
    """One uint8 tensor over the whole mapping plus lazily made per-dtype views of it.

    Tensors are cut from the per-dtype view with ``as_strided``, one torch call per tensor,
    which keeps opening files of many small tensors cheap.
    """

    def __init__(self, u8: torch.Tensor) -> None:
        self.u8 = u8
        self.storage = u8.untyped_storage()
        self.typed: dict = {}

    def view(self, code: int, shape: tuple, offset: int, nbytes: int) -> torch.Tensor:
        tdt = dtypes.torch_dtype(code)
        itemsize = tdt.itemsize
        if offset % itemsize:
            # a file laid out without alignment: torch cannot view it, so copy (1 copy)
            out = torch.empty(shape, dtype=tdt)
            if nbytes:
                out.reshape(-1).view(torch.uint8).copy_(self.u8[offset : offset + nbytes])
            return out
        typed = self.typed.get(code)
        if typed is None:
            typed = torch.empty(0, dtype=tdt).set_(self.storage, 0, (len(self.u8) // itemsize,), (1,))
            self.typed[code] = typed
        return typed.as_strided(shape, _contiguous_strides(shape), offset // itemsize)


# -- CUDA destinations ---------------------------------------------------------------------------

#: Alignment of each tensor inside the one device allocation of a load (cudaMalloc's own).
DEVICE_ALIGNMENT = 256





class _HostSource:
    """A host buffer the device copies from: a uint8 tensor over it and its address."""

    __slots__ = ("tensor", "addr", "block")

    def __init__(self, tensor: torch.Tensor, addr: int, block=None) -> None:
        self.tensor = tensor
        self.addr = addr
        self.block = block


class TorchCudaOps:
    """The pipeline's device operations on torch CUDA (see :class:`engine.pipeline.DeviceOps`).

    Staging slots are anonymous memory page-locked by the engine (unlocked when the load
    frees them); file mappings are page-locked read-only, range by range, through the CUDA
    runtime that torch loaded (:mod:`engine.sinks._cudart`).  Copies are
    ``Tensor.copy_(..., non_blocking=True)`` on the path's stream: ``cudaMemcpyAsync`` from
    page-locked memory.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def alloc_staging(self, nbytes: int):
        block = _cudart.PinnedBlock(nbytes)
        if not block.locked:  # page-locking refused: torch's pinned memory (cached by torch)
            slot = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            return _HostSource(slot, slot.data_ptr()), memoryview(slot.numpy())
        tensor = torch.frombuffer(block.view, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        return _HostSource(tensor, block.addr, block), block.view

    def free_staging(self, handle: _HostSource) -> None:
        if handle.block is not None:
            handle.block.release()

    def wrap_host(self, view: memoryview) -> _HostSource:
        with warnings.catch_warnings():
            # the mapping is read-only and torch warns so; the device only ever reads it
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(view, dtype=torch.uint8)
        return _HostSource(tensor, tensor.data_ptr())

    def register(self, handle: _HostSource, offset: int, nbytes: int) -> bool:
        rt = _cudart.runtime()
        return rt is not None and rt.host_register(handle.addr + offset, nbytes, _cudart.HOST_REGISTER_READ_ONLY) == 0

    def unregister(self, handle: _HostSource, offset: int, nbytes: int) -> None:
        rt = _cudart.runtime()
        if rt is not None:
            rt.host_unregister(handle.addr + offset)

    def new_stream(self):
        return torch.cuda.Stream(device=self.device)

    def copy_to_device(self, dst, dst_offset: int, src: _HostSource, src_offset: int, nbytes: int, stream) -> None:
        with torch.cuda.stream(stream):
            dst[dst_offset : dst_offset + nbytes].copy_(src.tensor[src_offset : src_offset + nbytes], non_blocking=True)

    def record(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, event) -> None:
        event.synchronize()


def allocate_device(specs, device: torch.device, per_tensor: bool = False):
    """Device tensors for ``specs`` = [(row, code, shape, nbytes)] and their byte targets.

    By default one allocation holds every tensor, each at an offset aligned to
    :data:`DEVICE_ALIGNMENT`; ``per_tensor=True`` makes one allocation per tensor.

    Returns
    -------
    (dict row -> tensor, dict row -> uint8 device tensor that receives its bytes)
    """
    tensors, targets = {}, {}
    if per_tensor:
        for row, code, shape, nbytes in specs:
            t = torch.empty(dtypes.packed_shape(code, shape, nbytes), dtype=dtypes.torch_dtype(code), device=device)
            tensors[row] = t
            targets[row] = t.reshape(-1).view(torch.uint8) if nbytes else t
        return tensors, targets
    offsets, total = [], 0
    for _, _, _, nbytes in specs:
        offsets.append(total)
        total += -(-nbytes // DEVICE_ALIGNMENT) * DEVICE_ALIGNMENT
    block = torch.empty(total, dtype=torch.uint8, device=device)
    for (row, code, shape, nbytes), off in zip(specs, offsets):
        target = block[off : off + nbytes]
        targets[row] = target
        shape = dtypes.packed_shape(code, shape, nbytes)
        tensors[row] = target.view(dtypes.torch_dtype(code)).view(shape) if nbytes else torch.empty(
            shape, dtype=dtypes.torch_dtype(code), device=device
        )
    return tensors, targets
