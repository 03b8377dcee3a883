"""The threaded chunked pipeline: requests -> worker threads -> destinations.

Worker threads take read requests (see :func:`engine.plan.plan_reads`) in file order.

* Host destinations (numpy arrays, CPU torch tensors) are filled straight from the file:
  each piece of a request is a slice of its tensor's memory and one ``preadv`` scatters the
  request into them.  No staging, one copy (page cache to destination).
* Device destinations (CUDA) go through a ring of staging slots per worker, in pinned host
  memory allocated once per load: a worker reads a request into a free slot, issues
  asynchronous host-to-device copies on its own stream and records an event; the slot is
  reused only once that event has completed, so disk reads and PCIe copies overlap.  Host
  staging memory is ``threads * slots * chunk_bytes``, whatever the model's size.

A tensor is *complete* when every byte of it has landed (for a device: when the events of
all its copies have completed); completions are reported through a callback as they happen,
which is what :func:`engine.stream` yields from.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Protocol, Sequence

from .errors import SafetensorError
from .plan import Request
from .reader import pread_into, run_threads

__all__ = ["DeviceOps", "Destination", "run", "Cancelled"]


class Cancelled(SafetensorError):
    """The load was stopped by its consumer (an early ``break`` out of ``stream()``)."""


class DeviceOps(Protocol):
    """What the pipeline needs from a device framework (torch CUDA, CuPy, or a test double)."""

    def alloc_staging(self, nbytes: int):
        """A pinned host buffer; returns ``(handle, writable memoryview)``."""

    def new_stream(self): ...

    def copy_to_device(self, dst, dst_offset: int, src_handle, src_offset: int, nbytes: int, stream) -> None:
        """Asynchronously copy ``nbytes`` from the staging buffer to byte ``dst_offset`` of ``dst``."""

    def record(self, stream):
        """An event that completes when everything issued on ``stream`` so far is done."""

    def wait(self, event) -> None:
        """Block (without the GIL) until ``event`` completes."""

    def bind_thread(self) -> None:
        """Make the device current in a worker thread."""


class Destination:
    """Where each selected tensor's bytes go.

    Parameters
    ----------
    host_views : dict of row -> writable byte memoryview, optional
        For host destinations.
    device_targets : dict of row -> device byte buffer, optional
        For device destinations, with ``device_ops``.
    device_ops : DeviceOps, optional
    """

    def __init__(self, host_views=None, device_targets=None, device_ops: Optional[DeviceOps] = None) -> None:
        if (host_views is None) == (device_targets is None):
            raise ValueError("give exactly one of host_views and device_targets")
        if device_targets is not None and device_ops is None:
            raise ValueError("device destinations need device_ops")
        self.host_views = host_views
        self.device_targets = device_targets
        self.device_ops = device_ops

    @property
    def on_device(self) -> bool:
        return self.device_targets is not None


class _Tracker:
    """Outstanding bytes per tensor; reports each tensor once, when its last byte lands."""

    def __init__(self, requests: Sequence[Request], on_complete: Optional[Callable[[int], None]]) -> None:
        self.remaining: dict[int, int] = {}
        for req in requests:
            for p in req.pieces:
                self.remaining[p.row] = self.remaining.get(p.row, 0) + p.nbytes
        self.on_complete = on_complete
        self.lock = threading.Lock()

    def landed(self, pieces) -> None:
        done = []
        with self.lock:
            for p in pieces:
                left = self.remaining[p.row] - p.nbytes
                self.remaining[p.row] = left
                if left == 0:
                    done.append(p.row)
        if self.on_complete is not None:
            for row in done:
                self.on_complete(row)


def run(
    fd: int,
    requests: Sequence[Request],
    dest: Destination,
    *,
    path: Optional[str] = None,
    threads: int = 2,
    slots: int = 2,
    chunk_bytes: int,
    on_complete: Optional[Callable[[int], None]] = None,
    cancel: Optional[threading.Event] = None,
    fill: Optional[Callable[[int, Request, list], None]] = None,
    after_copy: Optional[Callable[[Request, object], None]] = None,
) -> int:
    """Execute ``requests`` into ``dest`` on ``threads`` worker threads; returns bytes read.

    ``fill(fd, request, targets)``, if given, replaces the plain read of each request: it
    must fill ``targets`` (one writable host memoryview per piece of ``request``; for
    devices, parts of the staging slot) with the request's bytes or raise.  It runs on the
    worker thread, before the pieces are copied to a device or reported complete: the place
    for work that must see the bytes while they are still in the CPU cache, such as
    statistics (see ``engine.loader``).

    ``after_copy(request, stream)``, if given, runs on a device worker right after the
    request's host-to-device copies are issued, before the event that frees the staging
    slot is recorded: work it queues on ``stream`` (kernels reading the bytes where they
    landed, see ``engine.onload``) is ordered after the copies and complete when the
    tensor is reported complete.

    Raises the first worker error (a :class:`~engine.errors.ReadError` names the file,
    offset and size) after every worker has stopped; raises :class:`Cancelled` when
    ``cancel`` is set.  No thread outlives the call, and staging buffers are released when
    it returns.

    Notes
    -----
    Copies of tensor bytes: host destinations 1 (page cache to tensor); device destinations
    2 (page cache to pinned slot, slot to device by DMA).
    """
    cancel = cancel or threading.Event()
    tracker = _Tracker(requests, on_complete)
    lock = threading.Lock()
    next_index = [0]
    total = sum(r.nbytes for r in requests)
    if not requests:
        return 0
    threads = max(1, min(threads, len(requests)))

    def take() -> Optional[Request]:
        with lock:
            i = next_index[0]
            if i >= len(requests) or cancel.is_set():
                return None
            next_index[0] = i + 1
        return requests[i]

    def host_worker() -> None:
        views = dest.host_views
        while (req := take()) is not None:
            targets = [views[p.row][p.tensor_offset : p.tensor_offset + p.nbytes] for p in req.pieces]
            if fill is None:
                pread_into(fd, req.offset, targets, path=path)
            else:
                fill(fd, req, targets)
            tracker.landed(req.pieces)

    def device_worker() -> None:
        ops = dest.device_ops
        ops.bind_thread()
        stream = ops.new_stream()
        ring = [ops.alloc_staging(chunk_bytes) for _ in range(max(1, slots))]
        in_flight: list = [None] * len(ring)  # (event, pieces) per slot
        k = 0
        try:
            while (req := take()) is not None:
                slot = k % len(ring)
                k += 1
                if in_flight[slot] is not None:  # the slot's last copy must finish first
                    event, pieces = in_flight[slot]
                    ops.wait(event)
                    in_flight[slot] = None
                    tracker.landed(pieces)
                handle, view = ring[slot]
                if fill is None:
                    pread_into(fd, req.offset, [view[: req.nbytes]], path=path)
                else:
                    fill(fd, req, [view[p.request_offset : p.request_offset + p.nbytes] for p in req.pieces])
                targets = dest.device_targets
                for p in req.pieces:
                    ops.copy_to_device(targets[p.row], p.tensor_offset, handle, p.request_offset, p.nbytes, stream)
                if after_copy is not None:
                    after_copy(req, stream)
                in_flight[slot] = (ops.record(stream), req.pieces)
        finally:
            # drain: every issued copy completes before its staging slot is released
            for item in in_flight:
                if item is not None:
                    ops.wait(item[0])
                    if not cancel.is_set():
                        tracker.landed(item[1])

    body = device_worker if dest.on_device else host_worker
    run_threads([body] * threads, on_error=cancel.set)
    if cancel.is_set():
        raise Cancelled("the load was cancelled", reason="Cancelled", path=path)
    return total
