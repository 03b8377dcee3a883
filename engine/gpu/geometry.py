"""The chunk ring's shape and settings: :class:`Geometry` (chunk size, chunks in flight, copy
threads), its defaults for this host and the environment's overrides.

The geometry depends on the host and the device; the defaults are set from
``scripts/gpu_check.py --sweep`` (BENCHMARKS.md names the run), and ``ENGINE_RING``
(``chunk_mib,chunks,threads``) or the loaders' ``ring=`` argument overrides them.
``ENGINE_RING_STORES`` says how copy threads write the chunks (:func:`stores`).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

__all__ = ["MAX_RING_BYTES", "Geometry", "checked", "cores", "default_geometry", "default_threads", "geometry_for",
           "parse_geometry", "stores"]

_MIB = 1 << 20
#: the most host memory a ring page-locks when the caller does not say
MAX_RING_BYTES = 256 * _MIB


class Geometry(NamedTuple):
    """The ring's shape: bytes per chunk (a multiple of 4096), chunks in flight (the ring's
    slots), native copy threads."""

    chunk_bytes: int
    chunks: int
    threads: int

    @property
    def pinned_bytes(self) -> int:
        return self.chunk_bytes * self.chunks


def cores() -> int:
    """Cores this process may run on (at least 1): the default copy threads."""
    return _cores()


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def default_threads(cores: int | None = None) -> int:
    """Copy threads: every core on small hosts, leaving cores for the issuing thread, the
    driver and the caller on larger ones (``cores - 4`` from 12 cores on)."""
    n = cores or _cores()
    if n >= 12:
        return n - 4
    if n >= 6:
        return n - 2
    return n


def default_geometry(cores: int | None = None) -> Geometry:
    """The ring's shape when the caller says nothing: ``ENGINE_RING`` if set, else 4 MiB
    chunks, 32 in flight (128 MiB page-locked), :func:`default_threads`."""
    return _default_geometry(os.environ.get("ENGINE_RING", "").strip(), cores)


@functools.lru_cache(maxsize=16)
def _default_geometry(env: str, cores: int | None) -> Geometry:
    if env:
        return parse_geometry(env)
    return Geometry(4 * _MIB, 32, default_threads(cores))


def stores() -> str:
    """How copy threads write chunks filled out of a mapping: ``"stream"`` (the default: past
    the caches, for rings larger than the last-level cache) or ``"cached"`` (through them);
    ``ENGINE_RING_STORES`` picks one, ``scripts/gpu_check.py --sweep`` measures both."""
    value = os.environ.get("ENGINE_RING_STORES", "stream").strip().lower()
    if value not in ("stream", "cached"):
        raise ValueError(f"ENGINE_RING_STORES must be 'stream' or 'cached', not {value!r}")
    return value


def parse_geometry(text: str) -> Geometry:
    """``"chunk_mib,chunks,threads"`` (``ENGINE_RING``'s form) as a :class:`Geometry`."""
    try:
        mib, chunks, threads = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"a ring geometry is 'chunk_mib,chunks,threads', not {text!r}") from None
    return checked(Geometry(int(mib * _MIB) // 4096 * 4096, int(chunks), int(threads)))


def checked(g: Geometry) -> Geometry:
    if g.chunk_bytes < 4096 or g.chunk_bytes % 4096:
        raise ValueError(f"a ring chunk is a positive multiple of 4096 bytes, not {g.chunk_bytes}")
    if g.chunks < 1 or not 1 <= g.threads <= 256:
        raise ValueError(f"a ring has at least one chunk and 1 to 256 threads, not {g}")
    return g


def geometry_for(slot_bytes: int | None = None, threads: int | None = None) -> Geometry:
    """The default geometry with a loader's ``slot_bytes`` (bytes per chunk; chunks as many as
    fit :data:`MAX_RING_BYTES`, at least 2) and ``threads`` (copy threads) applied."""
    g = default_geometry()
    if slot_bytes:
        chunk = max(4096, slot_bytes // 4096 * 4096)
        g = Geometry(chunk, max(2, min(g.chunks, MAX_RING_BYTES // chunk)), g.threads)
    if threads:
        g = g._replace(threads=threads)
    return checked(g)
