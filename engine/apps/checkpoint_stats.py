"""Statistics of every tensor of a file, an index or a checkpoint directory.

``engine.stats_file(path)``: the whole-checkpoint convenience over :func:`engine.stats`.  It
sits above :mod:`engine.checkpoints.checkpoint` (which it opens files with), so that
:mod:`engine.numerics.statistics` stays below the loaders that summarise tensors while they load.
"""

from __future__ import annotations

import math

from engine.apps.entry_points import open_checkpoint
from engine.base.dtypes import BY_NAME
from engine.errors import MissingDependencyError

try:
    from engine.numerics.statistics import SUPPORTED_NAMES, Stats, stats
except ModuleNotFoundError as exc:  # the Numba kernels: the ``kernels`` extra
    raise MissingDependencyError.of(exc, "engine.stats_file (the Numba kernels)") from None

__all__ = ["stats_file"]


def stats_file(path, names=None, *, threads: int | None = None, progress=None, **options) -> dict[str, Stats]:
    """Statistics of every tensor of a file, an index or a checkpoint directory, or of a
    URL of any of them.

    Parameters
    ----------
    path : str or os.PathLike
        As :func:`engine.open_checkpoint` takes it (a URL too).
    names : iterable of str, optional
        Only these tensors (default: all).
    threads : int, optional
        As for :func:`engine.stats`.
    progress : callable, optional
        Called as ``progress(name, nbytes)`` after each tensor (summarised or left out).
    **options
        For a URL: ``headers``, ``timeout``, ``connections``, ... as
        :func:`engine.open_checkpoint` takes them.

    Returns
    -------
    dict of str to Stats
        In file order; tensors whose dtype the kernel does not summarise (FP8, sub-byte,
        complex) are left out.

    Notes
    -----
    Copies of tensor bytes: 0.  Each tensor is a view of a mapping that the kernel
    reads once; memory is bounded by the page cache, not by the model's size.  A URL's
    tensors are read one at a time (one copy: socket to the tensor), so memory is one tensor.  To get
    statistics while loading tensors for use, see ``engine.stream(..., stats=True)``.
    """
    out: dict[str, Stats] = {}
    with open_checkpoint(path, framework="numpy", **options) as ck:
        wanted = list(names) if names is not None else (
            ck.offset_keys())
        for name in wanted:
            sl = ck.get_slice(name)
            if sl.get_dtype() in SUPPORTED_NAMES:
                out[name] = stats(ck.get_tensor(name), threads=threads)
            if progress is not None:
                progress(name, math.prod(sl.get_shape()) * BY_NAME[sl.get_dtype()].bits // 8)
    return out
