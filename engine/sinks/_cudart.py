"""Where the device sinks find the CUDA runtime the chunk ring calls: the ``libcudart`` torch
or CuPy has already loaded into the process (read from ``/proc/self/maps``), else the first
soname the dynamic loader finds (:func:`engine.gpu.device_ring.cuda_runtime_path`).

Nothing here is linked at build time (CI and most hosts have no CUDA); the engine page-locks
nothing outside the ring, whose native code registers its own chunks.
"""

from __future__ import annotations

__all__ = ["runtime_path"]


def _loaded_cudart_path() -> str | None:
    from engine.gpu.device_ring import _loaded_cudart_path as loaded

    return loaded()


def runtime_path() -> str | None:
    """The ``libcudart`` the engine's chunk ring opens (:func:`engine.gpu.device_ring.cuda_runtime_path`)."""
    from engine.gpu.device_ring import cuda_runtime_path

    return cuda_runtime_path()
