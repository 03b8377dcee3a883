# cython: language_level=3, embedsignature=True
# distutils: language = c
#
# Bounds/wraparound checks and cdivision are set once in setup.py (ENGINE_CYTHON_CHECKS=1
# turns them on).
"""The copy engine of local reads: one piece of a file into memory, GIL released, with
``pread`` or out of a populated mapping, each copy thread learning which is faster.

Private and native only (no Python names): ``_io.pxd`` declares what the split copies
(``_split.pyx``, a batch dealt to a pool of threads), the chunk ring
(``engine/gpu/_copy_loop.pyx``) and the ``pread`` gathers (``_spans.pyx``) cimport: a piece's
copy (``_copy_piece``), the CRC of the bytes it landed (``_crc_landed``), the unmap of a
run, and the one ``pread`` loop (``_pread_full``).  Mapped copies run under the SIGBUS
guard of ``_guard.pyx``, so a file truncated underneath is an error code, never a SIGBUS.
The public face of all of them is :mod:`engine.io.reader`.
"""

from libc.errno cimport EAGAIN, EINTR, EINVAL, errno
from libc.stdint cimport int64_t, uint8_t, uint32_t, uintptr_t

from engine.base._crc32c cimport crc32c_update
from engine.io._guard cimport _bus_guard_ready, _guarded_copy, _guarded_crc
from engine.io._mman cimport _MADV_DONTNEED, _MADV_POPULATE_READ, _SC_PAGESIZE, madvise, sysconf
from posix.types cimport off_t
from posix.unistd cimport pread

# _Part, _Choice and the pthread declarations are in _io.pxd (the split copies and the
# chunk ring's copy threads, engine/gpu/_copy_loop.pyx, share them)

# one pread asks for at most this much (Linux caps a single read at 2 GiB - 4 KiB anyway)
cdef int64_t _MAX_PREAD = 1 << 30


# Which source copies faster depends on the page cache, not only on the host.  A mapped copy
# costs what ``pread`` does not: mapping the pages (``MADV_POPULATE_READ``) and unmapping them;
# its copy is the cheaper part (no system call, and for host destinations stores past the
# caches).  What mapping costs shows how the page cache holds the bytes: a 2 MiB folio maps
# with one entry (a microsecond or two per 2 MiB), while 4 KiB pages, and folios smaller than
# 2 MiB, take an entry per page (about a third of a microsecond each to map, as
# ``scripts/page_cache_state.py`` prints it).  So each thread of an adaptive reader times the
# two steps of its mapped pieces apart, maps while mapping costs under ``_MAP_SHARE`` of copying, and ``pread``s past that, mapping
# the first ``_PROBE_BYTES`` of a piece now and then to see whether the state changed: after
# ``_RETRY_FIRST`` pieces, then twice as many after each try that found mapping still dear, up
# to ``_RETRY_LAST``.  The two states meet in one load (a file read in by large reads in one
# region and faulted in page by page in another; shards cached by different readers), and in
# a file read in by large reads, the regions where the kernel found no free 2 MiB block for a
# folio come in runs of up to a hundred MiB or so (``scripts/page_cache_state.py`` counts
# them): the figure that decides is the latest one.
#
# ``pread`` is not timed against the mapping: its copy stores through the caches, and writing
# those lines back is paid later, by whichever piece comes next, of either source.  A timer
# per piece credits ``pread`` with less than it costs, and a race of the two timers drifts to
# ``pread`` where the mapping is faster.


# a piece is timed only from this size on (smaller ones measure their overheads)
cdef int64_t _TIMED_BYTES = 1 << 20
# map while mapping a piece's pages costs less than this share of copying them
cdef double _MAP_SHARE = 0.25
# a try of the mapping maps this much of a piece.  A 2 MiB folio maps whole on its first page,
# in a microsecond or two whatever the size asked; smaller folios take an entry per page, a
# hundred microseconds or more per 2 MiB (``scripts/page_cache_state.py`` prints both).  At
# 1 MiB the two figures sit far on either side of _MAP_SHARE of a copy's cost, with room for a
# try that is interrupted or descheduled; at 256 KiB such a try could read as dear and leave a
# thread on pread in a file of 2 MiB folios
cdef int64_t _PROBE_BYTES = 1 << 20
# while pread is chosen, a thread tries the mapping after this many timed pieces, then after
# twice as many each time the try finds mapping still dear, up to _RETRY_LAST.  A try where
# pread is faster (a file in 4 KiB pages) costs more than pread would on its MiB, so tries
# every other piece slowed such a load measurably, and one in 32 pieces keeps it near pread's.
# A thread in a run of small folios (runs of up to a hundred MiB in a file read by large reads,
# as page_cache_state.py counts them) is back on the mapping within a few pieces of the run's end.
cdef int64_t _RETRY_FIRST = 2
cdef int64_t _RETRY_LAST = 32


