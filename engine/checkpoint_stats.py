"""Statistics of every tensor of a file, an index or a checkpoint directory.

``engine.stats_file(path)``: the whole-checkpoint convenience over :func:`engine.stats`.  It
sits above :mod:`engine.checkpoint` (which it opens files with), so that
:mod:`engine.numerics.statistics` stays below the loaders that summarise tensors while they load.
"""

from __future__ import annotations

import math

from .checkpoint import open_checkpoint
from .dtypes import BY_NAME
from .numerics.statistics import SUPPORTED_NAMES, Stats, stats

__all__ = ["stats_file"]


def stats_file(path, names=None, *, threads: int | None = None, progress=None) -> dict[str, Stats]:
    """Statistics of every tensor of a file, an index or a checkpoint directory.

    Parameters
    ----------
    path : str or os.PathLike
    names : iterable of str, optional
        Only these tensors (default: all).
    threads : int, optional
        As for :func:`engine.stats`.
    progress : callable, optional
        Called as ``progress(name, nbytes)`` after each tensor (summarised or left out).

    Returns
    -------
    dict of str to Stats
        In file order; tensors whose dtype the kernel does not summarise (FP8, sub-byte,
        complex) are left out.

    Notes
    -----
    Copies of tensor bytes: 0.  Each tensor is a view of a mapping that the kernel
    reads once; memory is bounded by the page cache, not by the model's size.  To get
    statistics while loading tensors for use, see ``engine.stream(..., stats=True)``.
    """
    out: dict[str, Stats] = {}
    with open_checkpoint(path, framework="numpy") as ck:
        wanted = list(names) if names is not None else (
            ck.offset_keys())
        for name in wanted:
            sl = ck.get_slice(name)
            if sl.get_dtype() in SUPPORTED_NAMES:
                out[name] = stats(ck.get_tensor(name), threads=threads)
            if progress is not None:
                progress(name, math.prod(sl.get_shape()) * BY_NAME[sl.get_dtype()].bits // 8)
    return out
