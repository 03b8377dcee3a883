"""What the torch and CuPy device operations share: the host buffers the slot path's device
copies read (:mod:`engine.gpu.device_load`), page-locked through the CUDA runtime
(:mod:`engine.sinks._cudart`).  Each framework's ops add only what differs: how a slot is
allocated where locking is refused, how a stream, an event and an asynchronous copy are
spelled."""

from __future__ import annotations


class HostSource:
    """A host buffer the device copies from: the framework's object over it (a uint8
    tensor, a memoryview, CuPy's pinned memory), its address, and the engine's page-locked
    block when the engine allocated it."""

    __slots__ = ("buffer", "addr", "block")

    def __init__(self, buffer, addr: int, block=None) -> None:
        self.buffer = buffer
        self.addr = addr
        self.block = block


class PinnedHostOps:
    """The part of :class:`engine.loading.pipeline.DeviceOps` that is the same for every framework."""

    def free_staging(self, handle: HostSource) -> None:
        if handle.block is not None:
            handle.block.release()
