"""The CUDA runtime the chunk ring calls: which ``libcudart`` (the one torch or CuPy loaded,
so the same instance, contexts and streams) and that library opened, once per path, with its
entry points looked up by name (:mod:`engine.gpu._cudart`)."""

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


#: sonames tried when no runtime is mapped yet: the framework's major first, then newest first
_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")


def _wheel_cudart_path(major: int | None) -> str | None:
    """The ``libcudart`` of the NVIDIA runtime wheel (``nvidia-cuda-runtime-cu12`` and the
    like: ``nvidia/cuda_runtime/lib``) where pip put it beside the framework, or None.  Such a
    folder is not on the dynamic loader's path: a framework that links its runtime statically
    (CuPy) maps no ``libcudart`` the process could find otherwise."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    names = ([f"libcudart.so.{major}"] if major is not None else []) + list(_SONAMES)
    for root in spec.submodule_search_locations or ():
        lib = os.path.join(root, "cuda_runtime", "lib")
        for name in names:
            path = os.path.join(lib, name)
            if os.path.exists(path):
                return path
    return None


def cuda_runtime_path(major: int | None = None) -> str | None:
    """Path of the ``libcudart`` this process has loaded (torch's: opening it again gives that
    same instance), else the NVIDIA runtime wheel's (:func:`_wheel_cudart_path`), else the first
    soname the dynamic loader finds, else None.  The ring needs the runtime's entry points
    only: a second instance of the runtime (beside CuPy's static one) works on the same
    primary contexts, whose streams and events it shares.

    ``major``: the CUDA major the framework was built with (``torch.version.cuda``, CuPy's
    runtime version): a mapped runtime of that major is preferred, and with none mapped its
    soname is tried first (a newer one may need a newer driver than the machine has)."""
    path = _loaded_cudart_path(major)
    if path is not None:
        return path
    path = _wheel_cudart_path(major)
    if path is not None:
        return path
    import ctypes

    names = ((f"libcudart.so.{major}",) if major is not None else ()) + _SONAMES
    for name in dict.fromkeys(names):
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return name
    return None


@functools.cache
def runtime(path: str):
    """The CUDA runtime at ``path``, opened once per path (:class:`engine.gpu._cudart.Runtime`;
    OSError where it cannot be opened or lacks an entry point)."""
    from engine.gpu import _cudart

    return _cudart.Runtime(path)


def on_device(rt, device: int):
    """``with on_device(rt, device):`` ``device``'s primary context current on this thread for
    the block, the thread as it was after (:class:`engine.gpu._cudart.OnDevice`)."""
    from engine.gpu import _cudart

    return _cudart.OnDevice(rt, device)
