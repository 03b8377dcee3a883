"""File to device through the native chunk ring (:mod:`engine._ring`): the copy path of a
device load.

A load's pieces (file, offset, bytes, device address) are cut into chunks once
(:func:`engine._ring.plan`: one ``chunk_bytes``-aligned block of a file per chunk), then one
native call moves them: ``threads`` copy threads each take the next chunk, wait for its slot's
previous copy to complete, fill it from the page cache; the calling thread issues each chunk's
``cudaMemcpyAsync`` in order on the load's stream as soon as it is full.  Two copies of each
byte: page cache -> page-locked chunk, chunk -> device by DMA.  No Python runs per chunk:
the calling thread takes the GIL every few tens of milliseconds to report the tensors that
have landed and to see a cancel.

The geometry (:class:`Geometry`: chunk size, chunks in flight, copy threads) depends on the
host and the device; the defaults are set from ``scripts/gpu_check.py --sweep`` (BENCHMARKS.md
names the run), and ``ENGINE_RING`` (``chunk_mib,chunks,threads``) or the loaders'
``ring=`` argument overrides them.

What a device framework provides (its ``DeviceOps``, :mod:`engine.sinks`): the path of the
CUDA runtime it loaded (``runtime_path()``), its device index (``device_index``), a stream
(``ring_stream()`` -> ``(handle, owner)``) and the device address of a target
(``address(target)``).
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import weakref
from typing import NamedTuple

import numpy as np

from .errors import DeviceError
from .reader import check_read, close_mapping, copy_mapping, copy_source, kept

__all__ = ["Geometry", "default_geometry", "supports", "load", "keep_rings", "locked_bytes", "cuda_runtime_path"]

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
    env = os.environ.get("ENGINE_RING", "").strip()
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


def supports(ops) -> bool:
    """Whether a device framework's operations can drive the ring."""
    return all(hasattr(ops, m) for m in ("runtime_path", "ring_stream", "address")) and hasattr(ops, "device_index")


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


@functools.cache
def _runtime(path: str):
    from . import _ring

    return _ring.Runtime(path)


#: seconds an unused ring stays set up after a load (so that a loop of small loads, such as
#: ``get_tensor`` per key, sets it up once); then it is closed and nothing stays page-locked
LINGER_SECONDS = 2.0


class _Kept:
    """Rings between loads: kept until :func:`keep_rings` (or ``engine.keep_staging``) turns
    keeping off, or else for :data:`LINGER_SECONDS` after their last load.  A ring's threads,
    events and page-locked chunks are then set up once for loads that follow each other."""

    def __init__(self) -> None:
        self.on = os.environ.get("ENGINE_KEEP_STAGING", "") == "1"
        self.lock = threading.Lock()
        self.rings: dict = {}  # key -> (ring, timer or None)

    def take(self, key):
        with self.lock:
            ring, timer = self.rings.pop(key, (None, None))
        if timer is not None:
            timer.cancel()
        return ring

    def give(self, key, ring) -> bool:
        with self.lock:
            if key in self.rings:
                return False
            timer = None
            if not self.on:
                if LINGER_SECONDS <= 0:
                    return False
                timer = threading.Timer(LINGER_SECONDS, self._expire, (key, ring))
                timer.daemon = True
            self.rings[key] = (ring, timer)
        if timer is not None:
            timer.start()
        return True

    def _expire(self, key, ring) -> None:
        with self.lock:
            if self.rings.get(key, (None,))[0] is not ring:
                return  # taken meanwhile
            del self.rings[key]
        ring.close()

    def release(self) -> None:
        with self.lock:
            entries, self.rings = list(self.rings.values()), {}
        for ring, timer in entries:
            if timer is not None:
                timer.cancel()
            ring.close()


KEPT = _Kept()
# closed before the CUDA runtime's own exit handlers run
atexit.register(KEPT.release)
_LIVE: weakref.WeakSet = weakref.WeakSet()


def keep_rings(on: bool = True) -> None:
    """Keep each device's ring (threads, events, page-locked chunks) between loads until
    turned off (``True``), or close the kept ones and keep them only briefly after each load
    (``False``).  ``engine.keep_staging`` calls this."""
    KEPT.on = bool(on)
    if not on:
        KEPT.release()


