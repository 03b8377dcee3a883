"""What a load fills through the torch sink: the device operations of a CUDA load and the
destinations of ``load_into``.  Apart from :mod:`engine.sinks.torch` so that opening a
file and handing out CPU tensors never imports the device operations and fill targets."""

from __future__ import annotations

import torch

from engine.base import dtypes
from engine.sinks._targets import FillTarget

__all__ = ["TorchCudaOps", "TorchTarget"]


class TorchCudaOps:
    """The pipeline's device operations on torch CUDA (see :class:`engine.gpu.device_ring.DeviceOps`):
    every load to a CUDA tensor goes through the native chunk ring (:mod:`engine.gpu.device_ring`),
    which calls the CUDA runtime torch loaded, on a stream of its own.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def runtime_path(self) -> str | None:
        from engine.gpu.device_ring import cuda_runtime_path

        return cuda_runtime_path()

    @property
    def device_index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def ring_stream(self):
        """A stream of the load's own on the device: ``(cudaStream_t, the torch object)``."""
        stream = torch.cuda.Stream(device=self.device)
        return stream.cuda_stream, stream

    def address(self, target: torch.Tensor) -> int:
        return target.data_ptr()


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