cdef int _guard_ready() noexcept nogil:
    """Install the SIGBUS guard of mapped copies (0, or -1 where ``sigaction`` failed)."""
    return _bus_guard_ready()


# one populate-and-copy step of a mapped share: small enough that the pages it maps are
# still in the TLB when they are copied, large enough that the calls cost nothing
cdef int64_t _MAP_STEP = 16 << 20


cdef int _copy_mapped(int fd, const uint8_t* src, int64_t src_len, uint8_t* out, int64_t nbytes,
                      int64_t offset, int64_t* at, int64_t* missing, int stream,
                      double* spent, int* fell=NULL) noexcept nogil:
    """Copy ``nbytes`` at ``offset`` of the mapping ``src`` of ``fd`` into ``out``, a step at
    a time: populate (``MADV_POPULATE_READ``), then copy under the SIGBUS guard.  Where the
    mapping cannot serve a step (past its end, pages the file no longer backs, a populate
    error) the rest is read with :func:`_pread_full`, whose result is returned: the error
    then names the exact offset where the file ends, as a plain read would.  With
    ``spent`` (not NULL), adds the seconds spent mapping to ``spent[0]`` and copying to
    ``spent[1]``; a copy that fell back to ``pread`` sets ``spent[0]`` to -1."""
    cdef int64_t done = 0, step, pos
    cdef uintptr_t page = <uintptr_t>sysconf(_SC_PAGESIZE), lo
    cdef int err
    cdef bint mapped
    cdef double t0 = 0, t1 = 0
    while done < nbytes:
        pos = offset + done
        step = nbytes - done
        if step > _MAP_STEP:
            step = _MAP_STEP
        mapped = pos + step <= src_len
        if spent != NULL:
            t0 = _seconds()
        if mapped:
            lo = (<uintptr_t>(src + pos)) & ~(page - 1)
            while madvise(<void*>lo, <uintptr_t>(src + pos + step) - lo, _MADV_POPULATE_READ) != 0:
                err = errno
                if err == EINTR or err == EAGAIN:
                    continue
                # EINVAL: a kernel without MADV_POPULATE_READ; the guarded copy faults them in
                mapped = err == EINVAL
                break
        if spent != NULL:
            t1 = _seconds()
        if not mapped or _guarded_copy(out + done, src + pos, <size_t>step, stream) != 0:
            if spent != NULL:
                spent[0] = -1
            if fell != NULL:
                fell[0] = 1
            return _pread_full(fd, out + done, nbytes - done, pos, at, missing)
        if spent != NULL and spent[0] >= 0:
            spent[0] += t1 - t0
            spent[1] += _seconds() - t1
        done += step
    return 0


cdef void _unmap_run(const uint8_t* src, int64_t src_len, int64_t lo, int64_t hi) noexcept nogil:
    """Unmap the whole pages of ``[lo, hi)`` of the mapping ``src`` again (the page cache
    keeps them; ``MADV_DONTNEED``).  A load's mapped pages would otherwise count in the
    process's resident memory until the unmap, the file's whole size by the end, and the
    teardown would all fall on the one thread that unmaps.

    Called once per run of file-contiguous bytes a piece copied, not per tensor: a range
    that ends inside a 2 MiB folio mapped whole (one page-middle-directory entry) makes the
    kernel split that entry into 512 page entries first, and the next piece then maps and
    unmaps its half page by page.  Pieces of 2 MiB and more are cut where the file offset
    is a multiple of 2 MiB (see ``_plan_parts`` in ``_split.pyx``), so their runs begin and
    end on those lines."""
    cdef uintptr_t page = <uintptr_t>sysconf(_SC_PAGESIZE), zlo, zhi
    if src == NULL or lo >= hi:
        return
    if hi > src_len:
        hi = src_len
    zlo = (<uintptr_t>(src + lo) + page - 1) & ~(page - 1)
    zhi = (<uintptr_t>(src + hi)) & ~(page - 1)
    if zhi > zlo:
        madvise(<void*>zlo, zhi - zlo, _MADV_DONTNEED)


cdef bint _maps(_Choice* c) noexcept nogil:
    """Whether the mapping is the source this thread keeps to (see ``_Choice``)."""
    return c.known and c.populate <= _MAP_SHARE * c.copy


