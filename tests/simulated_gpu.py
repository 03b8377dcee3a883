"""Make Numba's CUDA simulator refuse what a GPU refuses.

The simulator (``NUMBA_ENABLE_CUDASIM=1``) runs a device function called from the host as a
plain Python call, keeps a kernel's launch configuration after the launch (so a later call
without ``[grid, block]`` runs again), and takes any grid size.  A GPU refuses all three:
"Kernel launch configuration was not specified" for the first two, a launch error for the
third.  :func:`install` patches the simulator's kernel class so that the simulator lane
fails where a GPU would: tests that pass there then run on a GPU as they are.
"""

from __future__ import annotations

#: the limits of every CUDA device of compute capability 3.0 and later
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK = (1024, 1024, 64)
MAX_BLOCK_THREADS = 1024

HOST_CALL = "Kernel launch configuration was not specified"


def install() -> None:
    """Patch the simulator's kernels (once per process; only under the simulator)."""
    from numba import config

    if not config.ENABLE_CUDASIM:
        return
    from numba.cuda.simulator import kernel as sim

    cls = sim.FakeCUDAKernel
    if getattr(cls, "_refuses_what_a_gpu_refuses", False):
        return
    call, getitem = cls.__call__, cls.__getitem__

    def __call__(self, *args):
        if sim._get_kernel_context() is None:  # called from the host, not from a simulated thread
            if self._device:
                raise ValueError(f"{HOST_CALL}: {self.__name__} is a device function; a GPU runs it only "
                                 "when a kernel calls it (launch a kernel that does)")
            if self.grid_dim is None:
                raise ValueError(f"{HOST_CALL}: launch {self.__name__}[grid, block](...)")
            try:
                return call(self, *args)
            finally:  # a GPU's configured launcher is used once per [grid, block]
                self.grid_dim = self.block_dim = None
        return call(self, *args)

    def __getitem__(self, configuration):
        out = getitem(self, configuration)
        check(self.grid_dim, self.block_dim)
        return out

    cls.__call__ = __call__
    cls.__getitem__ = __getitem__
    cls._refuses_what_a_gpu_refuses = True


def check(grid: tuple, block: tuple) -> None:
    """Raise where a GPU refuses the (normalized, 3-D) launch sizes ``grid`` and ``block``."""
    for g, m in zip(grid, MAX_GRID, strict=True):
        if not 1 <= g <= m:
            raise ValueError(f"grid {grid} is outside a GPU's limits {MAX_GRID}")
    for b, m in zip(block, MAX_BLOCK, strict=True):
        if not 1 <= b <= m:
            raise ValueError(f"block {block} is outside a GPU's limits {MAX_BLOCK}")
    if block[0] * block[1] * block[2] > MAX_BLOCK_THREADS:
        raise ValueError(f"block {block} has more than {MAX_BLOCK_THREADS} threads")
