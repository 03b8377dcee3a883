"""What a load fills through the torch sink: the device operations of a CUDA load and the
destinations of ``load_into``.  Apart from :mod:`engine.sinks.torch` so that opening a
file and handing out CPU tensors never imports the staging and fill-target machinery."""

from __future__ import annotations

import torch

from engine.base import dtypes
from engine.sinks._staging import HostSource, PinnedHostOps
from engine.sinks._targets import FillTarget

__all__ = ["TorchCudaOps", "TorchTarget"]


class TorchCudaOps(PinnedHostOps):
    """The pipeline's device operations on torch CUDA (see :class:`engine.loading.pipeline.DeviceOps`).

    Plain loads go through the native chunk ring (:mod:`engine.gpu.device_ring`), which calls the
    CUDA runtime torch loaded on a stream of its own.  On the slot path, staging slots are
    anonymous memory page-locked by the engine (unlocked when the load frees them) and
    copies are ``Tensor.copy_(..., non_blocking=True)`` on the path's stream:
    ``cudaMemcpyAsync`` from page-locked memory.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.staging_key = ("torch", str(device))  # slots may be kept between loads (keep_staging)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    # -- what the native chunk ring needs (engine.gpu.device_ring) --------------------------------

    def runtime_path(self) -> str | None:
        from engine.sinks import _cudart

        return _cudart.runtime_path()

    @property
    def device_index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def ring_stream(self):
        """A stream of the load's own on the device: ``(cudaStream_t, the torch object)``."""
        stream = torch.cuda.Stream(device=self.device)
        return stream.cuda_stream, stream

    def address(self, target: torch.Tensor) -> int:
        return target.data_ptr()

    def alloc_staging(self, nbytes: int):
        from engine.sinks import _cudart  # CUDA loads only: CPU tensors never need the runtime's bindings

        block = _cudart.PinnedBlock(nbytes)
        if not block.locked:  # page-locking refused: torch's pinned memory (cached by torch)
            slot = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            return HostSource(slot, slot.data_ptr()), memoryview(slot.numpy())
        tensor = torch.frombuffer(block.view, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        return HostSource(tensor, block.addr, block), block.view

    def new_stream(self):
        return torch.cuda.Stream(device=self.device)

    def copy_to_device(self, dst, dst_offset: int, src: HostSource, src_offset: int, nbytes: int, stream) -> None:
        with torch.cuda.stream(stream):
            dst[dst_offset : dst_offset + nbytes].copy_(src.buffer[src_offset : src_offset + nbytes], non_blocking=True)

    def record(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, event) -> None:
        event.synchronize()


class TorchTarget(FillTarget):
    """A torch tensor that a load fills in place: on the CPU through a byte view of its
    memory, on CUDA through the pinned staging ring (:class:`TorchCudaOps`)."""

    def __init__(self, t: torch.Tensor) -> None:
        super().__init__(t, dtypes.from_torch(t.dtype), tuple(t.shape), t.is_contiguous(), t.device.type)
        self.device = None if t.device.type == "cpu" else t.device

    def host_bytes(self) -> memoryview:
        return memoryview(self.tensor.detach().reshape(-1).view(torch.uint8).numpy())

    def device_bytes(self) -> torch.Tensor:
        return self.tensor.detach().reshape(-1).view(torch.uint8)

    def device_ops(self) -> TorchCudaOps | None:
        return TorchCudaOps(self.device) if self.where == "cuda" else None