def release_rings() -> None:
    """Close every ring set up and not in use now: nothing the engine page-locked stays locked."""
    KEPT.release()


def locked_bytes() -> int:
    """Host bytes the engine's rings hold page-locked now (kept and running ones)."""
    return sum(r.locked_bytes for r in list(_LIVE))


#: the runtime found mapped in this process (it stays mapped once loaded: looked up once)
_MAPPED: list[str] = []


def _loaded_cudart_path() -> str | None:
    if _MAPPED:
        return _MAPPED[0]
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(" ")[-1]
                if "libcudart.so" in os.path.basename(path):
                    _MAPPED.append(path)
                    return path
    except OSError:
        pass
    return None


#: sonames tried, newest first, when no runtime is mapped yet
_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")


def cuda_runtime_path() -> str | None:
    """Path of the ``libcudart`` this process has loaded (torch's or CuPy's: opening it again
    gives that same instance), else the first soname the dynamic loader finds, else None."""
    path = _loaded_cudart_path()
    if path is not None:
        return path
    import ctypes

    for name in _SONAMES:
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return name
    return None


def _new_ring(ops, g: Geometry):
    from . import _ring

    path = ops.runtime_path()
    if not path:
        raise DeviceError("no CUDA runtime is loaded in this process to copy through")
    try:
        rt = _runtime(path)
    except OSError as exc:
        raise DeviceError(str(exc)) from exc
    stream, owner = ops.ring_stream()
    try:
        ring = _ring.ChunkRing(rt, ops.device_index, stream, g.chunk_bytes, g.chunks, g.threads, owner)
    except RuntimeError as exc:
        raise DeviceError(f"cannot set up the copy ring: {exc}") from exc
    _LIVE.add(ring)
    return ring


class _Pieces:
    """The load's pieces in load order, as the native planner takes them, and for each
    tensor key its bytes and the index of its last piece."""

    def __init__(self, sources, targets, address) -> None:
        files, offs, lens, dsts = [], [], [], []
        self.keys: list = []  # per piece
        self.sizes: dict = {}
        self.empty: list = []
        for i, src in enumerate(sources):
            base = src.row_base
            for req in src.requests:
                for p in req.pieces:
                    key = base + p.row
                    if not p.nbytes:
                        self.sizes.setdefault(key, 0)
                        continue
                    files.append(i)
                    offs.append(req.offset + p.request_offset)
                    lens.append(p.nbytes)
                    dsts.append(address(targets[key]) + p.tensor_offset)
                    self.keys.append(key)
                    self.sizes[key] = self.sizes.get(key, 0) + p.nbytes
        self.file = np.array(files, np.int32)
        self.off = np.array(offs, np.int64)
        self.len = np.array(lens, np.int64)
        self.dst = np.array(dsts, np.uint64)


