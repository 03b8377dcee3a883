"""The chunk rings' lives: each set up (:func:`new_ring`: threads, events, page-locked chunks on
a device and stream), kept between loads or for a moment after one, closed, and forgotten in a
forked child.  The public face of :mod:`engine.gpu._ring`.

A forked child forgets the rings it inherited without touching them (their threads are the
parent's): :func:`_after_fork`.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref

from engine.errors import DeviceError
from engine.gpu.cudart import runtime
from engine.gpu.geometry import Geometry

__all__ = ["LINGER_SECONDS", "keep_rings", "keep_staging", "locked_bytes", "release_rings"]


#: seconds an unused ring stays set up after a load (so that a loop of small loads, such as
#: ``get_tensor`` per key, sets it up once); then it is closed and nothing stays page-locked
LINGER_SECONDS = 2.0


class _Kept:
    """Rings between loads: kept until :func:`keep_rings` (or ``engine.keep_staging``) turns
    keeping off, or else for :data:`LINGER_SECONDS` after their last load.  A ring's threads,
    events and page-locked chunks are then set up once for loads that follow each other.

    One reaper thread (started with the first lingering ring) closes the rings whose time is
    up: a load gives its ring back without starting a timer thread.  A ring being prepared
    ahead of the first load (:func:`~engine.gpu.device_ring.prepare`) is a pending entry that
    :meth:`take` waits for.
    """

    def __init__(self) -> None:
        self.on = os.environ.get("ENGINE_KEEP_STAGING", "") == "1"
        self.forget()

    def forget(self) -> None:
        """No ring kept and no reaper, without closing any (a forked child's start)."""
        self.cond = threading.Condition()
        self.rings: dict = {}  # key -> [ring or None while pending, expiry (monotonic) or None]
        self.reaper: threading.Thread | None = None
        self.closing = 0  # rings the reaper is closing now

    def take(self, key):
        """``(ring or None, waited)``: the ring kept for ``key``, and whether it was still
        being prepared when asked for (the load then waited for its set-up)."""
        waited = False
        with self.cond:
            while key in self.rings and self.rings[key][0] is None:  # being prepared
                waited = True
                self.cond.wait()
            entry = self.rings.pop(key, None)
        return (entry[0] if entry is not None else None), waited

    def pending(self, key) -> bool:
        """Mark ``key`` as being prepared (False when a ring is kept or pending for it)."""
        with self.cond:
            if key in self.rings:
                return False
            self.rings[key] = [None, None]
            return True

    def give(self, key, ring, linger: bool = True) -> bool:
        """Keep ``ring`` for the next load of ``key``: while keeping is on, or for
        :data:`LINGER_SECONDS` (``linger``; without it, until taken).  False when it is not
        kept (another ring is, or lingering is off): close it then."""
        with self.cond:
            entry = self.rings.get(key)
            if entry is not None and entry[0] is not None:
                return False
            expiry = None
            if not self.on and linger:
                if LINGER_SECONDS <= 0:
                    if entry is not None:
                        del self.rings[key]
                        self.cond.notify_all()
                    return False
                expiry = time.monotonic() + LINGER_SECONDS
                if self.reaper is None or not self.reaper.is_alive():
                    self.reaper = threading.Thread(target=self._reap, name="engine-ring-reaper", daemon=True)
                    self.reaper.start()
            self.rings[key] = [ring, expiry]
            self.cond.notify_all()
        return True

    def drop(self, key) -> None:
        """Forget a pending entry whose preparation failed."""
        with self.cond:
            entry = self.rings.get(key)
            if entry is not None and entry[0] is None:
                del self.rings[key]
            self.cond.notify_all()

    def _reap(self) -> None:
        while True:
            with self.cond:
                now = time.monotonic()
                due = [k for k, (r, t) in self.rings.items() if r is not None and t is not None and t <= now]
                expired = [self.rings.pop(k)[0] for k in due]
                if not expired:
                    times = [t for r, t in self.rings.values() if r is not None and t is not None]
                    self.cond.wait(max(0.01, min(times) - now) if times else None)
                    continue
                self.closing += len(expired)
            for ring in expired:
                try:
                    ring.close()
                finally:
                    with self.cond:
                        self.closing -= 1
                        self.cond.notify_all()

    def settle(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until the reaper closes no ring."""
        with self.cond:
            self.cond.wait_for(lambda: not self.closing, timeout)

    def release(self) -> None:
        with self.cond:
            entries = [k for k, (r, _) in self.rings.items() if r is not None]
            rings = [self.rings.pop(k)[0] for k in entries]
            self.cond.notify_all()
        for ring in rings:
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


def keep_staging(on: bool = True) -> None:
    """Keep the page-locked host memory of device loads (each device's chunk ring: its
    threads, events and chunks) between loads (``True``), or close what is kept and keep it
    only briefly after each load (``False``).  A server that loads several models or reloads
    one saves setting the ring up on every load after the first; the cost is the ring's
    chunks (:data:`~engine.gpu.geometry.MAX_RING_BYTES` by default) locked until
    ``keep_staging(False)``.  Same as ``ENGINE_KEEP_STAGING=1`` at start-up.  :func:`keep_rings`
    under its public name."""
    keep_rings(on)


def release_rings() -> None:
    """Close every ring set up and not in use now: nothing the engine page-locked stays locked."""
    KEPT.release()


def locked_bytes() -> int:
    """Host bytes the engine's rings hold page-locked now (kept and running ones)."""
    return sum(r.locked_bytes for r in list(_LIVE))


def _after_fork() -> None:
    """In a forked child: the rings and the reaper are the parent's.  Each inherited ring is
    forgotten untouched (:meth:`~engine.gpu._ring.ChunkRing.abandon`), and the keeping starts
    empty, with locks of its own (a parent's thread may have held one at the fork; the
    unmapping thread of :mod:`engine.gpu.device_ring` and the lock of
    :mod:`engine.gpu.records` are renewed by their modules).  CUDA itself cannot be used in a
    child forked after it started; host loads go on as in any process."""
    for ring in list(_LIVE):
        ring.abandon()
        _ABANDONED.append(ring)  # never freed here: its stream's owner would call the parent's driver
    KEPT.forget()


_ABANDONED: list = []

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def new_ring(ops, g: Geometry):
    """A ring of geometry ``g`` on ``ops``'s device (:class:`engine.gpu._ring.ChunkRing`: its
    threads started, its stream and events made; its chunks page-locked on first use);
    :class:`~engine.errors.DeviceError` where the runtime is missing or refuses."""
    from engine.gpu import _ring

    path = ops.runtime_path()
    if not path:
        raise DeviceError("no CUDA runtime is loaded in this process and the CUDA driver (libcuda.so.1) cannot be "
                          "opened: nothing to copy through")
    try:
        rt = runtime(path)
    except OSError as exc:
        raise DeviceError(str(exc)) from exc
    try:
        # a stream of the ring's own (stream 0), made and destroyed by the ring in its device's
        # context: a framework's pool stream may be shared with other work (torch hands out 32
        # per device round-robin, NCCL's among them), which the ring's copies and its final
        # synchronisation would then wait behind
        ring = _ring.ChunkRing(rt, ops.device_index, 0, g.chunk_bytes, g.chunks, g.threads)
    except RuntimeError as exc:
        raise DeviceError(f"cannot set up the copy ring: {exc}") from exc
    _LIVE.add(ring)
    return ring
