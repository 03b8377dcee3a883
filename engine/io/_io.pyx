# cython: language_level=3, embedsignature=True
# distutils: language = c
#
# Bounds/wraparound checks and cdivision are set once in setup.py (ENGINE_CYTHON_CHECKS=1
# turns them on).
"""Native I/O loops, GIL released: many positional reads in one call.

Private: the public wrapper is :mod:`engine.io.reader`, which turns the error codes returned
here into :class:`~engine.errors.ReadError` with the file, offset and size.

One idea, moving bytes out of the page cache natively, kept in one extension on purpose:
the gathers of strided runs (``pread_runs``, ``pread_spans``), the split copy engine that
deals a batch to a pool of native threads (``SplitReader``, from ``pread`` or a populated
mapping under a SIGBUS guard) and the page-table helpers both use (residency, populate for
reading and for writing) share the ``pread`` retry loop, the ``madvise`` declarations and
the guard; split into modules, each would carry a copy of them.
"""

from libc.errno cimport EAGAIN, EFAULT, EINTR, EINVAL, errno
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t

from engine.base._crc32c cimport crc32c_combine, crc32c_update
from posix.types cimport off_t
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec
from posix.unistd cimport pread


def pread_runs(int fd, uint8_t[::1] dst, const int64_t[::1] src, Py_ssize_t run_bytes, int64_t base):
    """Read ``len(src)`` runs of ``run_bytes`` bytes at file offsets ``base + src[i]`` into
    ``dst[i * run_bytes : (i + 1) * run_bytes]``.

    Returns ``(0, 0, 0)`` on success, else ``(errno or -1 for end of file, file offset,
    bytes missing)`` of the first failure.  The loop runs without the GIL.
    """
    cdef Py_ssize_t n = src.shape[0], i
    cdef int err = 0
    cdef int64_t at = 0
    cdef int64_t missing = 0
    if n * run_bytes > dst.shape[0]:
        raise ValueError("destination too small for the runs")
    if n == 0 or run_bytes == 0:
        return (0, 0, 0)
    cdef uint8_t* out = &dst[0]
    with nogil:
        for i in range(n):
            err = _pread_full(fd, out + i * run_bytes, run_bytes, base + src[i], &at, &missing)
            if err:
                break
    return (err, at, missing)


# ---------------------------------------------------------------------------------------------
# Split copies: one large batch of a load spread over many native threads.
#
# A batch of a host load is hundreds of MiB; one thread
# copying it out of the page cache runs at a fraction of the host's memory bandwidth, so it
# is dealt out in pieces to threads kept for the whole load (SplitReader), each taking its
# pieces with pread or out of a mapping, with the GIL released for the whole call: the cost
# in Python is one call per batch.  A file truncated underneath is an error code, never a
# SIGBUS (see the mapped copies below).
# ---------------------------------------------------------------------------------------------

from libc.stdlib cimport calloc, free
from libc.string cimport memset

# the pthread declarations are in _io.pxd (the chunk ring, engine/gpu/_ring.pyx, shares them)

cdef extern from "<sys/mman.h>" nogil:
    int mincore(void* addr, size_t length, unsigned char* vec)
    int madvise(void* addr, size_t length, int advice)
    int MADV_WILLNEED

cdef extern from "<unistd.h>" nogil:
    long sysconf(int name)
    enum: _SC_PAGESIZE

# Linux 5.14+; the headers of older C libraries may lack the name, the number is the ABI's
cdef enum:
    _MADV_POPULATE_READ = 22
    _MADV_POPULATE_WRITE = 23
    _MADV_DONTNEED = 4

# one pread asks for at most this much (Linux caps a single read at 2 GiB - 4 KiB anyway)
cdef int64_t _MAX_PREAD = 1 << 30
# most threads one split read starts
cdef int _MAX_SPLIT_THREADS = 256


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
# _Choice is declared in _io.pxd (the chunk ring, engine/gpu/_ring.pyx, shares this machinery)


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


# _Part is declared in _io.pxd


# -- copies out of a file mapping ------------------------------------------------------------
#
# A mapping can be faster than pread (no system call per chunk once the pages are mapped,
# and MADV_POPULATE_READ maps a share of a warm file in one call), but a page the file no
# longer backs (truncated underneath) raises SIGBUS instead of returning an error.  The
# populate call reports such pages as EFAULT before any copy; for a file cut between the
# populate and the copy, the copy runs under a SIGBUS handler that jumps back out of it on
# that thread only (faults of anything else go on to the handler that was there before).

