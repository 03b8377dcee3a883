# cython: language_level=3, embedsignature=True
# distutils: language = c
#
# Bounds/wraparound checks and cdivision are set once in setup.py (ENGINE_CYTHON_CHECKS=1
# turns them on).
"""The device copy ring, natively: file bytes through small page-locked chunks to a device.

Private: the public face is :mod:`engine.gpu.rings`, which sets rings up and keeps them between
loads; :mod:`engine.gpu.device_ring` runs a load through one and turns the error tuples
returned here into the engine's errors.

A ring holds ``chunks`` page-locked host chunks of ``chunk_bytes`` each and ``threads``
native copy threads (their loop, and the issuing thread's: :mod:`engine.gpu._copy_loop`, on the
state set up here).  Chunk ``k`` of a load goes through slot ``k % chunks``: a copy thread
takes the next chunk on its own (a shared counter, no barrier), waits until that slot's
previous copy to the device has completed (its event), fills it from the page cache (``pread``
or a populated mapping, whichever that thread measures faster: :mod:`engine.io._io`'s
``_copy_piece``, SIGBUS-guarded) and unmaps what it mapped; the calling thread issues each
chunk's ``cudaMemcpyAsync`` in chunk order as soon as it is full and records the slot's event.
No Python runs per chunk: the calling thread takes the GIL only every ``poll_seconds`` to report
progress and see a cancel.

A run may instead be filled by the caller's threads (``run(fillers=...)``: a remote file's
connections, each receiving a ranged GET straight into the chunk): each takes the next chunk
with :meth:`ChunkRing.take` (the same native wait for the slot as a copy thread's, GIL
released), writes it through :meth:`ChunkRing.memory` and reports it with
:meth:`ChunkRing.filled` or :meth:`ChunkRing.fail`; the issuing side is the same.

The CUDA runtime is not linked: it is called through a :class:`engine.gpu._cudart.Runtime`'s
table of entry points, and a thread the engine does not own gets the ring's device's primary
context pushed around the ring's calls (:mod:`engine.gpu._cudart`), its own context and device
left as they were.  "Not ready" from an event query is cleared from the thread's last error at
once, as torch does, so the caller's next check of ``cudaGetLastError`` does not see it.  A
run's first copy waits (``cudaStreamWaitEvent``) for the consumer's fence: an event its
framework recorded on the caller's current stream when the load was set up, on the caller's
thread.
"""

from cpython.buffer cimport PyBUF_WRITE
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free

from engine.gpu._copy_loop cimport (
    _ERR_CUDA, _ERR_FILL, _ERR_NONE, _ERR_READ, _State, _Worker, _block_hi, _block_lo, _block_of, _claim,
    _digest_filled, _fail, _fill, _issue, _lock_block, _part_for, _stopped, _take_n, _worker_main,
)
from engine.gpu._cudart cimport (
    Runtime, _Saved, _cudaEventDisableTiming, _cudaMemcpyHostToDevice, _cudaStreamNonBlocking, _enter, _leave,
)
from engine.io._io cimport (
    _Choice, _Part, _guard_ready, _seconds, pthread_cond_broadcast, pthread_cond_destroy, pthread_cond_init,
    pthread_cond_signal, pthread_create, pthread_join, pthread_mutex_destroy, pthread_mutex_init,
    pthread_mutex_lock, pthread_mutex_unlock, pthread_t,
)


cdef extern from "<sys/mman.h>" nogil:
    void* mmap(void* addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void* addr, size_t length)
    int madvise(void* addr, size_t length, int advice)
    int PROT_READ
    int PROT_WRITE
    int MAP_PRIVATE
    int MAP_ANONYMOUS
    void* MAP_FAILED

cdef enum:
    _MADV_DONTFORK = 10
    _MADV_HUGEPAGE = 14

cdef size_t _HUGE = 2 << 20


