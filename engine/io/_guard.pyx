# cython: language_level=3, embedsignature=True
# distutils: language = c
#
# Bounds/wraparound checks and cdivision are set once in setup.py (ENGINE_CYTHON_CHECKS=1
# turns them on).
"""Copies out of a file mapping that a truncated file cannot end with SIGBUS.

Private: the copy engine (``engine/io/_io.pyx``) cimports these for its mapped copies and
the CRC it reads back out of the mapping (``_guard.pxd``); :func:`guarded_copy` is the
guard's own test.  One translation unit holds the handler and the per-thread jump it takes,
so there is one of each in the process.  The guarded copy may stream its stores past the
caches (``engine_stream_copy``), for destinations nobody reads soon.
"""

from libc.stdint cimport uint8_t, uint32_t

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

    /* memcpy (or, with stream, engine_stream_copy) that returns -1 instead of dying where
       the source page is no longer backed */
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
    int _c_bus_ready "engine_bus_ready"() noexcept nogil
    int _c_guarded_copy "engine_guarded_copy"(void* dst, const void* src, size_t n, int stream) noexcept nogil
    int _c_guarded_crc "engine_guarded_crc"(_crc_fn f, uint32_t* crc, const void* src, size_t n) noexcept nogil


cdef int _bus_guard_ready() noexcept nogil:
    """Put the SIGBUS handler first in line (0, or -1 where ``sigaction`` failed); called
    before each mapped copy (``engine_bus_ready``)."""
    return _c_bus_ready()


cdef int _guarded_copy(void* dst, const void* src, size_t n, int stream) noexcept nogil:
    """``n`` bytes from the mapping ``src`` to ``dst`` (streamed stores with ``stream``): 0,
    or -1 where a source page is no longer backed by the file."""
    return _c_guarded_copy(dst, src, n, stream)


cdef int _guarded_crc(_crc_fn f, uint32_t* crc, const void* src, size_t n) noexcept nogil:
    """``crc[0] = f(crc[0], src, n)`` over ``n`` bytes of the mapping ``src``: 0, or -1 where a
    source page is no longer backed by the file (``crc[0]`` then means nothing)."""
    return _c_guarded_crc(f, crc, src, n)


def guarded_copy(const uint8_t[::1] src, Py_ssize_t offset, uint8_t[::1] dst):
    """Copy ``len(dst)`` bytes of the file mapping ``src`` from ``offset`` into ``dst`` under
    the SIGBUS guard alone (no populate step first): 0, or -1 where a page is no longer
    backed by the file.  The guard's own test; loads go through
    :class:`engine.io._split.SplitReader`."""
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
