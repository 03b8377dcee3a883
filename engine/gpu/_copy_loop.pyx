# cython: language_level=3, embedsignature=True
# distutils: language = c
#
# Bounds/wraparound checks and cdivision are set once in setup.py (ENGINE_CYTHON_CHECKS=1
# turns them on).
"""The chunk ring's copy loop, natively: the copy threads that fill the slots, and the issuing
thread that sends each full chunk to the device in order.

Private: :mod:`engine.gpu._ring`'s :class:`~engine.gpu._ring.ChunkRing` sets a ring's state up
(:file:`_copy_loop.pxd`: the slots, their events, the run's plan), starts the copy threads on
:func:`_worker_main` and runs :func:`_issue` on the calling thread; nothing here is called from
Python.  No Python runs per chunk: the issuing thread takes the GIL only every ``poll_seconds``
to report progress and see a cancel.
"""

from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport int64_t, uint8_t, uint32_t, uintptr_t
from libc.string cimport memset
from posix.time cimport nanosleep, timespec

from engine.gpu._cudart cimport _cudaErrorNotReady, _cudaHostRegisterPortable, _cudaMemcpyHostToDevice
from engine.io._io cimport (
    _DIGEST_BLOCK, _Choice, _Part, _copy_piece, _crc_landed, _seconds, _unmap_run, pthread_cond_broadcast, pthread_cond_signal,
    pthread_cond_timedwait, pthread_cond_wait, pthread_mutex_lock, pthread_mutex_unlock,
)


cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef int _block_of(int s) noexcept nogil:
    """The block of slot ``s``: slot 0 alone, then blocks twice as large as the one before
    ([1, 2), [2, 4), [4, 8) ...), so that a ring of 32 chunks is page-locked in 6 calls and the
    first chunk's copy can start after one small call, before the rest is locked."""
    cdef int b = 0
    while s > 0:
        s >>= 1
        b += 1
    return b


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
    t0 = _seconds()
    rc = st.rt.host_register(st.base + lo * st.chunk_bytes, <size_t>((hi - lo) * st.chunk_bytes),
                             _cudaHostRegisterPortable)
    pthread_mutex_lock(&st.lock)
    if rc == 0:
        st.blocks[b] = 2
    else:
        st.rt.get_last_error()
        st.blocks[b] = 3
        st.locked_refused = 1
    st.lock_s += _seconds() - t0
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


cdef void _part_for(_State* st, _Part* part, int index) noexcept nogil:
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
        t0 = _seconds()
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
        st.wait_slot += _seconds() - t0
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
    rc = st.rt.set_device(st.device)
    if rc != 0:  # reported here, not as the next call's "no context"
        st.rt.get_last_error()
        _fail(st, _ERR_CUDA, rc, 0, 0, 0)
        return
    while not _stopped(&st.cancel):
        k = _take(&st.next_chunk)
        if k >= st.plan.nchunks:
            break
        s = k % st.nslots
        if _claim(st, k):
            break
        t0 = _seconds()
        rc = _fill(st, &part, k, st.base + s * st.chunk_bytes, &st.choices[index])
        st.fill_s[index] += _seconds() - t0
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


cdef void _issue(_State* st, int64_t n, object poll, double poll_seconds, list raised) noexcept nogil:
    """The issuing side of a run of ``n`` chunks, on the calling thread: each chunk's copies
    sent (``cudaMemcpyAsync``, then the slot's event) in chunk order as soon as it is full, and
    ``poll(done)`` (with the GIL) every ``poll_seconds``, as :meth:`engine.gpu._ring.ChunkRing.run`
    describes; returns once the workers have left the run and every issued copy has completed
    (or failed).  An exception of the poll (or Ctrl-C) is appended to ``raised`` and stops the
    run, as a True from the poll does."""
    cdef int64_t j = 0, s, seg, last, done = 0
    cdef int rc = 0
    cdef bint ready, halt = False
    cdef double t0, next_poll = _seconds() + poll_seconds
    cdef timespec ts
    while j < n and not _stopped(&st.cancel):
        s = j % st.nslots
        t0 = _seconds()
        pthread_mutex_lock(&st.lock)
        while st.filled[s] != j and not _stopped(&st.cancel):
            _deadline(&ts, 10000000)
            pthread_cond_timedwait(&st.filled_cond, &st.lock, &ts)
            if _seconds() >= next_poll:
                break
        ready = st.filled[s] == j
        pthread_mutex_unlock(&st.lock)
        st.wait_fill += _seconds() - t0
        if _seconds() >= next_poll:
            with gil:
                try:
                    PyErr_CheckSignals()
                    done = _completed(st, done)
                    if poll is not None and poll(done):
                        halt = True
                except BaseException as exc:
                    raised.append(exc)
                    halt = True
            if halt:
                _fail(st, 4, 0, j, 0, 0)
                break
            next_poll = _seconds() + poll_seconds
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
            if done < n and _seconds() >= next_poll:
                with gil:
                    try:
                        PyErr_CheckSignals()
                        if poll(done):
                            halt = True
                    except BaseException as exc:
                        raised.append(exc)
                        halt = True
                if halt:
                    _fail(st, 4, 0, n - 1, 0, 0)
                    break
                next_poll = _seconds() + poll_seconds
    # every issued copy completes (or fails) before the chunks may be reused or freed:
    # the whole stream (the load's own), whatever event a failure left unrecorded
    if j > 0:
        rc = st.rt.stream_synchronize(st.stream)
        if rc != 0:
            st.rt.get_last_error()
            if st.err_kind == _ERR_NONE:
                _fail(st, _ERR_CUDA, rc, j - 1, 0, 0)
