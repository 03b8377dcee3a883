"""torch destination: tensors over a private mapping, or owned tensors, on CPU or CUDA."""

from __future__ import annotations

import functools

import numpy as np
import torch

from engine.base import dtypes
from engine.sinks._targets import FillTarget


class TorchSink:
    name = "torch"
    # torch tensors are writable, as the reference hands them out: a private (copy-on-write)
    # mapping lets callers write without touching the file
    mmap_access = "ACCESS_COPY"  # the name of an mmap constant, as on NumpySink

    def __init__(self, device="cpu") -> None:
        try:
            self.device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        except (RuntimeError, TypeError) as exc:
            from engine.errors import DeviceError

            raise DeviceError(f"invalid torch device {device!r}: {exc}") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            from engine.errors import DeviceError

            raise DeviceError(f"device {device!r} asked for, but torch sees no CUDA device")
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" is the caller's current device, asked here on the caller's thread: the
            # threads that allocate and copy later may have another current device (GPU 0)
            self.device = torch.device("cuda", torch.cuda.current_device())
        # CUDA loads stream through the chunk ring; any other torch device (mps,
        # xpu, meta, ...) gets the CPU tensors handed over with .to(), as the reference does
        self.on_device = self.device.type == "cuda"
        self.moves = self.device.type not in ("cpu", "cuda")

    def map(self, buffer):
        """The base that :meth:`view` cuts tensors from: the writable buffer itself."""
        return buffer

    def view(self, base, code: int, shape: tuple, offset: int, nbytes: int) -> torch.Tensor:
        if code in dtypes.SUB_BYTE_CODES:
            shape = dtypes.packed_shape(code, shape, nbytes)
        return host_tensor(base, code, shape, offset, nbytes)

    def allocate(self, specs, file_begins):
        """Owned CPU tensors for ``specs`` = [(row, code, shape, nbytes)], cut from one block.

        Each tensor has its own storage over its range of the block (see :func:`host_tensor`).
        Returns (row -> tensor, row -> writable byte memoryview).
        """
        from engine.sinks._host import host_block, pack_offsets  # owned loads only

        offsets, total = pack_offsets(specs, file_begins)
        block = host_block(total)
        whole = memoryview(block)
        tensors, views = {}, {}
        for (row, code, shape, nbytes), off in zip(specs, offsets, strict=True):
            tensors[row] = host_tensor(block, code, dtypes.packed_shape(code, shape, nbytes), off, nbytes)
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
        try:
            return t.to(self.device)
        except (RuntimeError, TypeError) as exc:
            from engine.errors import DeviceError

            raise DeviceError(f"cannot move a tensor to {self.device}: {exc}") from None

    def ring_ops(self):
        """The device operations the copy ring needs (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        return TorchCudaOps(self.device)

    def allocate_device(self, specs, per_tensor: bool = True):
        """(row -> device tensor, row -> uint8 target, DeviceOps) for a device load."""
        tensors, targets = allocate_device(specs, self.device, per_tensor)
        return tensors, targets, TorchCudaOps(self.device)


_INT64_MAX = 2**63 - 1


@functools.cache
def _from_numpy_dtypes() -> dict[int, tuple[np.dtype, torch.dtype | None]]:
    """code -> (numpy dtype, torch dtype to view the result as, or None) for every byte-sized
    dtype: its own numpy dtype where ``torch.from_numpy`` turns that into the code's torch
    dtype, else an unsigned integer of its width viewed as the torch dtype (BF16, FP8).
    Checked here, on this torch build; sub-byte dtypes are not in it."""
    out: dict[int, tuple[np.dtype, torch.dtype | None]] = {}
    for d in dtypes.DTYPES:
        if d.sub_byte:
            continue
        try:
            tdt = dtypes.torch_dtype(d.code)
        except Exception as exc:  # noqa: BLE001 - the engine's error is imported by the first one
            from engine.errors import SafetensorError

            if isinstance(exc, SafetensorError):  # this torch build has no such dtype
                continue
            raise
        own = dtypes.own_numpy_dtype(d.code)  # numpy's own dtype, never an ml_dtypes one
        try:
            if own is not None and torch.from_numpy(np.zeros(1, own)).dtype == tdt:
                out[d.code] = (own, None)
                continue
            width = np.dtype(f"<u{d.itemsize}")
            if torch.from_numpy(np.zeros(1, width)).view(tdt).dtype == tdt:
                out[d.code] = (width, tdt)
        except (TypeError, RuntimeError):  # no numpy twin of that width: frombuffer's way
            continue
    return out


def host_tensor(buffer, code: int, shape: tuple, offset: int, nbytes: int) -> torch.Tensor:
    """A tensor over ``nbytes`` of the writable ``buffer`` at ``offset``, with a storage of its own.

    The storage covers exactly the tensor's bytes and holds a reference to ``buffer``, so
    the memory lives until the last tensor cut from it goes.  Libraries that decide what
    to save, or what is shared, by storage (``storage_ptr``/``storage_size``, accelerate,
    ``torch.save``) then see each tensor alone, as with the reference.

    Copies of tensor bytes: 0; 1 when ``offset`` is not a multiple of the item size (a file
    laid out without alignment, which torch cannot view).

    Raises
    ------
    UnrepresentableTensorError
        A shape torch cannot hold (a dimension of 2**63 or more).
    """
    tdt = dtypes.torch_dtype(code)
    if shape and max(shape) > _INT64_MAX:
        from engine.errors import UnrepresentableTensorError

        raise UnrepresentableTensorError(
            f"shape {dtypes.shape_text(shape)} has a dimension of 2**63 or more, which torch cannot index",
            reason="UnrepresentableShape",
        )
    if not nbytes:
        # as the reference: an empty tensor reshaped, which torch allows for any shape of
        # zero elements (torch.empty(shape) would compute strides that overflow)
        try:
            return torch.empty(0, dtype=tdt).reshape(shape)
        except RuntimeError as exc:
            from engine.errors import UnrepresentableTensorError

            raise UnrepresentableTensorError(
                f"torch cannot build an empty tensor of shape {dtypes.shape_text(shape)}: {exc}", reason="UnrepresentableShape"
            ) from None
    itemsize = tdt.itemsize
    if offset % itemsize:
        out = torch.empty(shape, dtype=tdt)
        out.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset))
        return out
    twin = _from_numpy_dtypes().get(code)
    if twin is not None:
        # cheaper than frombuffer + reshape: a tensor already in its shape (one object, or
        # two for the dtypes numpy lacks), whose storage (from the array) covers exactly its bytes
        try:
            t = torch.from_numpy(np.ndarray(shape, twin[0], buffer=buffer, offset=offset))
        except ValueError:  # a shape numpy cannot hold (rank over 64): torch's own way below
            pass
        else:
            return t if twin[1] is None else t.view(twin[1])
    count = nbytes // itemsize
    flat = torch.frombuffer(buffer, dtype=tdt, count=count, offset=offset)
    if len(shape) == 1 and shape[0] == count:  # already the shape: no second tensor object
        return flat
    return flat.view(shape)


# -- CUDA destinations ---------------------------------------------------------------------------

#: Alignment of each tensor inside the one device allocation of a load (cudaMalloc's own).
DEVICE_ALIGNMENT = 256


def allocate_device(specs, device: torch.device, per_tensor: bool = True):
    """Device tensors for ``specs`` = [(row, code, shape, nbytes)] and their byte targets.

    By default each tensor is an allocation of torch's caching allocator, so that
    ``record_stream`` on it holds (a consumer copying on a side stream and dropping the
    tensors frees nothing that stream still reads).  ``per_tensor=False`` puts every tensor
    in one allocation, each at an offset aligned to :data:`DEVICE_ALIGNMENT` with a storage
    of its own over exactly its bytes (see :func:`own_storage`); torch's caching allocator
    does not own such storages, so ``record_stream`` on them records nothing.

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
    for (row, code, shape, nbytes), off in zip(specs, offsets, strict=True):
        shape = dtypes.packed_shape(code, shape, nbytes)
        tdt = dtypes.torch_dtype(code)
        if not nbytes:
            targets[row] = tensors[row] = torch.empty(0, dtype=tdt, device=device).reshape(shape)
            continue
        target = own_storage(block[off : off + nbytes])
        targets[row] = target
        tensors[row] = target.view(tdt).view(shape)
    return tensors, targets