cdef extern from *:
    """
    #include <setjmp.h>
    #include <signal.h>
    #include <string.h>
    #include <pthread.h>

    static __thread sigjmp_buf *volatile engine_bus_jump = NULL;
    static struct sigaction engine_bus_previous;
    static pthread_mutex_t engine_bus_lock = PTHREAD_MUTEX_INITIALIZER;

    static void engine_on_sigbus(int sig, siginfo_t *info, void *context) {
        sigjmp_buf *jump = engine_bus_jump;
        if (jump != NULL) {
            engine_bus_jump = NULL;
            siglongjmp(*jump, 1);
        }
        /* not a guarded copy: what would have happened without the engine */
        if (engine_bus_previous.sa_flags & SA_SIGINFO) {
            if (engine_bus_previous.sa_sigaction != NULL) {
                engine_bus_previous.sa_sigaction(sig, info, context);
                return;
            }
        } else if (engine_bus_previous.sa_handler != SIG_DFL && engine_bus_previous.sa_handler != SIG_IGN) {
            engine_bus_previous.sa_handler(sig);
            return;
        }
        signal(sig, SIG_DFL);   /* the faulting access runs again and ends the process */
    }

    /* Put the handler first in line, in front of whatever is there now (a handler set
       after ours, such as Python's faulthandler, would otherwise see the fault first and
       report a crash before passing it on).  Called before each mapped copy. */
    static int engine_bus_ready(void) {
        struct sigaction current, action;
        int rc = 0;
        pthread_mutex_lock(&engine_bus_lock);
        if (sigaction(SIGBUS, NULL, &current) != 0) {
            rc = -1;
        } else if (!((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == engine_on_sigbus)) {
            memset(&action, 0, sizeof action);
            action.sa_sigaction = engine_on_sigbus;
            action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
            sigemptyset(&action.sa_mask);
            engine_bus_previous = current;
            rc = sigaction(SIGBUS, &action, NULL);
        }
        pthread_mutex_unlock(&engine_bus_lock);
        return rc;
    }

    /* A copy whose stores bypass the caches (non-temporal), for destinations nobody reads
       soon (a caller's tensors).  The C library's memcpy streams only above a threshold of
       a few hundred MiB (from the cache size); below it every destination line is first
       read into the cache and later written back, a third pass over memory that a
       copy out of a mapping otherwise does not need.  SSE2 is part of x86-64; elsewhere
       this is memcpy. */
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #include <immintrin.h>
    #include <stdint.h>
    static void engine_stream_copy_sse2(char *d, const char *s, size_t n) {
        size_t head = (16 - ((uintptr_t)d & 15)) & 15, blocks, i;
        memcpy(d, s, head);
        d += head; s += head; n -= head;
        blocks = n / 64;
        for (i = 0; i < blocks; i++, d += 64, s += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
        memcpy(d, s, n - blocks * 64);
    }
    #if defined(__GNUC__) && defined(__x86_64__)
    /* 32-byte loads and streamed stores where the processor has AVX2: each core moves more
       bytes per cycle than with SSE2's 16, which the copy threads of a load need to reach the
       memory's bandwidth with few cores */
    __attribute__((target("avx2"))) static void engine_stream_copy_avx2(char *d, const char *s, size_t n) {
        size_t head = (32 - ((uintptr_t)d & 31)) & 31, blocks, i;
        memcpy(d, s, head);
        d += head; s += head; n -= head;
        blocks = n / 128;
        for (i = 0; i < blocks; i++, d += 128, s += 128) {
            __m256i a = _mm256_loadu_si256((const __m256i *)s);
            __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64));
            __m256i e = _mm256_loadu_si256((const __m256i *)(s + 96));
            _mm256_stream_si256((__m256i *)d, a);
            _mm256_stream_si256((__m256i *)(d + 32), b);
            _mm256_stream_si256((__m256i *)(d + 64), c);
            _mm256_stream_si256((__m256i *)(d + 96), e);
        }
        memcpy(d, s, n - blocks * 128);
    }
    /* and 64 at a time where it has AVX-512 (a few per cent more per core again) */
    __attribute__((target("avx512f"))) static void engine_stream_copy_avx512(char *d, const char *s, size_t n) {
        size_t head = (64 - ((uintptr_t)d & 63)) & 63, blocks, i;
        memcpy(d, s, head);
        d += head; s += head; n -= head;
        blocks = n / 256;
        for (i = 0; i < blocks; i++, d += 256, s += 256) {
            __m512i a = _mm512_loadu_si512((const void *)s);
            __m512i b = _mm512_loadu_si512((const void *)(s + 64));
            __m512i c = _mm512_loadu_si512((const void *)(s + 128));
            __m512i e = _mm512_loadu_si512((const void *)(s + 192));
            _mm512_stream_si512((void *)d, a);
            _mm512_stream_si512((void *)(d + 64), b);
            _mm512_stream_si512((void *)(d + 128), c);
            _mm512_stream_si512((void *)(d + 192), e);
        }
        memcpy(d, s, n - blocks * 256);
    }
    static int engine_simd = -1;  /* 0 SSE2, 1 AVX2, 2 AVX-512, as the processor has them */
    #endif
    static void engine_stream_copy(void *dst, const void *src, size_t n) {
        char *d = (char *)dst;
        const char *s = (const char *)src;
        if (n < 1024) {
            memcpy(d, s, n);
            return;
        }
    #if defined(__GNUC__) && defined(__x86_64__)
        if (engine_simd < 0)
            engine_simd = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
        if (engine_simd == 2)
            engine_stream_copy_avx512(d, s, n);
        else if (engine_simd == 1)
            engine_stream_copy_avx2(d, s, n);
        else
    #endif
            engine_stream_copy_sse2(d, s, n);
        _mm_sfence();  /* the streamed stores are visible before the copy reports done */
    }
    #else
    static void engine_stream_copy(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }
    #endif

    /* the next piece of a split copy: threads take pieces in order, each as it is free */
    static inline int64_t engine_take(int64_t *cursor, int64_t n) {
        return __atomic_fetch_add(cursor, n, __ATOMIC_RELAXED);
    }

    /* memcpy (or, with stream, engine_stream_copy) that returns -1 instead of dying where
       the source page is no longer backed */
    /* f(crc, src, n) under the same guard (the CRC of a mapped block just copied, read from
       the cache); -1 where the source page is no longer backed */
    typedef uint32_t (*engine_crc_fn)(uint32_t, const uint8_t *, size_t);
    static int engine_guarded_crc(engine_crc_fn f, uint32_t *crc, const void *src, size_t n) {
        sigjmp_buf jump;
        if (sigsetjmp(jump, 1) != 0)
            return -1;
        engine_bus_jump = &jump;
        *crc = f(*crc, (const uint8_t *)src, n);
        engine_bus_jump = NULL;
        return 0;
    }

    static int engine_guarded_copy(void *dst, const void *src, size_t n, int stream) {
        sigjmp_buf jump;
        if (sigsetjmp(jump, 1) != 0)
            return -1;
        engine_bus_jump = &jump;
        if (stream)
            engine_stream_copy(dst, src, n);
        else
            memcpy(dst, src, n);
        engine_bus_jump = NULL;
        return 0;
    }
    """
    int _bus_guard_ready "engine_bus_ready"() noexcept nogil
    int64_t _take "engine_take"(int64_t* cursor, int64_t n) noexcept nogil
    int _guarded_copy "engine_guarded_copy"(void* dst, const void* src, size_t n, int stream) noexcept nogil
    ctypedef uint32_t (*_crc_fn "engine_crc_fn")(uint32_t, const uint8_t*, size_t) noexcept nogil
    int _guarded_crc "engine_guarded_crc"(_crc_fn f, uint32_t* crc, const void* src, size_t n) noexcept nogil

