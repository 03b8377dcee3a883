"""What each load through the chunk ring did: a :class:`LoadRecord` per load, collected by
:func:`load_records` (``engine.load_records``) and logged at DEBUG level."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading

__all__ = ["LoadRecord", "load_records"]


@dataclasses.dataclass(frozen=True)
class LoadRecord:
    """What one load through the chunk ring did (collected by :func:`load_records`).

    Attributes
    ----------
    chunks, bytes : int
        Chunks the load was cut into and tensor bytes it moved.
    chunk_bytes, slots, threads : int
        The ring's geometry; ``threads`` is the copy threads this load woke (0: the calling
        thread filled its one chunk itself), or for remote files its connections.
    seconds : float
        The whole load: planning, mapping, waiting for the ring, its run to the last copy
        completed.
    fill_wait_s : float
        Time the issuing thread waited for copy threads to fill the next chunk (high: the
        host side is the bottleneck, more threads or a faster source help).
    slot_wait_s : float
        Time copy threads waited for a slot's previous copy to complete, summed over threads
        (high: the DMA is the bottleneck, more or larger chunks may help).
    fill_s : float
        Time spent filling chunks, summed over threads (remote files: the connections' time
        receiving them, requests included).
    lock_s, lock_calls : float, int
        Page-locking done during this load (0 for a ring set up before it).
    cold, setup_s : bool, float
        The ring was not ready when this load asked for it (a process's first load, unless
        :func:`~engine.gpu.device_ring.prepare` finished before it), and the seconds the load
        waited for its set-up.
    source, unmap : str
        :func:`engine.io.reader.copy_source` and :func:`~engine.gpu.device_ring.unmap_mode` of
        the load.
    pread_bytes, mmap_bytes, network_bytes : int
        Bytes copied with ``pread``, out of the file's mapping, and received from a server
        into the chunks (``source`` is then ``"network"``).
    pageable : bool
        The runtime refused to page-lock the chunks: copies ran at pageable speed.
    reported, report_s : int, float
        Tensors reported landed, and the seconds the issuing thread spent reporting them
        (with the GIL, in its polls): for a load with device kernels (``stats=True``,
        ``quantize="int8"``) this includes launching each landed tensor's kernels.
    hooked : bool
        The load had device kernels to launch as tensors landed.
    """

    chunks: int
    bytes: int
    chunk_bytes: int
    slots: int
    threads: int
    seconds: float
    fill_wait_s: float
    slot_wait_s: float
    fill_s: float
    lock_s: float
    lock_calls: int
    cold: bool
    setup_s: float
    source: str
    unmap: str
    pread_bytes: int
    mmap_bytes: int
    pageable: bool
    network_bytes: int = 0
    reported: int = 0
    report_s: float = 0.0
    hooked: bool = False

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in _RECORD_FIELDS}


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(LoadRecord))
# the logger the README names: the records kept the name of the module they came from
_LOG = logging.getLogger("engine.gpu.device_ring")
_RECORDERS: list[list] = []
_RECORDERS_LOCK = threading.Lock()


@contextlib.contextmanager
def load_records():
    """Collect a :class:`LoadRecord` for every load through the chunk ring (any thread)
    while the block runs::

        with engine.load_records() as records:
            engine.torch.load_file(path, device="cuda:0")
        print(records[-1].as_dict())

    Every record is also logged at DEBUG level on the ``engine.gpu.device_ring`` logger.
    """
    out: list[LoadRecord] = []
    with _RECORDERS_LOCK:
        _RECORDERS.append(out)
    try:
        yield out
    finally:
        with _RECORDERS_LOCK:
            for i, r in enumerate(_RECORDERS):
                if r is out:
                    del _RECORDERS[i]
                    break


def publish(record: LoadRecord) -> None:
    """Hand ``record`` to every :func:`load_records` block open now, and to the log."""
    with _RECORDERS_LOCK:
        for r in _RECORDERS:
            r.append(record)
    if _LOG.isEnabledFor(logging.DEBUG):
        _LOG.debug("ring load: %s", record.as_dict())


def _after_fork() -> None:
    """In a forked child: a lock of its own (a parent's thread may have held this one at the fork)."""
    global _RECORDERS_LOCK
    _RECORDERS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
