"""Existing tensors that a load fills in place (``load_into``), as the loader sees them:
dtype code, shape, layout, where the memory is, the bytes to fill and, on a device, the
operations that copy into it.  numpy arrays are described here; each framework's tensors
by its own module (:func:`engine.sinks.torch.fill_target`, :func:`engine.sinks.cupy.fill_target`);
:func:`engine.sinks.fill_target` picks one.
"""

from __future__ import annotations

from typing import Any


class FillTarget:
    """One destination of ``load_into``.

    Attributes
    ----------
    code : int
        Its dtype's code (:mod:`engine.base.dtypes`).
    shape : tuple
    ok_layout : bool
        Contiguous and writable.
    where : str
        The kind of memory it is in, for messages (``"cpu"``, ``"cuda"``, ``"mps"`` ...).
    device : hashable or None
        None for host memory; else one key per device, the destinations of one key being
        filled by one device load.
    """

    device: Any = None

    def __init__(self, tensor, code: int, shape: tuple, ok_layout: bool, where: str = "cpu") -> None:
        self.tensor = tensor
        self.code = code
        self.shape = tuple(shape)
        self.ok_layout = ok_layout
        self.where = where

    def accepts(self, code: int) -> bool:
        """Whether the file's dtype ``code`` is this destination's (a framework that spells
        some dtypes as raw bits says so here)."""
        return code == self.code

    def host_bytes(self) -> memoryview:
        """A writable byte view of host memory (no copy)."""
        raise NotImplementedError

    def device_bytes(self):
        """The uint8 device array the copies write to (no copy)."""
        raise NotImplementedError

    def device_ops(self):
        """The pipeline's :class:`~engine.loading.pipeline.DeviceOps` for this target's device, or
        None where a load cannot fill it (a torch device other than CUDA)."""
        return None


class NumpyTarget(FillTarget):
    def host_bytes(self) -> memoryview:
        import numpy as np

        return memoryview(self.tensor.reshape(-1).view(np.uint8))
