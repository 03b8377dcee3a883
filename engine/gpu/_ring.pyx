# cython: language_level=3, embedsignature=True
# distutils: language = c
#
# Bounds/wraparound checks and cdivision are set once in setup.py (ENGINE_CYTHON_CHECKS=1
# turns them on).
"""The device copy ring, natively: file bytes through small page-locked chunks to a device.

Private: the public face is :mod:`engine.gpu.device_ring`, which plans a load's chunks, finds the
CUDA runtime and turns the error tuples returned here into the engine's errors.

A ring holds ``chunks`` page-locked host chunks of ``chunk_bytes`` each and ``threads``
native copy threads.  Chunk ``k`` of a load goes through slot ``k % chunks``: a copy thread
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
from cpython.exc cimport PyErr_CheckSignals
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.errno cimport errno
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec, nanosleep

from engine.gpu._cudart cimport (
    Runtime, _Rt, _Saved, _cudaErrorNotReady, _cudaEventDisableTiming, _cudaHostRegisterPortable,
    _cudaMemcpyHostToDevice, _enter, _leave,
)
from engine.io._io cimport (
    _Choice, _Part, _copy_piece, _crc_landed, _guard_ready, _unmap_run, pthread_cond_broadcast, pthread_cond_destroy,
    pthread_cond_init, pthread_cond_signal, pthread_cond_t, pthread_cond_timedwait, pthread_cond_wait,
    pthread_create, pthread_join, pthread_mutex_destroy, pthread_mutex_init, pthread_mutex_lock,
    pthread_mutex_t, pthread_mutex_unlock, pthread_t,
)


cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<sys/mman.h>" nogil:
    void* mmap(void* addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void* addr, size_t length)
    int madvise(void* addr, size_t length, int advice)
    int PROT_READ
    int PROT_WRITE
    int MAP_PRIVATE
    int MAP_ANONYMOUS
    void* MAP_FAILED

cdef extern from *:
    """
    #include <time.h>
    static inline int64_t engine_ring_take(int64_t *counter) {
        return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
    }
    static inline int64_t engine_ring_take_n(int64_t *counter, int64_t n) {
        return __atomic_fetch_add(counter, n, __ATOMIC_RELAXED);
    }
    static inline int engine_ring_stopped(int *flag) {
        return __atomic_load_n(flag, __ATOMIC_ACQUIRE);
    }
    static inline void engine_ring_stop(int *flag) {
        __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
    }
    /* an absolute CLOCK_REALTIME deadline ns from now, for pthread_cond_timedwait */
    static inline void engine_ring_deadline(struct timespec *ts, long ns) {
        clock_gettime(CLOCK_REALTIME, ts);
        ts->tv_nsec += ns;
        while (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
    }
    """
    int64_t _take "engine_ring_take"(int64_t* counter) noexcept nogil
    int64_t _take_n "engine_ring_take_n"(int64_t* counter, int64_t n) noexcept nogil
    int _stopped "engine_ring_stopped"(int* flag) noexcept nogil
    void _stop "engine_ring_stop"(int* flag) noexcept nogil
    void _deadline "engine_ring_deadline"(timespec* ts, long ns) noexcept nogil


cdef enum:
    _MADV_HUGEPAGE = 14

cdef size_t _HUGE = 2 << 20


# -- the ring ------------------------------------------------------------------------------------

cdef double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


# error kinds in the tuple a run returns
cdef enum:
    _ERR_NONE = 0
    _ERR_READ = 1      # code: errno or -1 for the end of the file; at, missing: where
    _ERR_CUDA = 2      # code: the runtime's error; at: the chunk
    _ERR_ALLOC = 3     # code: errno of mmap
    _ERR_FILL = 5      # an external filler failed chunk ``chunk`` (it holds its own error)

cdef struct _Plan:
    int64_t nchunks
    const int32_t* c_file      # chunk -> file index
    const int64_t* c_seg       # chunk k's segments are c_seg[k] .. c_seg[k + 1]
    const int64_t* s_pos       # segment -> position in its chunk
    const int64_t* s_off       # segment -> file offset
    const int64_t* s_len
    const uint64_t* s_dst      # segment -> device address
    const int32_t* fds
    const uint64_t* maps       # file -> address of its read-only mapping, or 0: pread
    const int64_t* map_lens
    const uint8_t* keeps       # file -> its mapping is kept between loads: leave its pages mapped
    # checksums (cells NULL: none): the load's pieces sorted by file and offset (d_off, d_len;
    # file f's are d_first[f] .. d_first[f + 1]); the CRC of piece i's part in the file's
    # chunk_bytes-aligned block b goes to cells[d_cell[i] + b - d_off[i] // chunk_bytes]
    const int64_t* d_off
    const int64_t* d_len
    const int64_t* d_first
    const int64_t* d_cell
    uint32_t* cells


cdef struct _State:
    _Rt* rt
    int device
    void* stream
    int64_t chunk_bytes
    int nslots
    uint8_t* base              # nslots * chunk_bytes of host memory
    uint8_t* blocks            # per block of slots (see _block_of): 0 pageable, 1 being
                               # page-locked, 2 page-locked, 3 refused
    int nblocks
    int locked_refused         # a registration was refused: the chunks stay pageable
    void** events
    int64_t* filled            # per slot: the chunk it holds, filled (-1: none yet)
    _Plan plan
    pthread_mutex_t lock
    pthread_cond_t filled_cond # a chunk filled (the issuing thread waits)
    pthread_cond_t issued_cond # a chunk issued, or the run stops (copy threads wait)
    pthread_cond_t run_cond    # a new run, a worker out of it, the ring closing
    pthread_cond_t lock_cond   # a block's page-locking ended
    int seats                  # workers the current run still takes (small runs wake fewer)
    int64_t next_chunk         # the next chunk a copy thread takes
    int64_t issued             # chunks whose copies are issued, in order
    int generation             # bumped per run: wakes the workers
    int active                 # workers still in the current run
    int stop                   # the ring closes: workers exit
    int cancel                 # the run stops (an error, or the caller's cancel)
    int err_kind
    int err_code
    int64_t err_chunk
    int64_t err_at
    int64_t err_missing
    double wait_slot           # seconds copy threads waited for a slot's copy (summed)
    double wait_fill           # seconds the issuing thread waited for a chunk to fill
    double lock_s              # seconds spent page-locking blocks (this run, or lock_all)
    int lock_calls             # cudaHostRegister calls made (the same)
    double* fill_s             # per worker (and the issuing thread, last): seconds filling
    int adaptive               # threads learn pread or the mapping (else a mapping is always used)
    int stream_stores          # copies out of a mapping store past the caches
    _Choice* choices
    void* ctx                  # the device's primary context (retained by the ring)
    int external               # the run's chunks are filled by callers' threads (take/filled)
    int64_t net_bytes          # bytes external fillers filled (over the ring's life)


cdef struct _Worker:
    _State* st
    int index


cdef int _block_of(int s) noexcept nogil:
    """The block of slot ``s``: slot 0 alone, then blocks twice as large as the one before
    ([1, 2), [2, 4), [4, 8) ...), so that a ring of 32 chunks is page-locked in 6 calls and the
    first chunk's copy can start after one small call, before the rest is locked."""
    cdef int b = 0
    while s > 0:
        s >>= 1
        b += 1
    return b


cdef inline int _block_lo(int b) noexcept nogil:
    return 0 if b == 0 else 1 << (b - 1)


cdef inline int _block_hi(int b, int nslots) noexcept nogil:
    cdef int hi = 1 << b
    return hi if hi < nslots else nslots


cdef void _lock_block(_State* st, int b) noexcept nogil:
    """Page-lock block ``b`` of the chunks, once (a thread that finds another locking it
    waits for that): one ``cudaHostRegister`` call for the whole block.  A refusal leaves the
    chunks pageable (copies from them still land, at pageable speed) and no more is tried."""
    cdef int rc, lo, hi
    cdef double t0
    pthread_mutex_lock(&st.lock)
    while st.blocks[b] == 1:
        pthread_cond_wait(&st.lock_cond, &st.lock)
    if st.blocks[b] != 0 or st.locked_refused:
        pthread_mutex_unlock(&st.lock)
        return
    st.blocks[b] = 1
    pthread_mutex_unlock(&st.lock)
    lo = _block_lo(b)
    hi = _block_hi(b, st.nslots)
    t0 = _now()
    rc = st.rt.host_register(st.base + lo * st.chunk_bytes, <size_t>((hi - lo) * st.chunk_bytes),
                             _cudaHostRegisterPortable)
    pthread_mutex_lock(&st.lock)
    if rc == 0:
        st.blocks[b] = 2
    else:
        st.rt.get_last_error()
        st.blocks[b] = 3
        st.locked_refused = 1
    st.lock_s += _now() - t0
    st.lock_calls += 1
    pthread_cond_broadcast(&st.lock_cond)
    pthread_mutex_unlock(&st.lock)


cdef int64_t _completed(_State* st, int64_t done) noexcept nogil:
    """Chunks ``[0, n)`` whose copies have certainly completed, from ``done`` known so far.

    Called on the issuing thread (the only one that records events or moves ``issued``).  A
    chunk more than ``nslots`` behind the last issued one has completed: its slot was refilled,
    which waits for its copy.  The chunks after it still own their slots' events, so each is
    asked in order (one stream: copies complete in the order they were issued) up to the first
    that has not completed."""
    cdef int64_t issued = st.issued, c = st.issued - st.nslots
    if c < done:
        c = done
    while c < issued:
        if st.rt.event_query(st.events[c % st.nslots]) != 0:
            # "not ready" (or a failure the stream's synchronisation reports) recorded as the
            # thread's last error: cleared, or the caller's next check would raise it
            st.rt.get_last_error()
            break
        c += 1
    return c


cdef void _fail(_State* st, int kind, int code, int64_t chunk, int64_t at, int64_t missing) noexcept nogil:
    """Record the first failure of a run (lowest chunk wins among reads) and stop it."""
    pthread_mutex_lock(&st.lock)
    if st.err_kind == _ERR_NONE or (kind == st.err_kind and (kind == _ERR_READ or kind == _ERR_FILL)
                                    and chunk < st.err_chunk):
        st.err_kind = kind
        st.err_code = code
        st.err_chunk = chunk
        st.err_at = at
        st.err_missing = missing
    _stop(&st.cancel)
    pthread_cond_broadcast(&st.filled_cond)
    pthread_cond_broadcast(&st.issued_cond)
    pthread_mutex_unlock(&st.lock)

cdef int _wait_event(_State* st, void* event) noexcept nogil:
    """Poll an event until it completes (0), fails (its error) or the run stops (-1): a copy
    thread with nothing else to do yields its core to the others meanwhile."""
    cdef int rc, spins = 0
    cdef timespec pause
    pause.tv_sec = 0
    pause.tv_nsec = 20000
    while True:
        rc = st.rt.event_query(event)
        if rc != _cudaErrorNotReady:
            return rc
        st.rt.get_last_error()  # "not ready" is no error: the runtime recorded it as one
        if _stopped(&st.cancel):
            return -1
        spins += 1
        if spins < 64:
            sched_yield()
        else:
            nanosleep(&pause, NULL)


# a checksummed chunk is filled this many bytes at a time, each block's CRC taken right after
# its copy while it is in the core's cache (the copy then stores through the caches)
cdef int64_t _DIGEST_BLOCK = 512 << 10


cdef void _digest_run(_State* st, _Part* part, int f, const uint8_t* out, int64_t off, int64_t n) noexcept nogil:
    """Add the bytes of a block just filled (``n`` bytes of file ``f`` from ``off``, at
    ``out``) to the CRC of each piece's share of its chunk: one cell per (piece, block of the
    file), filled in file order by the one thread that fills that chunk, joined per tensor
    when it is reported."""
    cdef uint32_t* cell
    cdef _Plan* p = &st.plan
    cdef int64_t lo = p.d_first[f], hi = p.d_first[f + 1], mid, a, b, cb = st.chunk_bytes
    while lo < hi:  # the first piece that ends after off
        mid = (lo + hi) // 2
        if p.d_off[mid] + p.d_len[mid] <= off:
            lo = mid + 1
        else:
            hi = mid
    while lo < p.d_first[f + 1] and p.d_off[lo] < off + n:
        a = p.d_off[lo] if p.d_off[lo] > off else off
        b = p.d_off[lo] + p.d_len[lo]
        if b > off + n:
            b = off + n
        if b > a:
            cell = &p.cells[p.d_cell[lo] + a // cb - p.d_off[lo] // cb]
            cell[0] = _crc_landed(part, out + (a - off), b - a, a, cell[0])
        lo += 1


cdef int _fill_digest(_State* st, _Part* part, int f, uint8_t* out, int64_t n, int64_t off) noexcept nogil:
    """:func:`_copy_piece` of a run a block at a time, each block checksummed as it lands."""
    cdef int64_t step
    cdef int err
    while n > 0:
        step = n if n < _DIGEST_BLOCK else _DIGEST_BLOCK
        err = _copy_piece(part, out, step, off)
        if err:
            return err
        _digest_run(st, part, f, out, off, step)
        out += step
        off += step
        n -= step
    return 0


cdef void _digest_filled(_State* st, int64_t k) noexcept nogil:
    """The checksum cells of chunk ``k``, filled by an external filler (a connection): read
    back out of the chunk, which the filler just wrote (in this core's cache where it was)."""
    cdef _Plan* p = &st.plan
    cdef _Part part
    cdef int f = p.c_file[k]
    cdef int64_t j = p.c_seg[k], end = p.c_seg[k + 1]
    cdef uint8_t* out = st.base + (k % st.nslots) * st.chunk_bytes
    memset(&part, 0, sizeof(part))  # no mapping: _crc_landed reads the chunk
    while j < end:
        _digest_run(st, &part, f, out + p.s_pos[j], p.s_off[j], p.s_len[j])
        j += 1


cdef int _fill(_State* st, _Part* part, int64_t k, uint8_t* out, _Choice* tally) noexcept nogil:
    """Fill chunk ``k`` into ``out``: its segments, file-contiguous ones in one copy; then
    unmap what was mapped (unless the file's mapping is held for the load).  0 or the read's
    error (in ``part``).  Bytes by source go to ``tally`` (the adaptive copy counts its own)."""
    cdef _Plan* p = &st.plan
    cdef int f = p.c_file[k]
    cdef int64_t j = p.c_seg[k], end = p.c_seg[k + 1], run_off, run_len, run_pos
    cdef int err
    part.fd = p.fds[f]
    part.src = <const uint8_t*><uintptr_t>p.maps[f]
    part.src_len = p.map_lens[f]
    part.keep = p.keeps[f]
    while j < end:
        run_off = p.s_off[j]
        run_pos = p.s_pos[j]
        run_len = p.s_len[j]
        j += 1
        while j < end and p.s_off[j] == run_off + run_len and p.s_pos[j] == run_pos + run_len:
            run_len += p.s_len[j]
            j += 1
        if p.cells != NULL:
            err = _fill_digest(st, part, f, out + run_pos, run_len, run_off)
        else:
            err = _copy_piece(part, out + run_pos, run_len, run_off)
        if err:
            return err
        if part.src == NULL:
            tally.nbytes[0] += run_len
        elif part.choice == NULL:
            tally.nbytes[1] += run_len
        if part.src != NULL and not part.keep:
            _unmap_run(part.src, part.src_len, run_off, run_off + run_len)
    return 0


cdef inline void _part_for(_State* st, _Part* part, int index) noexcept nogil:
    memset(part, 0, sizeof(_Part))
    part.choice = &st.choices[index] if st.adaptive else NULL
    # stores past the caches (the default): the copy engine reads the chunk from memory either
    # way where the ring is larger than the last-level cache, and stores that first read each
    # line in (the cache's write-allocate) cost a third pass over memory
    part.stream = st.stream_stores
    # chunks smaller than the copies' timing threshold still time their runs, so that each
    # thread learns which source is faster whatever the chunk size
    part.timed = st.chunk_bytes // 2 if st.chunk_bytes < (2 << 20) else 0
    if st.plan.cells != NULL:  # checksummed runs are copied a block at a time: time the blocks
        part.timed = _DIGEST_BLOCK // 2


cdef int _claim(_State* st, int64_t k) noexcept nogil:
    """Make slot ``k % nslots`` ready for chunk ``k``: its previous chunk issued and that copy
    completed (or, on its first use, its block page-locked).  0, or -1 when the run stopped
    (a failed copy is recorded here)."""
    cdef int64_t s = k % st.nslots
    cdef int rc
    cdef double t0
    if k >= st.nslots:
        # the slot's previous chunk must be issued, and its copy complete, before it is refilled
        t0 = _now()
        pthread_mutex_lock(&st.lock)
        while st.issued <= k - st.nslots and not _stopped(&st.cancel):
            pthread_cond_wait(&st.issued_cond, &st.lock)
        pthread_mutex_unlock(&st.lock)
        if _stopped(&st.cancel):
            return -1
        rc = _wait_event(st, st.events[s])
        if rc == -1:
            return -1
        if rc != 0:
            _fail(st, _ERR_CUDA, rc, k - st.nslots, 0, 0)
            return -1
        pthread_mutex_lock(&st.lock)
        st.wait_slot += _now() - t0
        pthread_mutex_unlock(&st.lock)
    elif st.blocks[_block_of(<int>s)] != 2 and not st.locked_refused:
        # first use of the slot: its block is page-locked here, beside the other threads' fills
        _lock_block(st, _block_of(<int>s))
    return 0


cdef void _run_worker(_State* st, int index) noexcept nogil:
    cdef int64_t k, s
    cdef int rc
    cdef double t0
    cdef _Part part
    _part_for(st, &part, index)
    st.rt.set_device(st.device)
    while not _stopped(&st.cancel):
        k = _take(&st.next_chunk)
        if k >= st.plan.nchunks:
            break
        s = k % st.nslots
        if _claim(st, k):
            break
        t0 = _now()
        rc = _fill(st, &part, k, st.base + s * st.chunk_bytes, &st.choices[index])
        st.fill_s[index] += _now() - t0
        if rc:
            _fail(st, _ERR_READ, rc, k, part.at, part.missing)
            break
        pthread_mutex_lock(&st.lock)
        st.filled[s] = k
        pthread_cond_signal(&st.filled_cond)
        pthread_mutex_unlock(&st.lock)


cdef void* _worker_main(void* arg) noexcept nogil:
    cdef _Worker* w = <_Worker*>arg
    cdef _State* st = w.st
    cdef int seen = 0
    while True:
        pthread_mutex_lock(&st.lock)
        # a new run takes this thread while it has seats left (a small run wakes only as many
        # threads as it has chunks); a thread too late for one waits for the next
        while not st.stop:
            if st.generation != seen:
                seen = st.generation
                if st.seats > 0:
                    st.seats -= 1
                    break
            pthread_cond_wait(&st.run_cond, &st.lock)
        if st.stop:
            pthread_mutex_unlock(&st.lock)
            return NULL
        pthread_mutex_unlock(&st.lock)
        _run_worker(st, w.index)
        pthread_mutex_lock(&st.lock)
        st.active -= 1
        pthread_cond_broadcast(&st.run_cond)
        pthread_mutex_unlock(&st.lock)


cdef class ChunkRing:
    """``chunks`` page-locked chunks of ``chunk_bytes`` and ``threads`` native copy threads on
    one device and stream of a :class:`Runtime`; :meth:`run` moves one load through them.

    The chunks are one anonymous mapping (huge pages where the kernel offers them),
    page-locked in blocks (slot 0, then blocks twice the size of the one before: 6 calls for
    32 chunks) by the copy thread that first fills a slot of the block, or all at once ahead
    of the first load by :meth:`lock_all`, and unlocked by :meth:`close`, which also joins the
    threads and destroys the events.  One run at a time.
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
    cdef object __weakref__

    def __cinit__(self, Runtime runtime, int device, uintptr_t stream, int64_t chunk_bytes, int chunks,
                  int threads, object stream_owner=None):
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
        try:
            self.st.ctx = <void*><uintptr_t>runtime.primary_context(device)
        except RuntimeError:
            self.close()
            raise
        with nogil:
            rc = _enter(&runtime.rt, self.st.ctx, &saved)
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
            raise RuntimeError(f"setting up the ring's events on device {device} failed: "
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
        t0 = _now()
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
        return (_now() - t0, st.lock_calls - calls)

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
        cdef int64_t n = c_file.shape[0], j, s, seg, last, done = 0
        cdef int rc = 0, kind, seats, i, started = 0
        cdef bint ready, inline, fenced = wait_for is not None
        cdef uintptr_t fence = <uintptr_t>wait_for if wait_for is not None else 0
        cdef _Saved saved
        cdef _Part part
        cdef double t0, next_poll
        cdef timespec ts
        cdef object raised = None
        cdef bint cancelled = False
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
                                raised = exc
                    if started < fillers:
                        # the fillers that never started never leave: counted out here
                        pthread_mutex_lock(&st.lock)
                        st.active -= fillers - (started if started > 0 else 0)
                        pthread_cond_broadcast(&st.run_cond)
                        pthread_mutex_unlock(&st.lock)
                    if raised is not None or (rc == 0 and started < 1):
                        _fail(st, 4, 0, 0, 0, 0)
                if rc != 0:
                    st.rt.get_last_error()
                    _fail(st, _ERR_CUDA, rc, 0, 0, 0)
                elif inline:
                    # slot 0 is free: the last run's copies completed before it returned
                    if st.blocks[0] != 2 and not st.locked_refused:
                        _lock_block(st, 0)
                    _part_for(st, &part, self.nthreads)
                    t0 = _now()
                    rc = _fill(st, &part, 0, st.base, &st.choices[self.nthreads])
                    st.fill_s[self.nthreads] += _now() - t0
                    if rc:
                        _fail(st, _ERR_READ, rc, 0, part.at, part.missing)
                    else:
                        st.filled[0] = 0
                    rc = 0
                next_poll = _now() + poll_seconds
                j = 0
                while j < n and not _stopped(&st.cancel):
                    s = j % st.nslots
                    t0 = _now()
                    pthread_mutex_lock(&st.lock)
                    while st.filled[s] != j and not _stopped(&st.cancel):
                        _deadline(&ts, 10000000)
                        pthread_cond_timedwait(&st.filled_cond, &st.lock, &ts)
                        if _now() >= next_poll:
                            break
                    ready = st.filled[s] == j
                    pthread_mutex_unlock(&st.lock)
                    st.wait_fill += _now() - t0
                    if _now() >= next_poll:
                        with gil:
                            try:
                                PyErr_CheckSignals()
                                done = _completed(st, done)
                                if poll is not None and poll(done):
                                    cancelled = True
                            except BaseException as exc:
                                raised = exc
                        if raised is not None or cancelled:
                            _fail(st, 4, 0, j, 0, 0)
                            break
                        next_poll = _now() + poll_seconds
                    if not ready:
                        continue  # woken to poll, or stopped: the loop's test decides
                    last = st.plan.c_seg[j + 1]
                    seg = st.plan.c_seg[j]
                    while seg < last:
                        rc = st.rt.memcpy_async(<void*><uintptr_t>st.plan.s_dst[seg],
                                                st.base + s * st.chunk_bytes + st.plan.s_pos[seg],
                                                <size_t>st.plan.s_len[seg], _cudaMemcpyHostToDevice, st.stream)
                        if rc != 0:
                            break
                        seg += 1
                    if rc == 0:
                        rc = st.rt.event_record(st.events[s], st.stream)
                    if rc != 0:
                        st.rt.get_last_error()
                        _fail(st, _ERR_CUDA, rc, j, 0, 0)
                        # copies of this chunk may be queued: its event must still cover them
                        st.rt.event_record(st.events[s], st.stream)
                        st.rt.get_last_error()
                        j += 1
                        break
                    j += 1
                    pthread_mutex_lock(&st.lock)
                    st.issued = j
                    pthread_cond_broadcast(&st.issued_cond)
                    pthread_mutex_unlock(&st.lock)
                # the workers leave the run (stopped, or out of chunks) before it returns
                pthread_mutex_lock(&st.lock)
                if _stopped(&st.cancel):
                    pthread_cond_broadcast(&st.issued_cond)
                while st.active > 0:
                    pthread_cond_wait(&st.run_cond, &st.lock)
                pthread_mutex_unlock(&st.lock)
                # every chunk issued: the last ones' tensors are still reported as their copies
                # complete (a hooked load's kernels start then), not once the whole stream has;
                # each chunk's event waited for in turn, so the wait ends when the copies do
                if poll is not None and j == n and not _stopped(&st.cancel):
                    done = _completed(st, done)
                    while done < n:
                        if st.rt.event_synchronize(st.events[done % st.nslots]) != 0:
                            st.rt.get_last_error()
                            break  # a failed copy: the stream's synchronisation below reports it
                        done += 1
                        if done < n and _now() >= next_poll:
                            with gil:
                                try:
                                    PyErr_CheckSignals()
                                    if poll(done):
                                        cancelled = True
                                except BaseException as exc:
                                    raised = exc
                            if raised is not None or cancelled:
                                _fail(st, 4, 0, n - 1, 0, 0)
                                break
                            next_poll = _now() + poll_seconds
                # every issued copy completes (or fails) before the chunks may be reused or freed:
                # the whole stream (the load's own), whatever event a failure left unrecorded
                if j > 0:
                    rc = st.rt.stream_synchronize(st.stream)
                    if rc != 0:
                        st.rt.get_last_error()
                        if st.err_kind == _ERR_NONE:
                            _fail(st, _ERR_CUDA, rc, j - 1, 0, 0)
                _leave(st.rt, &saved)
                st.plan.nchunks = 0
                st.external = 0
        finally:
            self.busy = False
        if raised is not None:
            raise raised
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
                # (a filler is a thread of the engine's own, device_ring._Fillers'; cheap when set)
                st.rt.set_device(st.device)
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
            if st.ctx != NULL and (st.events != NULL or (st.base != NULL and st.blocks != NULL)):
                _enter(st.rt, st.ctx, &saved)
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
