# cython: language_level=3, embedsignature=True
# distutils: language = c
#
# Bounds/wraparound checks and cdivision are set once in setup.py (ENGINE_CYTHON_CHECKS=1
# turns them on).
"""Native I/O loops, GIL released: many positional reads in one call.

Private: the public wrapper is :mod:`engine.reader`, which turns the error codes returned
here into :class:`~engine.errors.ReadError` with the file, offset and size.
"""

from libc.errno cimport EINTR, errno
from libc.stdint cimport int64_t, uint8_t
from posix.types cimport off_t
from posix.unistd cimport pread


def pread_runs(int fd, uint8_t[::1] dst, const int64_t[::1] src, Py_ssize_t run_bytes, int64_t base):
    """Read ``len(src)`` runs of ``run_bytes`` bytes at file offsets ``base + src[i]`` into
    ``dst[i * run_bytes : (i + 1) * run_bytes]``.

    Returns ``(0, 0, 0)`` on success, else ``(errno or -1 for end of file, file offset,
    bytes missing)`` of the first failure.  The loop runs without the GIL.
    """
    cdef Py_ssize_t n = src.shape[0], i
    cdef Py_ssize_t done
    cdef ssize_t got
    cdef int err = 0
    cdef int64_t at = 0
    cdef Py_ssize_t missing = 0
    if n * run_bytes > dst.shape[0]:
        raise ValueError("destination too small for the runs")
    if n == 0 or run_bytes == 0:
        return (0, 0, 0)
    cdef uint8_t* out = &dst[0]
    with nogil:
        for i in range(n):
            done = 0
            while done < run_bytes:
                got = pread(fd, out + i * run_bytes + done, run_bytes - done, <off_t>(base + src[i] + done))
                if got > 0:
                    done += got
                    continue
                if got < 0 and errno == EINTR:
                    continue
                err = errno if got < 0 else -1
                at = base + src[i] + done
                missing = run_bytes - done
                break
            if err:
                break
    return (err, at, missing)


# -- read-ahead of a file mapping ----------------------------------------------------------------
# (kept apart from the read loops above: these touch a mapping, never a file descriptor)

cdef extern from "<sys/mman.h>" nogil:
    int madvise(void* addr, size_t length, int advice)
    int mincore(void* addr, size_t length, unsigned char* vec)
    int MADV_WILLNEED

from libc.stdint cimport uintptr_t
from posix.unistd cimport sysconf, _SC_PAGESIZE

# Linux 5.14+; the headers of older C libraries may lack the name, the number is the ABI's
cdef enum:
    _MADV_POPULATE_READ = 22


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


# -- strided runs through a bounce buffer --------------------------------------------------------

from libc.string cimport memcpy


cdef int _pread_full(int fd, uint8_t* out, Py_ssize_t nbytes, int64_t offset, int64_t* at,
                     Py_ssize_t* missing) noexcept nogil:
    """Read exactly ``nbytes``; 0, an errno, or -1 for the end of the file (``at``/``missing`` set)."""
    cdef Py_ssize_t done = 0
    cdef ssize_t got
    while done < nbytes:
        got = pread(fd, out + done, nbytes - done, <off_t>(offset + done))
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
    cdef Py_ssize_t missing = 0
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
