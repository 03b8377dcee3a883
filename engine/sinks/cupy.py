"""CuPy destination: arrays in CUDA memory, filled through the chunk ring."""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from engine.base import dtypes
from engine.errors import DeviceError, MissingDependencyError
from engine.sinks._targets import FillTarget
from engine.sinks.numpy import NumpySink

try:
    import cupy
except ImportError:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("cupy", "cupy", "CuPy arrays") from None

#: Alignment of each array inside the one device allocation of a load.
DEVICE_ALIGNMENT = 256


def _device_id(device) -> int:
    if isinstance(device, int):
        return device
    text = str(device)
    if text == "cuda":
        return cupy.cuda.runtime.getDevice()
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise DeviceError(f"invalid CuPy device {device!r}; expected 'cuda', 'cuda:N' or an int")


_RAW_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _runtime_path() -> str | None:
    """The CUDA runtime the ring calls in this process (:func:`engine.gpu.cudart.cuda_runtime_path`
    for CuPy's CUDA major; the driver where no runtime is mapped, as with CuPy's static one)."""
    from engine.gpu.cudart import cuda_runtime_path

    try:
        major = int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
    except Exception:  # noqa: BLE001 - a CuPy without a runtime: no preference
        major = None
    return cuda_runtime_path(major)


@functools.cache
def _pusher():
    """The runtime whose driver calls push a device's primary context (looked up once: with
    no runtime mapped, each lookup reads ``/proc/self/maps``), or None where there is none."""
    from engine.gpu.cudart import runtime

    path = _runtime_path()
    return runtime(path) if path else None


@contextlib.contextmanager
def _on(device_id: int):
    """CuPy's ``Device`` guard for ``device_id``, entered with that device's primary context
    pushed on this thread first (and popped after): the guard keeps the current device on entry
    and sets it back on exit, and on a thread with no context current (one that never used
    CUDA) that is device 0, whose context setting it makes."""
    from engine.gpu.cudart import on_device

    rt = _pusher()
    with contextlib.ExitStack() as stack:
        if rt is not None:
            stack.enter_context(on_device(rt, device_id))
        stack.enter_context(cupy.cuda.Device(device_id))
        yield


def cupy_dtype(code: int) -> np.dtype:
    """The dtype CuPy arrays get: CuPy has no BF16 or FP8, so those come back as their raw
    bits in an unsigned integer of the same width (documented in the README)."""
    dt = dtypes.numpy_dtype(code)
    try:
        cupy.dtype(dt)
        return dt
    except TypeError:
        return np.dtype(_RAW_BITS[dt.itemsize])


class CupyOps:
    """The pipeline's device operations on CuPy (see :class:`engine.gpu.device_ring.DeviceOps`):
    the chunk ring as torch has it."""

    def __init__(self, device_id: int) -> None:
        self.device = cupy.cuda.Device(device_id)
        # a fence on the caller's current stream, recorded on the caller's thread (CuPy's
        # current stream is per thread and per device, and with per-thread default streams
        # its handle means "the calling thread's"): the load's copies wait for it
        with _on(device_id):
            self._fence = cupy.cuda.Event(disable_timing=True)
            self._fence.record(cupy.cuda.get_current_stream())

    def runtime_path(self) -> str | None:
        return _runtime_path()

    def consumer_fence(self) -> int | None:
        """The event recorded on the caller's current stream when these ops were made."""
        return int(self._fence.ptr)

    def fence_again(self) -> None:
        """Record the fence again, now, on the calling thread's current stream (see
        :meth:`engine.sinks.torch.TorchCudaOps.fence_again`)."""
        with _on(self.device.id):
            current = cupy.cuda.get_current_stream()
            current.wait_event(self._fence)
            self._fence.record(current)

    @property
    def device_index(self) -> int:
        return int(self.device.id)

    def address(self, target) -> int:
        return int(target.data.ptr)


class CupySink(NumpySink):
    """Host-side work as numpy (mapping views, owned blocks); results moved to the GPU."""

    name = "cupy"
    on_device = True

    def __init__(self, device="cuda") -> None:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise DeviceError("CuPy sees no CUDA device")
        self.device_id = _device_id(device)

    def to_device(self, arr):
        code = dtypes.from_numpy(arr.dtype) if arr.dtype != np.uint8 else dtypes.BY_NAME["U8"].code
        with _on(self.device_id):
            return cupy.asarray(arr.view(cupy_dtype(code)))

    def ring_ops(self) -> CupyOps:
        """The device operations the copy ring needs."""
        return CupyOps(self.device_id)

    def allocate_device(self, specs, per_tensor: bool = True):
        """(row -> cupy array, row -> uint8 target array, CupyOps) for a device load."""
        tensors, targets = {}, {}
        with _on(self.device_id):
            if per_tensor:
                for row, code, shape, nbytes in specs:
                    arr = cupy.empty(dtypes.packed_shape(code, shape, nbytes), cupy_dtype(code))
                    tensors[row], targets[row] = arr, arr.reshape(-1).view(cupy.uint8)
            else:
                offsets, total = [], 0
                for _, _, _, nbytes in specs:
                    offsets.append(total)
                    total += -(-nbytes // DEVICE_ALIGNMENT) * DEVICE_ALIGNMENT
                block = cupy.empty(max(total, 1), cupy.uint8)
                for (row, code, shape, nbytes), off in zip(specs, offsets, strict=False):
                    target = block[off : off + nbytes]
                    targets[row] = target
                    tensors[row] = target.view(cupy_dtype(code)).reshape(
                        dtypes.packed_shape(code, shape, nbytes)
                    )
        return tensors, targets, CupyOps(self.device_id)


class CupyTarget(FillTarget):
    """A CuPy array that a load fills in place through the chunk ring
    (:class:`CupyOps`).  BF16 and FP8 arrive as their raw bits, as :func:`cupy_dtype` says."""

    def __init__(self, arr) -> None:
        code = dtypes.BY_NAME["U8"].code if arr.dtype == np.uint8 else dtypes.from_numpy(arr.dtype)
        super().__init__(arr, code, arr.shape, bool(arr.flags.c_contiguous), "cuda")
        self.device = ("cupy", arr.device.id)

    def accepts(self, code: int) -> bool:
        return code == self.code or cupy_dtype(code) == self.tensor.dtype

    def device_bytes(self):
        return self.tensor.reshape(-1).view(cupy.uint8)

    def device_ops(self) -> CupyOps:
        return CupyOps(self.device[1])


def fill_target(arr) -> CupyTarget:
    """``arr`` as a destination of ``load_into`` (see :class:`engine.sinks._targets.FillTarget`)."""
    return CupyTarget(arr)