cdef class ChunkRing:
    """``chunks`` page-locked chunks of ``chunk_bytes`` and ``threads`` native copy threads on
    one device and stream of a :class:`Runtime`; :meth:`run` moves one load through them.

    The chunks are one anonymous mapping (huge pages where the kernel offers them; a forked
    child inherits none of it), page-locked in blocks (slot 0, then blocks twice the size of
    the one before: 6 calls for 32 chunks) by the copy thread that first fills a slot of the
    block, or all at once ahead of the first load by :meth:`lock_all`, and unlocked by
    :meth:`close`, which also joins the threads and destroys the events.  One run at a time.
    """

    cdef Runtime runtime
    cdef _State* st
    cdef _Worker* workers
    cdef pthread_t* tids
    cdef int nthreads
    cdef size_t nbytes
    cdef size_t mapped
    cdef void* mem
    cdef bint busy
    cdef int64_t last_chunks
    cdef int64_t tally0[2]
    cdef int64_t net0
    cdef int last_threads
    cdef object stream_owner
    cdef bint own_stream
    cdef object __weakref__

    def __cinit__(self, Runtime runtime, int device, uintptr_t stream, int64_t chunk_bytes, int chunks,
                  int threads, object stream_owner=None):
        # ``stream`` 0: a stream of the ring's own, made here (non-blocking) and destroyed by
        # close(); else a caller's stream (``stream_owner`` keeps its owner alive)
        cdef int i, rc = 0
        cdef void* mem
        cdef _Saved saved
        if chunk_bytes < 4096 or chunk_bytes % 4096:
            raise ValueError("chunk_bytes must be a positive multiple of 4096")
        if chunks < 1 or threads < 1 or threads > 256:
            raise ValueError("chunks must be >= 1 and threads in [1, 256]")
        self.runtime = runtime
        self.stream_owner = stream_owner  # keeps the framework's stream object alive
        self.nbytes = <size_t>chunk_bytes * chunks
        self.st = <_State*>calloc(1, sizeof(_State))
        if self.st == NULL:
            raise MemoryError()
        self.st.rt = &runtime.rt
        self.st.device = device
        self.st.stream = <void*>stream
        self.st.chunk_bytes = chunk_bytes
        self.st.nslots = chunks
        self.st.nblocks = _block_of(chunks - 1) + 1
        self.st.blocks = <uint8_t*>calloc(self.st.nblocks, 1)
        self.st.events = <void**>calloc(chunks, sizeof(void*))
        self.st.filled = <int64_t*>calloc(chunks, sizeof(int64_t))
        # one more than the threads: the issuing thread fills a one-chunk run itself
        self.st.choices = <_Choice*>calloc(threads + 1, sizeof(_Choice))
        self.st.fill_s = <double*>calloc(threads + 1, sizeof(double))
        self.tids = <pthread_t*>calloc(threads, sizeof(pthread_t))
        self.workers = <_Worker*>calloc(threads, sizeof(_Worker))
        pthread_mutex_init(&self.st.lock, NULL)
        pthread_cond_init(&self.st.filled_cond, NULL)
        pthread_cond_init(&self.st.issued_cond, NULL)
        pthread_cond_init(&self.st.run_cond, NULL)
        pthread_cond_init(&self.st.lock_cond, NULL)
        if (self.st.blocks == NULL or self.st.events == NULL or self.st.filled == NULL
                or self.st.choices == NULL or self.st.fill_s == NULL or self.tids == NULL
                or self.workers == NULL):
            self.close()
            raise MemoryError()
        # 2 MiB more, so that the chunks start on a huge page's line: fewer pages to lock and to
        # translate for the DMA engine, where the kernel backs the mapping with huge pages
        self.mapped = self.nbytes + _HUGE
        mem = mmap(NULL, self.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if mem == MAP_FAILED:
            self.close()
            raise MemoryError(f"cannot map {self.nbytes} bytes for the ring's chunks")
        self.mem = mem
        self.st.base = <uint8_t*>((<uintptr_t>mem + _HUGE - 1) & ~(<uintptr_t>_HUGE - 1))
        madvise(self.st.base, self.nbytes, _MADV_HUGEPAGE)
        # a forked child gets none of the chunks: where a kernel or driver does not copy
        # page-locked pages at fork, the parent's next writes would land in copies made for the
        # child while the DMA reads the originals (the child cannot use the ring anyway)
        if madvise(mem, self.mapped, _MADV_DONTFORK) != 0:
            self.close()
            raise RuntimeError("cannot keep the ring's chunks out of forked children (madvise MADV_DONTFORK)")
        try:
            self.st.ctx = <void*><uintptr_t>runtime.primary_context(device)
        except RuntimeError:
            self.close()
            raise
        with nogil:
            rc = _enter(&runtime.rt, self.st.ctx, &saved)
            if rc == 0 and stream == 0:
                rc = runtime.rt.stream_create(&self.st.stream, _cudaStreamNonBlocking)
                if rc == 0:
                    self.own_stream = True
                else:
                    self.st.stream = NULL
            if rc == 0:
                for i in range(chunks):
                    rc = runtime.rt.event_create(&self.st.events[i], _cudaEventDisableTiming)
                    if rc != 0:
                        self.st.events[i] = NULL
                        break
            if rc != 0:
                runtime.rt.get_last_error()
            _leave(&runtime.rt, &saved)
        if rc != 0:
            self.close()
            raise RuntimeError(f"setting up the ring's stream and events on device {device} failed: "
                               f"{runtime.error_string(rc)} ({rc})")
        for i in range(threads):
            self.workers[i].st = self.st
            self.workers[i].index = i
            if pthread_create(&self.tids[i], NULL, _worker_main, &self.workers[i]) != 0:
                break
            self.nthreads += 1
        if self.nthreads == 0:
            self.close()
            raise RuntimeError("cannot start the ring's copy threads")

    @property
    def threads(self) -> int:
        return self.nthreads

    @property
    def chunk_bytes(self) -> int:
        return self.st.chunk_bytes if self.st != NULL else 0

    @property
    def chunks(self) -> int:
        return self.st.nslots if self.st != NULL else 0

    @property
    def locked_bytes(self) -> int:
        """Host bytes of the chunks page-locked now."""
        cdef int b
        cdef int64_t n = 0
        if self.st == NULL:
            return 0
        for b in range(self.st.nblocks):
            if self.st.blocks[b] == 2:
                n += (_block_hi(b, self.st.nslots) - _block_lo(b)) * self.st.chunk_bytes
        return n

    def lock_all(self) -> tuple:
        """Page-lock every block not locked yet (GIL released), ahead of a first load, so
        that the load pays nothing for it.  Returns ``(seconds, calls)`` this took."""
        cdef _State* st = self.st
        cdef int b
        cdef double t0
        cdef int calls, rc = 0
        cdef _Saved saved
        if st == NULL:
            raise ValueError("the ring is closed")
        if self.busy:
            raise RuntimeError("the ring is loading")
        calls = st.lock_calls
        t0 = _seconds()
        self.busy = True
        try:
            with nogil:
                rc = _enter(st.rt, st.ctx, &saved)
                if rc == 0:
                    for b in range(st.nblocks):
                        _lock_block(st, b)
                _leave(st.rt, &saved)
        finally:
            self.busy = False
        if rc != 0:
            raise RuntimeError(f"cannot make device {st.device} current to page-lock the ring (CUDA driver error {rc})")
        return (_seconds() - t0, st.lock_calls - calls)

    @property
    def last_run(self) -> dict:
        """What the last run did: ``chunks``; ``threads`` (copy threads it woke; 0 when the
        issuing thread filled its one chunk itself); ``fill_wait_s`` (the issuing thread waiting
        for fills); ``slot_wait_s`` (copy threads waiting for a slot's copy, summed);
        ``fill_s`` (seconds filling chunks, summed over threads); ``lock_s`` and
        ``lock_calls`` (page-locking done during the run); ``pread_bytes`` and
        ``mmap_bytes`` (bytes filled with each source); ``net_bytes`` (bytes external fillers
        filled: a remote file's connections)."""
        cdef _State* st = self.st
        cdef int i
        cdef double fill = 0
        if st == NULL:
            return {}
        for i in range(self.nthreads + 1):
            fill += st.fill_s[i]
        return {"chunks": self.last_chunks, "threads": self.last_threads, "fill_wait_s": st.wait_fill,
                "slot_wait_s": st.wait_slot, "fill_s": fill, "lock_s": st.lock_s,
                "lock_calls": st.lock_calls, "pread_bytes": self._tally(0) - self.tally0[0],
                "mmap_bytes": self._tally(1) - self.tally0[1], "net_bytes": st.net_bytes - self.net0}

    cdef int64_t _tally(self, int source):
        cdef int k
        cdef int64_t n = 0
        for k in range(self.nthreads + 1):
            n += self.st.choices[k].nbytes[source]
        return n

    @property
    def pageable(self) -> bool:
        """Whether the runtime refused to page-lock a chunk (copies then run at pageable speed)."""
        return self.st != NULL and self.st.locked_refused != 0

    def run(self, const int32_t[::1] c_file, const int64_t[::1] c_seg, const int64_t[::1] s_pos,
            const int64_t[::1] s_off, const int64_t[::1] s_len, const uint64_t[::1] s_dst,
            const int32_t[::1] fds, const uint64_t[::1] maps, const int64_t[::1] map_lens,
            const uint8_t[::1] keeps, object poll=None, double poll_seconds=0.05, bint adaptive=True,
            bint stream_stores=True, int fillers=0, object start=None, const int64_t[::1] d_off=None,
            const int64_t[::1] d_len=None, const int64_t[::1] d_first=None, const int64_t[::1] d_cell=None,
            uint32_t[::1] cells=None, object wait_for=None):
        """Move one planned load (see :func:`engine.gpu._chunk_plan.plan`) through the ring, GIL released.

        ``poll(done)``, when given, runs every ``poll_seconds`` on this thread with the GIL
        (``done``: chunks whose copies have certainly completed, a prefix: their events asked,
        never inferred from chunks still being filled), also while the run waits for its
        last copies once every chunk is issued; it returns True to
        cancel, or raises (the run stops and the exception propagates once every issued
        copy has completed).  Signals are checked there too (Ctrl-C stops a load).
        ``adaptive``: each thread measures whether ``pread`` or the mapping is faster (else
        files with a mapping are always copied out of it).  ``stream_stores``: copies out of a
        mapping store past the caches (else through them, for rings that fit the last-level
        cache).

        A run of one chunk is filled by the calling thread itself, and a run of fewer chunks
        than threads wakes only as many threads as it has chunks (a loop of small loads, such
        as ``get_tensor`` per key, wakes no copy thread).

        ``fillers``: the chunks are filled by that many threads of the caller's instead (a
        remote file's connections), and no copy thread wakes.  ``start()`` runs once on this
        thread, with the GIL, when the run is ready to be filled: it starts the fillers and
        returns how many it started (each of them loops ``k, n = take(most)`` while ``k >= 0``,
        writes chunk ``k + i`` at ``memory()[((k + i) % chunks) * chunk_bytes:]`` and calls
        ``filled(k, n)``, or ``fail(k)`` and stops; then ``leave()`` once, whatever happened).
        The run returns only when every filler has left.  The files' descriptors and
        mappings are not read then.
        With ``cells`` (and ``d_off``, ``d_len``, ``d_first``, ``d_cell``: the pieces sorted
        by file and offset, each file's range of them, each piece's first cell), the copy
        threads take the CRC-32C of each piece's share of each chunk right after filling it
        (stored through the caches then), into ``cells``.

        ``wait_for``: the consumer's fence (a ``cudaEvent_t`` recorded on the caller's current
        stream when the load was set up): the run's copies wait for it (``cudaStreamWaitEvent``
        on the ring's stream), so that a kernel still writing the targets, or a freed block's
        last user, runs first.

        The calling thread's current device and context are left as they were.

        Returns ``(kind, code, chunk, at, missing)``: kind 0 on success, 1 a read failed
        (``code`` errno or -1 for the end of the file, ``at``/``missing`` where), 2 the
        runtime failed (``code`` its error, ``chunk`` the chunk); 3 cancelled; 5 a filler
        failed (``chunk``: the lowest chunk whose filler called ``fail``).  Whatever
        happens, every issued copy has completed (or failed) when it returns.
        """
        cdef _State* st = self.st
        cdef int64_t n = c_file.shape[0], j
        cdef int rc = 0, kind, seats, i, started = 0
        cdef bint inline, fenced = wait_for is not None
        cdef uintptr_t fence = <uintptr_t>wait_for if wait_for is not None else 0
        cdef _Saved saved
        cdef _Part part
        cdef double t0
        cdef list raised = []  # what start() or the poll raised: raised once every copy completed
        if st == NULL:
            raise ValueError("the ring is closed")
        if self.busy:
            raise RuntimeError("one run at a time per ring")
        if c_seg.shape[0] != n + 1 or s_off.shape[0] != s_len.shape[0] or s_pos.shape[0] != s_len.shape[0] \
                or s_dst.shape[0] != s_len.shape[0] or maps.shape[0] != fds.shape[0] \
                or map_lens.shape[0] != fds.shape[0] or keeps.shape[0] != fds.shape[0]:
            raise ValueError("the plan's arrays do not agree")
        if fillers < 0 or (fillers and start is None):
            raise ValueError("fillers need a start() that starts them")
        if n == 0:
            return (0, 0, 0, 0, 0)
        for j in range(n):
            if c_file[j] < 0 or c_file[j] >= fds.shape[0] or c_seg[j] > c_seg[j + 1] or c_seg[j] < 0:
                raise ValueError("a chunk names no file or segments")
        if c_seg[n] > s_len.shape[0]:
            raise ValueError("the chunks name more segments than the plan has")
        for j in range(s_len.shape[0]):
            if s_pos[j] < 0 or s_len[j] < 0 or s_pos[j] + s_len[j] > st.chunk_bytes or s_off[j] < 0:
                raise ValueError("a segment does not fit its chunk")
        if cells is not None:
            if d_off is None or d_len is None or d_first is None or d_cell is None \
                    or d_len.shape[0] != d_off.shape[0] or d_cell.shape[0] != d_off.shape[0] \
                    or d_first.shape[0] != fds.shape[0] + 1 or d_first[fds.shape[0]] > d_off.shape[0]:
                raise ValueError("the checksum arrays do not agree")
            for j in range(fds.shape[0]):
                if d_first[j] < 0 or d_first[j] > d_first[j + 1]:
                    raise ValueError("the checksum arrays do not agree")
            for j in range(d_off.shape[0]):
                if d_len[j] <= 0 or d_cell[j] < 0 or d_cell[j] + (d_off[j] + d_len[j] - 1) // st.chunk_bytes \
                        - d_off[j] // st.chunk_bytes >= cells.shape[0]:
                    raise ValueError("a piece's checksum cells do not fit")
        for j in range(fds.shape[0]):
            if maps[j] != 0 and _guard_ready() != 0:
                raise OSError("cannot install the SIGBUS guard of mapped copies")
        self.busy = True
        # one chunk: the calling thread fills it (no thread to wake, nothing to wait for)
        inline = n == 1 and not fillers
        seats = 0 if inline or fillers else (self.nthreads if n >= self.nthreads else <int>n)
        self.last_chunks = n
        self.last_threads = seats
        self.tally0[0] = self._tally(0)
        self.tally0[1] = self._tally(1)
        self.net0 = st.net_bytes
        try:
            st.plan.nchunks = n
            st.plan.c_file = &c_file[0]
            st.plan.c_seg = &c_seg[0]
            st.plan.s_pos = &s_pos[0] if s_pos.shape[0] else NULL
            st.plan.s_off = &s_off[0] if s_off.shape[0] else NULL
            st.plan.s_len = &s_len[0] if s_len.shape[0] else NULL
            st.plan.s_dst = &s_dst[0] if s_dst.shape[0] else NULL
            st.plan.fds = &fds[0]
            st.plan.maps = &maps[0]
            st.plan.map_lens = &map_lens[0]
            st.plan.keeps = &keeps[0]
            st.plan.cells = NULL
            if cells is not None and d_off.shape[0]:
                st.plan.d_off = &d_off[0]
                st.plan.d_len = &d_len[0]
                st.plan.d_first = &d_first[0]
                st.plan.d_cell = &d_cell[0]
                st.plan.cells = &cells[0]
            with nogil:
                rc = _enter(st.rt, st.ctx, &saved)
                if rc == 0 and fenced:
                    # before any copy: the work the consumer had queued when the load was set up
                    rc = st.rt.stream_wait_event(st.stream, <void*>fence, 0)
                pthread_mutex_lock(&st.lock)
                for j in range(st.nslots):
                    st.filled[j] = -1
                st.next_chunk = 0
                st.issued = 0
                st.cancel = 0
                st.err_kind = _ERR_NONE
                st.err_code = 0
                st.wait_slot = 0
                st.wait_fill = 0
                st.lock_s = 0
                st.lock_calls = 0
                for i in range(self.nthreads + 1):
                    st.fill_s[i] = 0
                st.adaptive = adaptive
                st.stream_stores = stream_stores
                st.external = fillers > 0
                st.active = seats + fillers
                st.seats = seats
                if seats:
                    st.generation += 1
                    if seats == self.nthreads:
                        pthread_cond_broadcast(&st.run_cond)
                    else:
                        for i in range(seats):
                            pthread_cond_signal(&st.run_cond)
                pthread_mutex_unlock(&st.lock)
                if fillers:
                    if rc == 0:
                        with gil:
                            try:
                                started = start()
                            except BaseException as exc:  # start() counts its own threads: none here
                                raised.append(exc)
                    if started < fillers:
                        # the fillers that never started never leave: counted out here
                        pthread_mutex_lock(&st.lock)
                        st.active -= fillers - (started if started > 0 else 0)
                        pthread_cond_broadcast(&st.run_cond)
                        pthread_mutex_unlock(&st.lock)
                    if raised or (rc == 0 and started < 1):
                        _fail(st, 4, 0, 0, 0, 0)
                if rc != 0:
                    st.rt.get_last_error()
                    _fail(st, _ERR_CUDA, rc, 0, 0, 0)
                elif inline:
                    # slot 0 is free: the last run's copies completed before it returned
                    if st.blocks[0] != 2 and not st.locked_refused:
                        _lock_block(st, 0)
                    _part_for(st, &part, self.nthreads)
                    t0 = _seconds()
                    rc = _fill(st, &part, 0, st.base, &st.choices[self.nthreads])
                    st.fill_s[self.nthreads] += _seconds() - t0
                    if rc:
                        _fail(st, _ERR_READ, rc, 0, part.at, part.missing)
                    else:
                        st.filled[0] = 0
                    rc = 0
                _issue(st, n, poll, poll_seconds, raised)
                _leave(st.rt, &saved)
                st.plan.nchunks = 0
                st.external = 0
        finally:
            self.busy = False
        if raised:
            raise raised[0]
        kind = st.err_kind
        if kind == 4:
            return (3, 0, st.err_chunk, 0, 0)
        return (kind, st.err_code, st.err_chunk, st.err_at, st.err_missing)

    # -- external fillers (a run with ``fillers``): see :meth:`run` ---------------------------------

    def take(self, int most=1) -> tuple:
        """The next chunks for an external filler to fill, ``(k, n)``: chunks ``k .. k+n-1``
        (``n`` at most ``most``, at most half the ring's chunks), their slots ready (each
        slot's previous copy completed; on first use, page-locked); ``(-1, 0)`` when no
        chunk is left or the run stopped (an error, a cancel).  Several chunks at once let one
        request fill them (consecutive slots are adjacent in memory but where the ring wraps).
        Waits with the GIL released."""
        cdef _State* st = self.st
        cdef int64_t k = -1, n = 0, i
        cdef int rc
        if st == NULL or not self.busy:
            return (-1, 0)
        if most < 1:
            raise ValueError("take at least one chunk")
        # a filler holds its chunks unfilled while it claims the next one's slot: no more than
        # half the ring, so that it never waits for a slot only it can free
        most = min(most, max(1, st.nslots // 2))
        with nogil:
            if st.external and not _stopped(&st.cancel):
                # the slots' events are asked, and their blocks page-locked, on the ring's device
                # (a filler is a thread of the engine's own, remote_fill.Fillers'; cheap when set)
                rc = st.rt.set_device(st.device)
                if rc != 0:  # the run's error, not a later call's "no context"
                    st.rt.get_last_error()
                    _fail(st, _ERR_CUDA, rc, 0, 0, 0)
                    k = st.plan.nchunks
                else:
                    k = _take_n(&st.next_chunk, most)
                if k >= st.plan.nchunks:
                    k = -1
                else:
                    n = st.plan.nchunks - k
                    if n > most:
                        n = most
                    for i in range(n):
                        if _claim(st, k + i):
                            k = -1
                            break
        if k < 0:
            return (-1, 0)
        return (k, n)

    def filled(self, int64_t k, int64_t n=1) -> None:
        """Chunks ``k .. k+n-1`` (from :meth:`take`) are full: their copies may be issued."""
        cdef _State* st = self.st
        cdef int64_t nbytes = 0, j, i
        if st == NULL or not self.busy or not st.external or n < 1 or not 0 <= k or k + n > st.plan.nchunks \
                or n > st.nslots:
            raise ValueError(f"chunks {k} to {k + n - 1} are not being filled")
        for j in range(st.plan.c_seg[k], st.plan.c_seg[k + n]):
            nbytes += st.plan.s_len[j]
        with nogil:
            if st.plan.cells != NULL:
                for i in range(k, k + n):
                    _digest_filled(st, i)
            pthread_mutex_lock(&st.lock)
            st.net_bytes += nbytes
            for i in range(k, k + n):
                st.filled[i % st.nslots] = i
            pthread_cond_signal(&st.filled_cond)
            pthread_mutex_unlock(&st.lock)

    def fail(self, int64_t k) -> None:
        """Filling chunk ``k`` failed (the filler keeps its error): the run stops, and
        returns kind 5 naming the lowest such chunk."""
        cdef _State* st = self.st
        if st == NULL or not self.busy:
            return
        with nogil:
            _fail(st, _ERR_FILL, 0, k, 0, 0)

    def leave(self) -> None:
        """An external filler is done with the run (call it once per filler, last)."""
        cdef _State* st = self.st
        if st == NULL or not self.busy:
            return
        with nogil:
            pthread_mutex_lock(&st.lock)
            st.active -= 1
            pthread_cond_broadcast(&st.run_cond)
            pthread_mutex_unlock(&st.lock)

    def stop(self) -> None:
        """Stop the run in progress from another thread, natively (no GIL needed by the run
        to see it): it returns as cancelled once its issued copies have completed.  The exit
        hook of :mod:`engine.gpu.device_ring` calls it; nothing happens between runs."""
        cdef _State* st = self.st
        if st == NULL or not self.busy:
            return
        with nogil:
            _fail(st, 4, 0, 0, 0, 0)

    def memory(self) -> memoryview:
        """The chunks' host memory, writable (``chunks * chunk_bytes`` bytes; slot ``s`` at
        ``s * chunk_bytes``), for external fillers.  Valid until :meth:`close`: drop every
        view of it first."""
        if self.st == NULL:
            raise ValueError("the ring is closed")
        return PyMemoryView_FromMemory(<char*>self.st.base, <Py_ssize_t>self.nbytes, PyBUF_WRITE)

    def close(self) -> None:
        """Join the threads, unlock and unmap the chunks, destroy the events (idempotent)."""
        cdef _State* st = self.st
        cdef int i
        cdef _Saved saved
        if st == NULL:
            return
        with nogil:
            pthread_mutex_lock(&st.lock)
            st.stop = 1
            pthread_cond_broadcast(&st.run_cond)
            pthread_mutex_unlock(&st.lock)
            for i in range(self.nthreads):
                pthread_join(self.tids[i], NULL)
            # on the ring's device whatever thread closes it (a reaper, a finaliser, exit): a
            # call on a thread with no context would make one on GPU 0
            if st.ctx != NULL and (st.events != NULL or self.own_stream or (st.base != NULL and st.blocks != NULL)):
                _enter(st.rt, st.ctx, &saved)
                if self.own_stream:
                    # every copy of the last run completed before it returned: nothing is queued
                    st.rt.stream_destroy(st.stream)
                    self.own_stream = False
                if st.events != NULL:
                    for i in range(st.nslots):
                        if st.events[i] != NULL:
                            st.rt.event_destroy(st.events[i])
                if st.base != NULL:
                    for i in range(st.nblocks):
                        if st.blocks != NULL and st.blocks[i] == 2:
                            st.rt.host_unregister(st.base + _block_lo(i) * st.chunk_bytes)
                st.rt.get_last_error()
                _leave(st.rt, &saved)
            if st.base != NULL:
                munmap(self.mem, self.mapped)
        if st.ctx != NULL:
            self.runtime.release_primary(st.device)
            st.ctx = NULL
        self.nthreads = 0
        pthread_cond_destroy(&st.filled_cond)
        pthread_cond_destroy(&st.issued_cond)
        pthread_cond_destroy(&st.run_cond)
        pthread_cond_destroy(&st.lock_cond)
        pthread_mutex_destroy(&st.lock)
        free(st.blocks); free(st.events); free(st.filled); free(st.choices); free(st.fill_s)
        free(self.tids); free(self.workers)
        self.tids = NULL
        self.workers = NULL
        free(st)
        self.st = NULL

    def put(self, uint64_t dst, const uint8_t[::1] src) -> None:
        """Copy ``src`` (host memory) to the device address ``dst`` now, synchronously, on the
        ring's device: a tensor read again after a failed checksum (rare: no chunk, no stream).
        Raises RuntimeError naming the runtime's error."""
        cdef _State* st = self.st
        cdef int rc = 0
        cdef _Saved saved
        cdef size_t n = src.shape[0]
        if st == NULL:
            raise ValueError("the ring is closed")
        if n == 0:
            return
        with nogil:
            rc = _enter(st.rt, st.ctx, &saved)
            if rc == 0:
                rc = st.rt.memcpy_sync(<void*><uintptr_t>dst, &src[0], n, _cudaMemcpyHostToDevice)
                if rc == 0:
                    # from pageable memory the call may return before its DMA ends: the legacy
                    # stream's work done, so that the tensor is whole when it is reported
                    rc = st.rt.stream_synchronize(NULL)
                if rc != 0:
                    st.rt.get_last_error()
            _leave(st.rt, &saved)
        if rc != 0:
            raise RuntimeError(f"copying {n} bytes to the device failed: {self.runtime.error_string(rc)} ({rc})")

    def abandon(self) -> None:
        """Forget the ring without touching it: in a process forked from the one that made
        it, where its threads do not exist (joining them would wait forever), its locks may be
        held by threads that are gone, and its events, page-locking and stream belong to the
        parent's driver.  Nothing is freed or unmapped (a driver may have kept the page-locked
        range out of the child, whose own memory could lie there now)."""
        if self.st == NULL:
            return
        self.st = NULL
        self.tids = NULL
        self.workers = NULL
        self.nthreads = 0

    def __dealloc__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
