"""The CUDA runtime the chunk ring calls: which ``libcudart`` (the one torch loaded, so the
same instance, contexts and streams; else the driver standing for it) and that library opened,
once per path, with its entry points looked up by name (:mod:`engine.gpu._cudart`)."""

from __future__ import annotations

import functools
import os

__all__ = ["cuda_runtime_path", "on_device", "runtime"]


#: runtime paths found mapped in this process, per CUDA major asked for (a library stays
#: mapped once loaded: each question is answered once)
_MAPPED: dict[int | None, str] = {}


def _major_of(path: str) -> int | None:
    """The CUDA major in a runtime's file name (``libcudart.so.12.8.90`` -> 12), or None."""
    tail = os.path.basename(path).partition("libcudart.so.")[2]
    head = tail.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _loaded_cudart_path(major: int | None = None) -> str | None:
    """A ``libcudart`` mapped in this process: of CUDA ``major`` where one is (a process may
    map two, torch's and another library's), else the first mapped."""
    if major in _MAPPED:
        return _MAPPED[major]
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(" ")[-1]
                if "libcudart.so" in os.path.basename(path) and path not in found:
                    found.append(path)
    except OSError:
        pass
    if not found:
        return None
    pick = next((p for p in found if _major_of(p) == major), None) if major is not None else found[0]
    if pick is None:  # none of that major mapped (yet): the first, asked again next time
        return found[0]
    _MAPPED[major] = pick
    return pick


#: the prefix of a "runtime path" that names the CUDA driver standing for the runtime
DRIVER_ROUTE = "driver:"


def _driver_path() -> str | None:
    """The CUDA driver's library where the dynamic loader finds it (every process that uses
    CUDA maps it), else None."""
    import ctypes

    from engine.gpu._cudart import DRIVER

    try:
        ctypes.CDLL(DRIVER)
    except OSError:
        return None
    return DRIVER


def cuda_runtime_path(major: int | None = None) -> str | None:
    """Path of the ``libcudart`` this process has loaded (torch's: opening it again gives that
    same instance), else ``"driver:"`` and the CUDA driver's library, else None.

    A process that maps no runtime (CuPy links its own in statically) is served by the driver
    (:class:`engine.gpu._cudart.Runtime` with ``driver=True``): one library per process, whose
    contexts, streams and events the framework's runtime shares, where opening some
    ``libcudart`` by soname would be a guess (a second instance, of some major, if one is on
    the loader's path at all).

    ``major``: the CUDA major the framework was built with (``torch.version.cuda``, CuPy's
    runtime version): a mapped runtime of that major is preferred."""
    path = _loaded_cudart_path(major)
    if path is not None:
        return path
    driver = _driver_path()
    return DRIVER_ROUTE + driver if driver is not None else None


@functools.cache
def runtime(path: str):
    """The CUDA runtime at ``path`` (``"driver:"`` and a path: the driver standing for it),
    opened once per path (:class:`engine.gpu._cudart.Runtime`; OSError where it cannot be
    opened or lacks an entry point)."""
    from engine.gpu import _cudart

    if path.startswith(DRIVER_ROUTE):
        return _cudart.Runtime(path[len(DRIVER_ROUTE) :], driver=True)
    return _cudart.Runtime(path)


def on_device(rt, device: int):
    """``with on_device(rt, device):`` ``device``'s primary context current on this thread for
    the block, the thread as it was after (:class:`engine.gpu._cudart.OnDevice`)."""
    from engine.gpu import _cudart

    return _cudart.OnDevice(rt, device)