def own_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` (a contiguous slice of a larger allocation) as a tensor with its own storage.

    The new storage covers exactly the view's bytes and keeps the whole allocation alive
    until the last tensor over it goes; made through DLPack, which any device supports.
    Copies: 0.
    """
    from torch.utils.dlpack import from_dlpack

    return from_dlpack(view.__dlpack__())


def fill_target(t: torch.Tensor):
    """``t`` as a destination of ``load_into`` (:class:`TorchTarget`)."""
    return TorchTarget(t)


# -- what a CUDA load and load_into need ---------------------------------------------------------


class TorchCudaOps:
    """The pipeline's device operations on torch CUDA (see :class:`engine.gpu.device_ring.DeviceOps`):
    every load to a CUDA tensor goes through the native chunk ring (:mod:`engine.gpu.device_ring`),
    which calls the CUDA runtime torch loaded, on a stream of its own.

    Made on the caller's thread, for one load: the device (``"cuda"`` without an index is the
    caller's current one) is resolved here, and a fence recorded on the caller's current
    stream, since both are per thread and the ring runs its calls on threads of its own.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._fence = _fence(device) if device.type == "cuda" else None

    def runtime_path(self) -> str | None:
        from engine.gpu.cudart import cuda_runtime_path

        return cuda_runtime_path(_cuda_major())

    @property
    def device_index(self) -> int:
        return self.device.index

    def consumer_fence(self) -> int | None:
        """The event recorded on the caller's current stream when these ops were made: the
        caching allocator's blocks and a ``load_into`` target's pending kernels are ordered
        on that stream."""
        return self._fence.cuda_event if self._fence is not None else None

    def fence_again(self) -> None:
        """Record the fence again, now, on the calling thread's current stream: the next ring
        run's copies then wait for the work queued there since (the last reads of scratch
        that the caching allocator may hand to them).  That stream first waits for the fence's
        last record, so that the new one still follows the consumer's stream where the fence
        began (``stream``'s windows run on a worker thread, whose current stream is another)."""
        if self._fence is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self._fence)
            self._fence.record(current)

    def address(self, target: torch.Tensor) -> int:
        return target.data_ptr()


def _fence(device: torch.device):
    """An event recorded now on the calling thread's current stream of ``device``."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _cuda_major() -> int | None:
    """The CUDA major torch was built with (``torch.version.cuda``), or None."""
    version = getattr(torch.version, "cuda", None) or ""
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else None


class TorchTarget(FillTarget):
    """A torch tensor that a load fills in place: on the CPU through a byte view of its
    memory, on CUDA through the chunk ring (:class:`TorchCudaOps`)."""

    def __init__(self, t: torch.Tensor) -> None:
        super().__init__(t, dtypes.from_torch(t.dtype), tuple(t.shape), t.is_contiguous(), t.device.type)
        self.device = None if t.device.type == "cpu" else t.device

    def host_bytes(self) -> memoryview:
        return memoryview(self.tensor.detach().reshape(-1).view(torch.uint8).numpy())

    def device_bytes(self) -> torch.Tensor:
        return self.tensor.detach().reshape(-1).view(torch.uint8)

    def device_ops(self) -> TorchCudaOps | None:
        return TorchCudaOps(self.device) if self.where == "cuda" else None