cdef int _guard_ready() noexcept nogil:
    """Install the SIGBUS guard of mapped copies (0, or -1 where ``sigaction`` failed)."""
    return _bus_guard_ready()


cdef inline double _seconds() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


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
    is a multiple of 2 MiB (see ``_plan_parts``), so their runs begin and end on those lines."""
    cdef uintptr_t page = <uintptr_t>sysconf(_SC_PAGESIZE), zlo, zhi
    if src == NULL or lo >= hi:
        return
    if hi > src_len:
        hi = src_len
    zlo = (<uintptr_t>(src + lo) + page - 1) & ~(page - 1)
    zhi = (<uintptr_t>(src + hi)) & ~(page - 1)
    if zhi > zlo:
        madvise(<void*>zlo, zhi - zlo, _MADV_DONTNEED)


cdef inline void _release_run(_Part* p, int64_t lo, int64_t hi) noexcept nogil:
    """:func:`_unmap_run` for a part's run, except from a kept mapping, whose pages are kept
    mapped for the next load of the file (that is what keeping it is for)."""
    if not p.keep:
        _unmap_run(p.src, p.src_len, lo, hi)


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


# a checksummed copy goes this many bytes at a time, each block's CRC taken right after its
# copy while the block is still in the core's cache (one pass over the bytes from memory):
# small enough for a core's L2 with the source beside it, large enough that the populate
# call a mapped block makes costs nothing beside the block
cdef int64_t _DIGEST_BLOCK = 512 << 10


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


cdef int _copy_digest(_Part* p, uint8_t* out, int64_t nbytes, int64_t offset, uint32_t* crc) noexcept nogil:
    """:func:`_copy_piece`, block by block, each block's CRC-32C added to ``crc`` as it lands."""
    cdef int64_t n
    cdef int err
    while nbytes > 0:
        n = nbytes if nbytes < _DIGEST_BLOCK else _DIGEST_BLOCK
        err = _copy_piece(p, out, n, offset)
        if err:
            return err
        crc[0] = _crc_landed(p, out, n, offset, crc[0])
        out += n
        offset += n
        nbytes -= n
    return 0


