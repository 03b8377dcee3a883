"""A remote file's connections filling the chunk ring: each takes the next chunks from the ring
(which waits, natively, for their slots' previous copies), receives one ranged GET of those
chunks' file blocks (the request size the caller planned) straight into the page-locked chunks
(``recv_into``, GIL released: :mod:`engine.net.remote_reads` with its retries, deadlines, byte
checks and whole-file streams) and marks them filled (:class:`Fillers`); a checked tensor whose
bytes fail their checksum is read again onto the device (:class:`DeviceReread`)."""

from __future__ import annotations

import threading
import time

import numpy as np

from engine.errors import DeviceError
from engine.gpu.chunk_plan import Pieces

__all__ = ["DeviceReread", "Fillers"]


class DeviceReread:
    """A checked tensor of a remote file read again from the server (the pieces the load
    planned for it) into host memory, its CRC-32C taken, and its bytes put on the device
    (:meth:`engine.gpu._ring.ChunkRing.put`): the tracker's ``reread`` after a mismatch.
    Copies of tensor bytes: 2 (socket to host memory, host memory to the device)."""

    def __init__(self, sources, pieces: Pieces, targets, address, ring) -> None:
        self.sources, self.ring = sources, ring
        self.targets, self.address = targets, address
        self.of: dict = {}
        for i, key in enumerate(pieces.keys):
            self.of.setdefault(key, []).append((int(pieces.file[i]), int(pieces.off[i]), int(pieces.len[i]),
                                                pieces.toff[i]))

    def __call__(self, key: int) -> int:
        from engine.format.checksums import crc32c

        pieces = self.of[key]
        host = np.empty(sum(n for _, _, n, _ in pieces), np.uint8)
        view = memoryview(host)
        for f, off, n, at in pieces:
            ranges = self.sources[f].ranges
            getattr(ranges, "fresh", ranges)(off, [view[at : at + n]])  # from the server, not a kept copy
        try:
            self.ring.put(self.address(self.targets[key]), host)
        except RuntimeError as exc:
            raise DeviceError(str(exc), path=self.sources[pieces[0][0]].path) from exc
        return crc32c(host)


#: a gap in the file up to this size between two pieces of one chunk is received (into a
#: scratch buffer) and dropped rather than costing a second request, as
#: :func:`engine.net.views.read_runs` does
_MAX_GAP = 1 << 20


class Fillers:
    """The connections of a remote load, filling the ring's chunks: ``count`` threads, each
    taking the next ``group`` chunks (:meth:`engine.gpu._ring.ChunkRing.take`, which waits
    natively for their slots), receiving their runs of the file with ``ranges(offset,
    views)`` into views of the chunks' page-locked memory (one request per run: ``group``
    chunks of one file make one request of the size the caller planned), and marking them
    filled.  A failed chunk (after the reader's retries) stops the run; the first error that
    is not a consequence of the stop is the load's."""

    def __init__(self, ring, sources, c_file, c_seg, s_pos, s_off, s_len, cancel, count: int,
                 group: int = 1) -> None:
        self.ring = ring
        self.sources = sources
        self.c_file = c_file.tolist()
        self.c_seg = c_seg.tolist()
        self.s_pos, self.s_off, self.s_len = s_pos.tolist(), s_off.tolist(), s_len.tolist()
        self.cancel = cancel
        self.group = max(1, group)
        self.count = max(1, min(count, -(-len(self.c_file) // self.group)))
        self.memory = ring.memory()
        self.chunk_bytes, self.slots = ring.chunk_bytes, ring.chunks
        self.errors: list[tuple[int, BaseException]] = []
        self.lock = threading.Lock()
        self.fill_s = 0.0  # seconds the connections spent receiving chunks, summed
        self.threads: list[threading.Thread] = []

    def start(self) -> int:
        """Start the threads (the ring's run calls it once ready): how many started."""
        for _ in range(self.count):
            t = threading.Thread(target=self._run, name="engine-remote-ring", daemon=True)
            try:
                t.start()
            except RuntimeError:  # no more threads: the ones started carry the load
                break
            self.threads.append(t)
        return len(self.threads)

    def _run(self) -> None:
        ring = self.ring
        scratch: list = []
        busy = 0.0
        try:
            while True:
                k, n = ring.take(self.group)
                if k < 0:
                    break
                t0 = time.perf_counter()
                try:
                    self._chunks(k, n, scratch)
                except BaseException as exc:
                    with self.lock:
                        self.errors.append((k, exc))
                    ring.fail(k)
                    self.cancel.set()  # the other connections stop waiting between their tries
                    return
                finally:
                    busy += time.perf_counter() - t0
                ring.filled(k, n)
        finally:
            with self.lock:
                self.fill_s += busy
            ring.leave()

    def _chunks(self, k: int, n: int, scratch: list) -> None:
        """Receive chunks ``k .. k+n-1``: one ranged GET per run of file-contiguous pieces (a
        small gap received into ``scratch`` and dropped), into the chunks' slots (adjacent
        slots' memory in one view)."""
        cb, slots = self.chunk_bytes, self.slots
        c_seg, c_file, s_pos, s_off, s_len = self.c_seg, self.c_file, self.s_pos, self.s_off, self.s_len
        run: list = []  # the current request: [file, first offset, end offset, spans]
        c = k
        for j in range(c_seg[k], c_seg[k + n]):
            while c_seg[c + 1] <= j:
                c += 1
            f, off, ln = c_file[c], s_off[j], s_len[j]
            a = (c % slots) * cb + s_pos[j]  # where it lands in the ring's memory
            if run and run[0] == f and 0 <= off - run[2] <= _MAX_GAP:
                spans = run[3]
                gap = off - run[2]
                if gap:
                    spans.append([None, gap])
                if not gap and spans[-1][0] is not None and spans[-1][1] == a:
                    spans[-1][1] += ln  # contiguous in the ring too: one view
                else:
                    spans.append([a, a + ln])
                run[2] = off + ln
                continue
            if run:
                self._get(run, scratch)
            run = [f, off, off + ln, [[a, a + ln]]]
        if run:
            self._get(run, scratch)

    def _get(self, run: list, scratch: list) -> None:
        f, start, _, spans = run
        views = []
        for a, b in spans:
            if a is None:
                if not scratch:
                    scratch.append(memoryview(bytearray(_MAX_GAP)))
                views.append(scratch[0][:b])
            else:
                views.append(self.memory[a:b])
        self.sources[f].ranges(start, views)

    def join(self) -> None:
        for t in self.threads:
            t.join()
        self.memory = None

    def error(self) -> BaseException | None:
        """The load's error: the first a connection met that is not the stop itself."""
        from engine.errors import Cancelled

        causes = [e for _, e in self.errors if not isinstance(e, Cancelled)]
        return causes[0] if causes else (self.errors[0][1] if self.errors else None)