def plan(pieces: _Pieces, chunk_bytes: int):
    """The chunk plan of :func:`engine._ring.plan`, trimmed: ``(c_file, c_seg, s_pos, s_off,
    s_len, s_dst)``."""
    from . import _ring

    n = len(pieces.len)
    total = int(pieces.len.sum()) if n else 0
    cap = n + 2 * (total // chunk_bytes) + 2
    c_file = np.empty(cap, np.int32)
    c_seg = np.empty(cap + 1, np.int64)
    s_pos, s_off, s_len = (np.empty(cap + n, np.int64) for _ in range(3))
    s_dst = np.empty(cap + n, np.uint64)
    k, m = _ring.plan(pieces.file, pieces.off, pieces.len, pieces.dst, chunk_bytes, c_file, c_seg, s_pos, s_off,
                      s_len, s_dst)
    return c_file[:k].copy(), c_seg[: k + 1].copy(), s_pos[:m].copy(), s_off[:m].copy(), s_len[:m].copy(), \
        s_dst[:m].copy()


class _Landing:
    """Reports each tensor to the tracker once the chunk holding its last byte has completed."""

    def __init__(self, pieces: _Pieces, c_seg, s_len, tracker) -> None:
        self.tracker = tracker
        if len(pieces.len):
            seg_end = np.cumsum(s_len)
            chunk_end = seg_end[c_seg[1:] - 1]
            piece_chunk = np.searchsorted(chunk_end, np.cumsum(pieces.len), side="left")
        else:
            piece_chunk = np.empty(0, np.int64)
        last: dict = {}
        for key, c in zip(pieces.keys, piece_chunk.tolist(), strict=True):
            last[key] = c
        order = sorted(last.items(), key=lambda kv: kv[1])
        self.order = [k for k, _ in order]
        self.chunk = np.array([c for _, c in order], np.int64)
        self.sizes = pieces.sizes
        self.reported = 0
        tracker.landed([(k, 0) for k, n in pieces.sizes.items() if n == 0])

    def upto(self, done: int) -> None:
        """Chunks ``[0, done)`` have completed."""
        stop = int(np.searchsorted(self.chunk, done, side="left"))
        if stop > self.reported:
            keys = self.order[self.reported : stop]
            self.reported = stop
            self.tracker.landed([(k, self.sizes[k]) for k in keys])


def load(sources, dest, tracker, cancel: threading.Event, geometry: Geometry | None = None) -> dict:
    """Move every request of ``sources`` (local files) into ``dest``'s device targets through a
    chunk ring; reports tensors to ``tracker`` as they land.  Returns what the ring measured
    (``threads``, ``chunk_bytes``, ``chunks``, ``waits``, ``sources``, ``pageable``).

    Raises :class:`~engine.errors.ReadError` naming the file of a failed read,
    :class:`~engine.errors.DeviceError` for a failure of the runtime; returns early, with
    ``cancel`` set, when cancelled.  Every issued copy has completed when it returns, and the
    files' mappings are closed.
    """
    ops = dest.device_ops
    g = checked(geometry or default_geometry())
    targets = dest.device_targets
    pieces = _Pieces(sources, targets, ops.address)
    c_file, c_seg, s_pos, s_off, s_len, s_dst = plan(pieces, g.chunk_bytes)
    landing = _Landing(pieces, c_seg, s_len, tracker)
    if not len(c_file):
        return {}
    used = sorted(set(c_file.tolist()))
    mappings: dict[int, object] = {}
    arrays: list = []
    fds = np.full(len(sources), -1, np.int32)
    maps = np.zeros(len(sources), np.uint64)
    lens = np.zeros(len(sources), np.int64)
    keeps = np.zeros(len(sources), np.uint8)
    key = (ops.runtime_path(), ops.device_index, g)
    ring = KEPT.take(key)
    try:
        for i in used:
            fds[i] = sources[i].fd
            m = mappings[i] = copy_mapping(sources[i].fd)
            if m is not None:
                a = np.frombuffer(m, np.uint8)
                arrays.append(a)
                maps[i] = a.ctypes.data if len(a) else 0
                lens[i] = len(a)
                keeps[i] = kept(m)
        if ring is None:
            ring = _new_ring(ops, g)

        def poll(done: int) -> bool:
            landing.upto(done)
            return cancel.is_set()

        kind, code, chunk, at, missing = ring.run(c_file, c_seg, s_pos, s_off, s_len, s_dst, fds, maps, lens,
                                                  keeps, poll, adaptive=copy_source() != "mmap",
                                                  stream_stores=stores() == "stream")
        stats = {"threads": ring.threads, "chunk_bytes": ring.chunk_bytes, "chunks": ring.chunks,
                 "waits": ring.waits, "sources": ring.sources, "pageable": ring.pageable}
    finally:
        arrays.clear()
        for m in mappings.values():
            close_mapping(m)
        if ring is not None and not KEPT.give(key, ring):
            ring.close()
    if kind == 1:
        src = sources[int(c_file[chunk])]
        check_read((code, at, missing), "the load", src.path, src.fd)  # raises: code is an errno or -1
    if kind == 2:
        src = sources[int(c_file[chunk])]
        rt = _runtime(ops.runtime_path())
        raise DeviceError(
            f"copying {src.path or 'the file'} to the device failed (chunk {chunk} of {len(c_file)}): "
            f"{rt.error_string(code)} (CUDA error {code})", path=src.path)
    if kind == 3:
        cancel.set()
        return stats
    landing.upto(len(c_file))
    return stats