cdef int _pick(_Choice* c, bint timed) noexcept nogil:
    """0 (``pread``) or 1 (the mapping) for the next piece: the mapping while mapping costs
    under ``_MAP_SHARE`` of copying, and to try it (before its first figure, and after
    ``c.every`` timed pieces of ``pread``); else ``pread``."""
    if _maps(c) or (timed and not c.known):
        return 1
    if timed:
        c.turns += 1
        if c.turns >= c.every:
            return 1
    return 0


cdef int _copy_piece(_Part* p, uint8_t* out, int64_t nbytes, int64_t offset) noexcept nogil:
    """One piece of a share, from the source the share uses (or learns, see ``_Choice``).

    A try of the mapping maps ``_PROBE_BYTES`` of the piece, enough to time, and the rest
    goes on from the source then chosen."""
    cdef _Choice* c = p.choice
    cdef int source, err
    cdef int64_t n, least = p.timed if p.timed > 0 else _TIMED_BYTES
    cdef bint timed
    cdef double spent[2]
    cdef int fell = 0
    p.last_mapped = 0
    if p.src == NULL:
        return _pread_full(p.fd, out, nbytes, offset, &p.at, &p.missing)
    if c == NULL:
        err = _copy_mapped(p.fd, p.src, p.src_len, out, nbytes, offset, &p.at, &p.missing, p.stream, NULL, &fell)
        p.last_mapped = not fell
        return err
    p.last_mapped = 1
    while nbytes > 0:
        source = _pick(c, nbytes >= least)
        n = nbytes
        timed = n >= least
        if source and not _maps(c) and timed and nbytes > _PROBE_BYTES:
            n = _PROBE_BYTES  # a try
        if source:
            spent[0] = spent[1] = 0
            err = _copy_mapped(p.fd, p.src, p.src_len, out, n, offset, &p.at, &p.missing, p.stream,
                               spent if timed else NULL, &fell)
            if fell:
                p.last_mapped = 0
            if err == 0 and timed and spent[0] >= 0:
                c.populate = spent[0] / n  # the state of the pages just mapped: the latest figure
                # the copy's speed changes slowly: half the last figure, half the new
                c.copy = spent[1] / n if not c.known else (c.copy + spent[1] / n) / 2
                c.known = 1
                c.turns = 0
                # the next try comes soon after a change to the mapping, later each time not
                c.every = _RETRY_FIRST if _maps(c) or c.every == 0 else min(2 * c.every, _RETRY_LAST)
        else:
            p.last_mapped = 0
            err = _pread_full(p.fd, out, n, offset, &p.at, &p.missing)
        if err:
            return err
        c.nbytes[source] += n
        out += n
        offset += n
        nbytes -= n
    return 0


cdef uint32_t _crc_landed(_Part* p, const uint8_t* out, int64_t nbytes, int64_t offset,
                          uint32_t crc) noexcept nogil:
    """``crc`` continued over ``nbytes`` the last :func:`_copy_piece` of ``p`` just put at
    ``out`` from file ``offset``, read while they are in the cache: out of the mapping where
    every byte came from it (its copy stored past the caches, its source lines are what the
    core holds), else out of ``out`` (``pread``'s copy stores through the caches)."""
    cdef uint32_t got = crc
    if p.last_mapped and p.src != NULL and offset + nbytes <= p.src_len:
        if _guarded_crc(crc32c_update, &got, p.src + offset, <size_t>nbytes) == 0:
            return got
    return crc32c_update(crc, out, <size_t>nbytes)


cdef int _pread_full(int fd, uint8_t* out, int64_t nbytes, int64_t offset, int64_t* at,
                     int64_t* missing) noexcept nogil:
    """Read exactly ``nbytes`` at ``offset`` into ``out``, in calls of at most ``_MAX_PREAD``
    bytes, again after ``EINTR`` and short reads: 0, an errno, or -1 for the end of the
    file, with ``at``/``missing`` set to where the read stopped and what it still lacked.
    The one pread loop of the native reads: every read of the copies here, of the split
    copies and the chunk ring, and of the gathers in ``_spans.pyx`` goes through it (the
    Python-level ``reader.pread_into`` has its own ``preadv`` loop)."""
    cdef int64_t done = 0, want
    cdef ssize_t got
    while done < nbytes:
        want = nbytes - done
        if want > _MAX_PREAD:
            want = _MAX_PREAD
        got = pread(fd, out + done, <size_t>want, <off_t>(offset + done))
        if got > 0:
            done += got
            continue
        if got < 0 and errno == EINTR:
            continue
        at[0] = offset + done
        missing[0] = nbytes - done
        return errno if got < 0 else -1
    return 0
