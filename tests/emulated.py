"""An emulated asynchronous device for the pipeline's device paths on CPU (shared by the
tests of the pipeline and of the loads built on it).

Copies run later on a per-stream thread and read their source only then: a staging ring
that reused a slot before its copy finished would corrupt the data, and the tests would
see it.
"""

from __future__ import annotations

import mmap
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


class _Wrapped:
    """A read-only host range handed to the device (the file's mapping)."""

    def __init__(self, view) -> None:
        self.view = view


class EmulatedDevice:
    """DeviceOps whose copies are asynchronous, like cudaMemcpyAsync on a stream.

    Registration emulates page-locking: it is refused past the end of the file (as pinning
    pages beyond EOF is) or where ``refuse(offset, nbytes)`` says so; it takes the bytes
    then (locked pages stay readable whatever happens to the file), and a copy that runs
    after its range was unregistered, or from a range never registered, is recorded in
    ``errors``.
    """

    PAGE = mmap.PAGESIZE

    def __init__(self, delay: float = 0.0005, refuse=None, file_size=None) -> None:
        self.delay = delay
        self.streams: list[_Stream] = []
        self.staging_bytes = 0  # peak of live staging
        self.live_staging: dict[int, int] = {}
        self.registered: dict[tuple[int, int], tuple[int, bytes, list]] = {}
        self.register_calls: list[tuple[int, int, bool]] = []
        self.copies_from: dict[str, int] = {"staging": 0, "mapping": 0}
        self.errors: list[str] = []
        self.refuse = refuse or (lambda off, n: False)
        self.file_size = file_size
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

    def wrap_host(self, view):
        assert view.readonly
        return _Wrapped(view)

    def register(self, handle, offset, nbytes) -> bool:
        with self.lock:
            size = self.file_size() if self.file_size else len(handle.view)
            ok = not self.refuse(offset, nbytes) and offset + nbytes <= -(-size // self.PAGE) * self.PAGE
            for (h, off), (n, _, _) in self.registered.items():
                if h == id(handle) and off < offset + nbytes and offset < off + n:
                    self.errors.append(f"[{offset}, +{nbytes}) overlaps registered [{off}, +{n})")
                    ok = False
            self.register_calls.append((offset, nbytes, ok))
            if ok:
                pinned = bytes(handle.view[offset : min(offset + nbytes, len(handle.view))])
                self.registered[(id(handle), offset)] = (nbytes, pinned, [True])
            return ok

    def unregister(self, handle, offset, nbytes) -> None:
        with self.lock:
            n, _, alive = self.registered.pop((id(handle), offset))
            assert n == nbytes
            alive[0] = False

    def new_stream(self):
        s = _Stream(self.delay)
        with self.lock:
            self.streams.append(s)
        return s

    def copy_to_device(self, dst, dst_offset, src, src_offset, nbytes, stream) -> None:
        if isinstance(src, _Wrapped):
            with self.lock:
                self.copies_from["mapping"] += 1
                hit = [(off, n, pinned, alive) for (h, off), (n, pinned, alive) in self.registered.items()
                       if h == id(src) and off <= src_offset and src_offset + nbytes <= off + n]
            if not hit:
                self.errors.append(f"copy from unregistered bytes at {src_offset}")
                return
            off, _, pinned, alive = hit[0]

            def job():
                time.sleep(random.random() * stream.delay)
                if not alive[0]:
                    self.errors.append(f"range at {off} unregistered before its copy ran")
                dst[dst_offset : dst_offset + nbytes] = pinned[src_offset - off : src_offset - off + nbytes]
        else:
            with self.lock:
                self.copies_from["staging"] += 1

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
        """Nothing left registered or allocated, and no copy saw unlocked memory."""
        assert not self.registered, self.registered.keys()
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
