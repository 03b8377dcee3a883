"""An emulated asynchronous device for the pipeline's device paths on CPU (shared by the
tests of the pipeline and of the loads built on it).

Copies run later on a per-stream thread and read their source only then: a staging ring
that reused a slot before its copy finished would corrupt the data, and the tests would
see it.
"""

from __future__ import annotations

import queue
import random
import threading
import time


class _Stream:
    def __init__(self, delay: float) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.delay = delay
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.q.get()) is not None:
            job()

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()


class EmulatedDevice:
    """DeviceOps of the slot path whose copies are asynchronous, like cudaMemcpyAsync on a
    stream (the chunk ring runs against the emulated CUDA runtime in C, ``tests/emucudart``)."""

    def __init__(self, delay: float = 0.0005) -> None:
        self.delay = delay
        self.streams: list[_Stream] = []
        self.staging_bytes = 0  # peak of live staging
        self.live_staging: dict[int, int] = {}
        self.copies = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def bind_thread(self) -> None:
        pass

    def alloc_staging(self, nbytes):
        buf = bytearray(nbytes)
        with self.lock:
            self.live_staging[id(buf)] = nbytes
            self.staging_bytes = max(self.staging_bytes, sum(self.live_staging.values()))
        return buf, memoryview(buf)

    def free_staging(self, handle) -> None:
        with self.lock:
            del self.live_staging[id(handle)]

    def new_stream(self):
        s = _Stream(self.delay)
        with self.lock:
            self.streams.append(s)
        return s

    def copy_to_device(self, dst, dst_offset, src, src_offset, nbytes, stream) -> None:
        with self.lock:
            self.copies += 1
            if id(src) not in self.live_staging:
                self.errors.append("a copy from a buffer that is not a live staging slot")

        def job():
            time.sleep(random.random() * stream.delay)
            dst[dst_offset : dst_offset + nbytes] = src[src_offset : src_offset + nbytes]

        stream.q.put(job)

    def record(self, stream):
        event = threading.Event()
        stream.q.put(event.set)
        return event

    def wait(self, event) -> None:
        event.wait()

    def close(self) -> None:
        for s in self.streams:
            s.close()

    def assert_clean(self) -> None:
        """Nothing left allocated, and every copy read a live staging slot."""
        assert not self.live_staging
        assert not self.errors, self.errors[:3]


class EmulatedSink:
    """A device sink over :class:`EmulatedDevice` (``ops``, a new one by default): raw bytes
    per tensor; records each allocation's number of tensors."""

    name = "emulated"
    on_device = True

    def __init__(self, ops=None) -> None:
        self.ops = ops if ops is not None else EmulatedDevice()
        self.allocations: list[int] = []

    def allocate_device(self, specs, per_tensor=False):
        self.allocations.append(len(specs))
        targets = {key: bytearray(nbytes) for key, _, _, nbytes in specs}
        return dict(targets), targets, self.ops
