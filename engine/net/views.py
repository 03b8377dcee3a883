"""The destination views of a read, back to back: cut where a try left off, and built for
runs of bytes at strided offsets.

A read fills a list of views as one byte range (:meth:`engine.net.remote_reads.RangeReads.read`,
a handle's ``read(offset, views)``): :func:`skip_views` and :func:`limit_views` cut such a list
(the bytes a failed try did not land, a part served from elsewhere); :func:`read_runs` turns
runs of rows (a column block of a matrix) into such lists, one per group of neighbours.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["limit_views", "read_runs", "skip_views"]


def skip_views(views: Sequence[memoryview], n: int) -> list[memoryview]:
    """``views`` (back to back) without their first ``n`` bytes."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


def limit_views(views: list[memoryview], n: int) -> list[memoryview]:
    """The first ``n`` bytes of ``views`` (back to back)."""
    out = []
    for v in views:
        if n <= 0:
            break
        out.append(v[:n])
        n -= len(out[-1])
    return out


def read_runs(read: Callable[[int, Sequence[memoryview]], None], dst: memoryview, src, run_bytes: int, base: int,
              *, max_gap: int = 1 << 20, max_span: int = 64 << 20) -> int:
    """Fill ``dst`` with runs of ``run_bytes`` at file offsets ``base + src[i]`` (back to
    back in ``dst``) through ``read(offset, views)``, one request per group of neighbouring
    runs: runs whose gaps are at most ``max_gap`` and whose span is at most ``max_span``
    share a request, the gap bytes received into a scratch buffer and dropped (a column
    block of a matrix is one request, not one per row).  Returns the requests made.

    Copies of tensor bytes: 1 (socket to ``dst``; only the gaps go to the scratch buffer).
    """
    offsets = [int(x) for x in src]
    n = len(offsets)
    scratch: memoryview | None = None
    requests = i = 0
    while i < n:
        start = offsets[i]
        j = i + 1
        while (j < n and 0 <= offsets[j] - (offsets[j - 1] + run_bytes) <= max_gap
               and offsets[j] + run_bytes - start <= max_span):
            j += 1
        views: list[memoryview] = []
        for k in range(i, j):
            views.append(dst[k * run_bytes : (k + 1) * run_bytes])
            if k + 1 < j:
                gap = offsets[k + 1] - (offsets[k] + run_bytes)
                if gap:
                    if scratch is None:
                        scratch = memoryview(bytearray(max_gap))
                    views.append(scratch[:gap])
        read(base + start, views)
        requests += 1
        i = j
    return requests