cdef void* _read_part(void* arg) noexcept nogil:
    cdef _Part* p = <_Part*>arg
    cdef Py_ssize_t i = 0
    cdef int64_t a, b, lo, hi, t, at, run_lo, run_hi
    cdef uint32_t crc
    while True:
        # pieces are the cursor's steps moved back by shift (the first one shorter)
        t = _take(p.cursor, p.piece)
        lo = t - p.shift
        if lo < 0:
            lo = 0
        if lo >= p.total:
            break
        hi = t + p.piece - p.shift
        if hi > p.total:
            hi = p.total
        run_lo = run_hi = -1  # the file-contiguous run copied so far, unmapped as a whole
        # first segment that ends after lo (pieces go forward: the scan goes on from there)
        while i < p.nseg and p.starts[i] + p.sizes[i] <= lo:
            i += 1
        while i < p.nseg and p.starts[i] < hi:
            a = lo if lo > p.starts[i] else p.starts[i]
            b = p.starts[i] + p.sizes[i]
            if b > hi:
                b = hi
            at = p.file_off[i] + (a - p.starts[i])
            if p.cells != NULL:
                # this piece's cell of segment i (the pieces since the segment's first one)
                crc = 0
                p.err = _copy_digest(p, p.dst[i] + (a - p.starts[i]), b - a, at, &crc)
                p.cells[p.cellbase[i] + (t // p.piece) - (p.starts[i] + p.shift) // p.piece] = crc
            else:
                p.err = _copy_piece(p, p.dst[i] + (a - p.starts[i]), b - a, at)
            if p.err:
                p.errpos = a
                _release_run(p, run_lo, run_hi)
                return NULL
            if at != run_hi:
                _release_run(p, run_lo, run_hi)
                run_lo = at
            run_hi = at + (b - a)
            if b < p.starts[i] + p.sizes[i]:
                break  # the segment goes on past this piece
            i += 1
        _release_run(p, run_lo, run_hi)
    return NULL


# A set of segments to copy: segment i is sizes[i] bytes at file offset file_off[i], going to
# dst[i]; starts[i] is its position in the concatenation.  Built with the GIL (it reads Python
# buffers), used without it.
cdef struct _Segs:
    Py_ssize_t n
    const int64_t* file_off
    int64_t* sizes
    int64_t* starts
    uint8_t** dst
    int64_t total
    uint32_t* cells       # with checksums: one CRC per (segment, piece) cell, else NULL
    int64_t* cellbase


cdef void _free_segs(_Segs* s) noexcept:
    free(s.sizes); free(s.starts); free(s.dst); free(s.cells); free(s.cellbase)
    s.sizes = NULL
    s.starts = NULL
    s.dst = NULL
    s.cells = NULL
    s.cellbase = NULL


cdef int _alloc_segs(_Segs* s, Py_ssize_t n) except -1:
    s.n = n
    s.total = 0
    s.sizes = <int64_t*>calloc(n if n else 1, sizeof(int64_t))
    s.starts = <int64_t*>calloc(n if n else 1, sizeof(int64_t))
    s.dst = <uint8_t**>calloc(n if n else 1, sizeof(uint8_t*))
    s.cells = NULL
    s.cellbase = NULL
    if s.sizes == NULL or s.starts == NULL or s.dst == NULL:
        _free_segs(s)
        raise MemoryError()
    return 0


cdef int _segs_in_targets(_Segs* s, const int64_t[::1] file_offsets, list targets) except -1:
    """Segments into many buffers: segment i fills the whole of ``targets[i]``."""
    cdef Py_ssize_t n = len(targets), i
    cdef uint8_t[::1] view
    if file_offsets.shape[0] != n:
        raise ValueError("file_offsets and targets differ in length")
    _alloc_segs(s, n)
    s.file_off = &file_offsets[0] if n else NULL
    try:
        for i in range(n):
            if file_offsets[i] < 0:
                raise ValueError("negative offset")
            view = targets[i]  # writable, contiguous bytes, or TypeError/ValueError
            s.sizes[i] = view.shape[0]
            s.starts[i] = s.total
            s.dst[i] = &view[0] if view.shape[0] else NULL
            s.total += view.shape[0]
    except BaseException:
        _free_segs(s)
        raise
    return 0


# Threads take pieces of this size in order, each the next one as soon as it is free (a shared
# cursor), so that together they move through the file as one front: a cold file is then read
# ahead as one sequential stream, where halves read at once would be two streams the kernel's
# read-ahead serves one window at a time; and a thread held up (descheduled, or on the slower
# source) takes fewer pieces instead of making the others wait for its fixed share at the end
# of the copy.  Large enough that a piece costs a few system calls.
cdef int64_t _PIECE = 8 << 20
PIECE_BYTES = _PIECE
# the largest folio the page cache maps with one entry (a PMD on x86-64 and arm64 with 4 KiB pages)
cdef int64_t _FOLIO = 2 << 20


cdef int _plan_parts(_Part* parts, int nparts, int fd, const uint8_t* src, int64_t src_len, _Segs* s,
                     int64_t align, _Choice* choices, int stream, int keep, int64_t* cursor) noexcept nogil:
    """Shares of the concatenated segments: pieces of ``_PIECE`` bytes (less for a small set:
    an equal share each) taken in order from a shared cursor.  Pieces of 2 MiB and more (a
    host load's) are a multiple of 2 MiB, cut where the file offset is a
    multiple of 2 MiB (the first piece shorter), so that mapped pieces unmap whole 2 MiB
    folios (see ``_unmap_run``); where the segments follow each other in the file (a whole
    load, a batch) every cut is on such a line.  Smaller ones are cut a multiple of ``align``
    bytes into the concatenation.  With ``keep`` (a kept mapping), the pages a piece mapped
    stay mapped."""
    cdef int k
    cdef int64_t shift = 0
    cdef int64_t piece = (s.total + nparts - 1) // nparts
    if piece > _PIECE:
        piece = _PIECE
    if piece >= _FOLIO and s.n:
        piece = (piece + _FOLIO - 1) // _FOLIO * _FOLIO  # at most _PIECE, a multiple of _FOLIO
        shift = s.file_off[0] % _FOLIO
    else:
        piece = (piece + align - 1) // align * align
    for k in range(nparts):
        memset(&parts[k], 0, sizeof(_Part))
        parts[k].fd = fd
        parts[k].src = src
        parts[k].src_len = src_len
        parts[k].choice = &choices[k] if choices != NULL else NULL
        parts[k].stream = stream
        parts[k].keep = keep
        parts[k].dst = s.dst
        parts[k].file_off = s.file_off
        parts[k].sizes = s.sizes
        parts[k].starts = s.starts
        parts[k].nseg = s.n
        parts[k].cursor = cursor
        parts[k].piece = piece
        parts[k].total = s.total
        parts[k].shift = shift
    return 0


cdef int _plan_cells(_Part* parts, int nparts, _Segs* s) noexcept nogil:
    """Give the parts one CRC cell per (segment, piece) pair (``s.cells``, ``s.cellbase``):
    each cell is written by the one thread that copies that piece of the segment, so the
    threads need no lock, and :func:`_join_cells` joins a segment's cells in order.
    Returns -1 where memory ran out."""
    cdef Py_ssize_t i
    cdef int k
    cdef int64_t ncells = 0, piece = parts[0].piece, shift = parts[0].shift
    s.cellbase = <int64_t*>calloc(s.n if s.n else 1, sizeof(int64_t))
    if s.cellbase == NULL:
        return -1
    for i in range(s.n):
        s.cellbase[i] = ncells
        if s.sizes[i]:
            ncells += (s.starts[i] + s.sizes[i] - 1 + shift) // piece - (s.starts[i] + shift) // piece + 1
    s.cells = <uint32_t*>calloc(ncells if ncells else 1, sizeof(uint32_t))
    if s.cells == NULL:
        return -1
    for k in range(nparts):
        parts[k].cells = s.cells
        parts[k].cellbase = s.cellbase
        # the blocks, smaller than the pieces the copy times, still learn their source
        parts[k].timed = _DIGEST_BLOCK // 2
    return 0


cdef void _join_cells(_Segs* s, int64_t piece, int64_t shift, uint32_t* out) noexcept nogil:
    """``out[i]``: the CRC-32C of segment ``i``, its cells joined in order."""
    cdef Py_ssize_t i
    cdef int64_t j, j0, j1, lo, hi, a, b
    cdef uint32_t crc
    for i in range(s.n):
        crc = 0
        if s.sizes[i]:
            a = s.starts[i]
            b = a + s.sizes[i]
            j0 = (a + shift) // piece
            j1 = (b - 1 + shift) // piece
            for j in range(j0, j1 + 1):
                lo = j * piece - shift
                hi = lo + piece
                if lo < a:
                    lo = a
                if hi > b:
                    hi = b
                crc = crc32c_combine(crc, s.cells[s.cellbase[i] + j - j0], <uint64_t>(hi - lo))
        out[i] = crc


cdef int _share_count(int threads, int64_t total, int64_t align) noexcept nogil:
    cdef int n = threads
    if n > _MAX_SPLIT_THREADS:
        n = _MAX_SPLIT_THREADS
    if n < 1:
        n = 1
    if n > (total + align - 1) // align:
        n = <int>((total + align - 1) // align)
    return n


cdef tuple _first_error(_Part* parts, int nparts):
    """The failure lowest in the concatenation, or (0, 0, 0)."""
    cdef int k, first = -1
    for k in range(nparts):
        if parts[k].err and (first < 0 or parts[k].errpos < parts[first].errpos):
            first = k
    if first < 0:
        return (0, 0, 0)
    return (parts[first].err, parts[first].at, parts[first].missing)


# A pool of native threads kept for the length of a load: each read wakes them instead of
# starting new ones (a host load reads a batch at a time, dozens of times per load).

cdef struct _PoolState:
    pthread_mutex_t lock
    pthread_cond_t go
    pthread_cond_t done
    _Part* parts          # the current read's shares; worker i reads share i (the caller share 0)
    int nparts
    long generation       # bumped for each read
    int remaining         # worker shares of the current read not finished yet
    int stop


cdef struct _WorkerArg:
    _PoolState* st
    int index


cdef void* _pool_worker(void* arg) noexcept nogil:
    cdef _WorkerArg* w = <_WorkerArg*>arg
    cdef _PoolState* st = w.st
    cdef long seen = 0
    cdef _Part* part
    while True:
        pthread_mutex_lock(&st.lock)
        while st.generation == seen and not st.stop:
            pthread_cond_wait(&st.go, &st.lock)
        if st.stop:
            pthread_mutex_unlock(&st.lock)
            return NULL
        seen = st.generation
        part = &st.parts[w.index] if w.index < st.nparts else NULL
        pthread_mutex_unlock(&st.lock)
        if part != NULL:
            _read_part(part)
            pthread_mutex_lock(&st.lock)
            st.remaining -= 1
            if st.remaining == 0:
                pthread_cond_signal(&st.done)
            pthread_mutex_unlock(&st.lock)


cdef class SplitReader:
    """Split copies (:meth:`copy`) on native threads started once: ``threads - 1`` workers
    plus the calling thread.  One copy at a time; :meth:`close` (or the end of a ``with``
    block) stops and joins the workers.

    With ``adaptive``, copies given a mapping choose per piece between it and ``pread``:
    each thread times what mapping the pages of its pieces (1 MiB and up) costs against
    copying them, maps while that is under a quarter, else ``pread``s and maps the first MiB
    of a piece again now and then (after 2 pieces, then 4, up to 32), learning over the
    reader's life (see ``_Choice``); :attr:`costs` shows what they learned and
    :attr:`sources` what each source copied.  With ``stream``, copies out of the mapping
    store past the caches (for destinations nobody reads soon: a caller's
    tensors, owned blocks; not a buffer the DMA engine reads next, which is better found in
    the cache)."""

    cdef _PoolState* st
    cdef _WorkerArg* args
    cdef pthread_t* tids
    cdef _Choice* choices  # per thread, kept between copies (NULL: mapped copies always map)
    cdef int stream
    cdef int nworkers
    cdef bint busy

    def __cinit__(self, int threads, bint adaptive=False, bint stream=False):
        cdef int k, want = threads - 1
        if want > _MAX_SPLIT_THREADS - 1:
            want = _MAX_SPLIT_THREADS - 1
        if want < 0:
            want = 0
        self.st = <_PoolState*>calloc(1, sizeof(_PoolState))
        self.args = <_WorkerArg*>calloc(want + 1, sizeof(_WorkerArg))
        self.tids = <pthread_t*>calloc(want + 1, sizeof(pthread_t))
        self.stream = stream
        self.choices = <_Choice*>calloc(want + 1, sizeof(_Choice)) if adaptive else NULL
        if self.st == NULL or self.args == NULL or self.tids == NULL or (adaptive and self.choices == NULL):
            free(self.st); free(self.args); free(self.tids); free(self.choices)
            self.st = NULL
            self.choices = NULL
            raise MemoryError()
        pthread_mutex_init(&self.st.lock, NULL)
        pthread_cond_init(&self.st.go, NULL)
        pthread_cond_init(&self.st.done, NULL)
        self.nworkers = 0
        for k in range(want):
            self.args[self.nworkers + 1].st = self.st
            self.args[self.nworkers + 1].index = self.nworkers + 1
            if pthread_create(&self.tids[self.nworkers + 1], NULL, _pool_worker, &self.args[self.nworkers + 1]) == 0:
                self.nworkers += 1

    @property
    def threads(self) -> int:
        """Threads that share each read (the workers that started, plus the caller)."""
        return self.nworkers + 1

    @property
    def costs(self) -> list:
        """Per thread, ``(mapping, copying)``: seconds per byte that mapping the pages of the
        last timed mapped piece took, and that copying out of the mapping takes (0.0 before
        the first timed mapped piece); empty unless ``adaptive``.  The thread maps while the
        first is under a quarter of the second (see :attr:`sources`)."""
        cdef int k
        if self.choices == NULL:
            return []
        return [(self.choices[k].populate, self.choices[k].copy) for k in range(self.nworkers + 1)]

    @property
    def sources(self) -> list:
        """Per thread, ``(pread, mapping)``: bytes copied with each source over the reader's
        life; empty unless ``adaptive``."""
        cdef int k
        if self.choices == NULL:
            return []
        return [(self.choices[k].nbytes[0], self.choices[k].nbytes[1]) for k in range(self.nworkers + 1)]

    cdef tuple _run(self, int fd, const uint8_t* src, int64_t src_len, _Segs* s, int64_t align, bint keep,
                    uint32_t* digests=NULL):
        """Split ``s`` over the pool and the calling thread, GIL released; the first error.
        With ``digests``, ``digests[i]`` is set to segment ``i``'s CRC-32C."""
        cdef int64_t cursor = 0
        cdef _Part* parts = NULL
        cdef int nparts
        cdef int planned = 0
        cdef Py_ssize_t i
        cdef _PoolState* st = self.st
        if s.total == 0:
            if digests != NULL:
                for i in range(s.n):
                    digests[i] = 0
            return (0, 0, 0)
        if align < 1:
            align = 1
        nparts = _share_count(self.nworkers + 1, s.total, align)
        parts = <_Part*>calloc(nparts, sizeof(_Part))
        if parts == NULL:
            raise MemoryError()
        try:
            with nogil:
                cursor = 0
                _plan_parts(parts, nparts, fd, src, src_len, s, align, self.choices, self.stream, keep, &cursor)
                if digests != NULL:
                    planned = _plan_cells(parts, nparts, s)
            if planned != 0:
                raise MemoryError()
            with nogil:
                pthread_mutex_lock(&st.lock)
                st.parts = parts
                st.nparts = nparts
                st.remaining = nparts - 1
                st.generation += 1
                pthread_cond_broadcast(&st.go)
                pthread_mutex_unlock(&st.lock)
                _read_part(&parts[0])
                pthread_mutex_lock(&st.lock)
                while st.remaining > 0:
                    pthread_cond_wait(&st.done, &st.lock)
                st.parts = NULL
                st.nparts = 0
                pthread_mutex_unlock(&st.lock)
                if digests != NULL:
                    _join_cells(s, parts[0].piece, parts[0].shift, digests)
            return _first_error(parts, nparts)
        finally:
            free(parts)

    cdef int _enter(self) except -1:
        if self.st == NULL:
            raise ValueError("the reader is closed")
        if self.busy:
            raise RuntimeError("one read at a time per SplitReader")
        self.busy = True
        return 0

    def copy(self, int fd, mapping, const int64_t[::1] file_offsets, list targets, int64_t align=65536,
             bint keep=False, uint32_t[::1] digests=None):
        """Fill each of ``targets`` (writable contiguous buffers) with the file's bytes from
        ``file_offsets[i]`` on, the total split evenly over this reader's threads, GIL
        released.

        ``mapping`` is None (each thread ``pread``s its share) or a read-only mapping of the
        whole file (each thread maps its share with ``MADV_POPULATE_READ`` and copies it
        out; a page the file no longer backs is an end-of-file error, never a SIGBUS), or,
        for an ``adaptive`` reader, whichever of the two its pieces measure faster.  With
        ``keep`` (a mapping kept between loads, :mod:`engine.io.kept_mappings`) the pages mapped
        stay mapped, where otherwise each run is unmapped once copied: the next copy of them
        maps nothing, and an ``adaptive`` reader sees that in what mapping them costs and
        takes them from the mapping.
        With ``digests`` (a ``uint32`` array, one per target), ``digests[i]`` is set to the
        CRC-32C of what landed in ``targets[i]``, taken by the thread that copied each block
        right after copying it (copied a block at a time; the checksum reads the block while
        the core holds it: the mapping's lines just read, or what ``pread`` just stored), so
        the bytes come from memory once; the figures are only meaningful when the copy
        succeeded.
        Returns ``(0, 0, 0)`` on success, else ``(errno or -1 for end of file, file offset,
        bytes missing)`` of the failure lowest in the concatenation of the targets.
        """
        cdef _Segs s
        cdef uint32_t* out = NULL
        cdef const uint8_t[::1] src
        cdef const uint8_t* base = NULL
        cdef int64_t length = 0
        self._enter()
        try:
            if mapping is not None:
                src = mapping
                length = src.shape[0]
                base = &src[0] if length else NULL
                if _bus_guard_ready() != 0:
                    raise OSError("cannot install the SIGBUS guard of mapped copies")
            _segs_in_targets(&s, file_offsets, targets)
            try:
                if digests is not None:
                    if digests.shape[0] != s.n:
                        raise ValueError("digests and targets differ in length")
                    out = &digests[0] if s.n else NULL
                if mapping is not None and base == NULL and s.total:
                    return (-1, 0, s.total)  # an empty file maps to nothing
                return self._run(fd, base, length, &s, align, keep and base != NULL, out)
            finally:
                _free_segs(&s)
        finally:
            self.busy = False

    def close(self) -> None:
        """Stop and join the workers (idempotent)."""
        cdef int k
        cdef _PoolState* st = self.st
        if st == NULL:
            return
        with nogil:
            pthread_mutex_lock(&st.lock)
            st.stop = 1
            pthread_cond_broadcast(&st.go)
            pthread_mutex_unlock(&st.lock)
            for k in range(1, self.nworkers + 1):
                pthread_join(self.tids[k], NULL)
        pthread_cond_destroy(&st.go)
        pthread_cond_destroy(&st.done)
        pthread_mutex_destroy(&st.lock)
        free(st); free(self.args); free(self.tids); free(self.choices)
        self.st = NULL
        self.choices = NULL
        self.args = NULL
        self.tids = NULL
        self.nworkers = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __dealloc__(self):
        self.close()


def resident_pages(const uint8_t[::1] region):
    """``(resident, total)``: pages of a file mapping's ``region`` in the page cache now, by
    ``mincore``; ``(-errno, total)`` when the kernel refuses.  Touches no page, so it
    cannot fault, whatever happened to the file."""
    cdef size_t page = <size_t>sysconf(_SC_PAGESIZE)
    cdef size_t addr, first, length, npages, i, count = 0
    cdef unsigned char* vec = NULL
    cdef int rc
    if region.shape[0] == 0:
        return (0, 0)
    addr = <size_t>&region[0]
    first = addr - addr % page
    length = addr + <size_t>region.shape[0] - first
    npages = (length + page - 1) // page
    vec = <unsigned char*>calloc(npages, 1)
    if vec == NULL:
        raise MemoryError()
    try:
        with nogil:
            rc = mincore(<void*>first, length, vec)
            if rc == 0:
                for i in range(npages):
                    count += vec[i] & 1
        if rc != 0:
            return (-errno, npages)
        return (count, npages)
    finally:
        free(vec)

# -- read-ahead of a file mapping ----------------------------------------------------------------
# (kept apart from the read loops above: these touch a mapping, never a file descriptor)


cdef inline uintptr_t _page_down(uintptr_t x, Py_ssize_t page) noexcept nogil:
    return x & ~(<uintptr_t>page - 1)


def mapping_resident(const uint8_t[::1] buf, Py_ssize_t start, Py_ssize_t stop, int samples=16):
    """Whether ``samples`` pages spread evenly over ``buf[start:stop]`` of a file mapping
    are all in the page cache (``mincore``; the pages need not be mapped yet).

    A sample, not a census: asking for every page of a 2 GB mapping costs tens of
    milliseconds, which is more than a warm mapped load takes.
    """
    cdef Py_ssize_t n = buf.shape[0]
    if start < 0 or stop > n or start >= stop:
        return True
    cdef Py_ssize_t page = sysconf(_SC_PAGESIZE)
    cdef uintptr_t lo = _page_down(<uintptr_t>&buf[0] + start, page)
    cdef size_t pages = (<uintptr_t>&buf[0] + stop - lo + page - 1) // page
    cdef size_t k, steps = <size_t>(samples - 1) if samples > 1 else 1
    cdef unsigned char vec = 0
    cdef bint resident = True
    with nogil:
        for k in range(<size_t>max(samples, 1)):
            if mincore(<void*>(lo + (k * (pages - 1) // steps) * page), 1, &vec) != 0 or not (vec & 1):
                resident = False
                break
    return resident


def populate_mapping(const uint8_t[::1] buf, Py_ssize_t start, Py_ssize_t stop):
    """Read ``buf[start:stop]`` of a file mapping into the page cache and map it, without
    the GIL: ``MADV_POPULATE_READ``, which blocks until the pages are in; kernels without
    it (before 5.14: ``EINVAL``) get ``MADV_WILLNEED``, which only starts the reads.

    Returns ``errno`` or 0.  Advice only: the caller may ignore an error (touching the
    pages then reports it the way a mapping does).
    """
    cdef Py_ssize_t n = buf.shape[0]
    if start < 0 or stop > n or start >= stop:
        return 0
    cdef Py_ssize_t page = sysconf(_SC_PAGESIZE)
    cdef uintptr_t lo = _page_down(<uintptr_t>&buf[0] + start, page)
    cdef size_t length = <uintptr_t>&buf[0] + stop - lo
    cdef int err = 0
    with nogil:
        if madvise(<void*>lo, length, _MADV_POPULATE_READ) != 0:
            err = errno
            if err == 22:  # EINVAL: a kernel without MADV_POPULATE_READ
                err = 0
                if madvise(<void*>lo, length, MADV_WILLNEED) != 0:
                    err = errno
    return err


def populate_write(uint8_t[::1] buf):
    """Fault in the whole pages of ``buf`` for writing, without the GIL
    (``MADV_POPULATE_WRITE``): one system call instead of a page fault per 4 KiB inside a
    later copy into fresh memory (a socket receive, say).  The contents are unchanged.

    Returns ``errno`` or 0 (``EINVAL``: a kernel before 5.14, where the copy faults the
    pages in as before).  Advice only.
    """
    cdef Py_ssize_t n = buf.shape[0]
    if n == 0:
        return 0
    cdef Py_ssize_t page = sysconf(_SC_PAGESIZE)
    cdef uintptr_t first = <uintptr_t>&buf[0]
    cdef uintptr_t lo = _page_down(first + page - 1, page)  # whole pages only: the others
    cdef uintptr_t hi = _page_down(first + n, page)         # may belong to a neighbour
    cdef int err = 0
    if hi <= lo:
        return 0
    with nogil:
        if madvise(<void*>lo, hi - lo, _MADV_POPULATE_WRITE) != 0:
            err = errno
    return err


def populate_ranges(list steps, Py_ssize_t first, Py_ssize_t stride, int32_t[::1] stop):
    """Fault in the whole pages of the writable views of ``steps[first::stride]`` (each step
    a list of views) for writing, in that order, with ``MADV_POPULATE_WRITE``: one call per
    run of views that follow each other in memory.  The GIL is held only to find the views'
    addresses.  Several threads, each with its own ``first`` and the same ``stride``, fault
    a fresh destination in ahead of the copies into it.  Stops between runs once ``stop[0]``
    is nonzero.  The caller keeps the views alive until the call returns.

    Returns ``errno`` of the first failure, or 0 (``EINVAL``: a kernel before 5.14; the
    copies then fault the pages in themselves).
    """
    if stride < 1 or first < 0:
        raise ValueError("first must be >= 0 and stride >= 1")
    cdef Py_ssize_t n = 0, i, k = 0
    for i in range(first, len(steps), stride):
        n += len(steps[i])
    if n == 0:
        return 0
    cdef uintptr_t* lo = <uintptr_t*>calloc(2 * n, sizeof(uintptr_t))
    if lo == NULL:
        raise MemoryError()
    cdef uintptr_t* hi = lo + n
    cdef uintptr_t a
    cdef Py_ssize_t page = sysconf(_SC_PAGESIZE)
    cdef uint8_t[::1] v
    cdef int err = 0
    cdef volatile int32_t* flag = &stop[0]
    try:
        for i in range(first, len(steps), stride):
            for view in steps[i]:
                v = view
                if v.shape[0] == 0:
                    continue
                a = <uintptr_t>&v[0]
                if k and hi[k - 1] == a:  # follows the previous view: one call for both
                    hi[k - 1] = a + v.shape[0]
                else:
                    lo[k] = a
                    hi[k] = a + v.shape[0]
                    k += 1
        with nogil:
            for i in range(k):
                if flag[0]:
                    break
                a = _page_down(lo[i] + page - 1, page)  # whole pages only: the ends may be a
                if _page_down(hi[i], page) <= a:         # neighbour's, written meanwhile
                    continue
                if madvise(<void*>a, _page_down(hi[i], page) - a, _MADV_POPULATE_WRITE) != 0:
                    err = errno
                    if err != EINTR and err != EAGAIN:
                        break
                    err = 0
    finally:
        free(lo)
    return err


cdef extern from "<fcntl.h>" nogil:
    int sync_file_range(int fd, off_t offset, off_t nbytes, unsigned int flags)
    enum: SYNC_FILE_RANGE_WRITE


def start_writeback(int fd, off_t offset, off_t nbytes):
    """Start writing the dirty pages of ``nbytes`` of ``fd`` from ``offset`` to the disk, and
    return at once (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, GIL released), so that a file
    written during a load is mostly on the disk when it is ``fsync``-ed.  Returns ``errno``
    or 0; advice only (the ``fsync`` is what makes the bytes durable)."""
    cdef int rc
    with nogil:
        rc = sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)
    return errno if rc != 0 else 0


def guarded_copy(const uint8_t[::1] src, Py_ssize_t offset, uint8_t[::1] dst):
    """Copy ``len(dst)`` bytes of the file mapping ``src`` from ``offset`` into ``dst`` under
    the SIGBUS guard alone (no populate step first): 0, or -1 where a page is no longer
    backed by the file.  The guard's own test; loads go through :class:`SplitReader`."""
    if offset < 0 or offset + dst.shape[0] > src.shape[0]:
        raise ValueError("the range is outside the mapping")
    if dst.shape[0] == 0:
        return 0
    if _bus_guard_ready() != 0:
        raise OSError("cannot install the SIGBUS guard of mapped copies")
    cdef int rc
    with nogil:
        rc = _guarded_copy(&dst[0], &src[0] + offset, <size_t>dst.shape[0], 0)
    return rc


# -- strided runs through a bounce buffer --------------------------------------------------------

from libc.string cimport memcpy


cdef int _pread_full(int fd, uint8_t* out, int64_t nbytes, int64_t offset, int64_t* at,
                     int64_t* missing) noexcept nogil:
    """Read exactly ``nbytes`` at ``offset`` into ``out``, in calls of at most ``_MAX_PREAD``
    bytes, again after ``EINTR`` and short reads: 0, an errno, or -1 for the end of the
    file, with ``at``/``missing`` set to where the read stopped and what it still lacked.
    The one pread loop of this module: every read in native code goes through it (the
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


def pread_spans(int fd, uint8_t[::1] dst, const int64_t[::1] src, Py_ssize_t run_bytes, int64_t base,
                uint8_t[::1] bounce):
    """Like :func:`pread_runs`, but reads the dense span that covers consecutive runs into
    ``bounce`` with one ``pread`` and copies the runs out of it.

    Runs ``i..j`` share a read while ``src`` increases and ``src[j] + run_bytes - src[i]``
    fits in ``bounce``; a run larger than ``bounce`` is read straight into ``dst``.  Reads
    the gaps between runs too (more bytes, far fewer calls).  Returns ``(0, 0, 0)`` or
    ``(errno or -1 for end of file, file offset, bytes missing)``; no GIL in the loop.
    """
    cdef Py_ssize_t n = src.shape[0], cap = bounce.shape[0], i = 0, j, k
    cdef int64_t span
    cdef int err = 0
    cdef int64_t at = 0
    cdef int64_t missing = 0
    if n * run_bytes > dst.shape[0]:
        raise ValueError("destination too small for the runs")
    if n == 0 or run_bytes == 0:
        return (0, 0, 0)
    cdef uint8_t* out = &dst[0]
    cdef uint8_t* tmp = &bounce[0] if cap else NULL
    with nogil:
        while i < n and not err:
            if run_bytes > cap:
                err = _pread_full(fd, out + i * run_bytes, run_bytes, base + src[i], &at, &missing)
                i += 1
                continue
            j = i
            while j + 1 < n and src[j + 1] >= src[j] and src[j + 1] + run_bytes - src[i] <= cap:
                j += 1
            span = src[j] + run_bytes - src[i]
            err = _pread_full(fd, tmp, span, base + src[i], &at, &missing)
            if err:
                break
            for k in range(i, j + 1):
                memcpy(out + k * run_bytes, tmp + (src[k] - src[i]), run_bytes)
            i = j + 1
    return (err, at, missing)


def spans_bytes(const int64_t[::1] src, Py_ssize_t run_bytes, Py_ssize_t cap):
    """Bytes :func:`pread_spans` reads for these runs with a bounce of ``cap`` bytes."""
    cdef Py_ssize_t n = src.shape[0], i = 0, j
    cdef int64_t total = 0
    if run_bytes == 0:
        return 0
    with nogil:
        while i < n:
            if run_bytes > cap:
                total += run_bytes
                i += 1
                continue
            j = i
            while j + 1 < n and src[j + 1] >= src[j] and src[j + 1] + run_bytes - src[i] <= cap:
                j += 1
            total += src[j] + run_bytes - src[i]
            i = j + 1
    return total
