# cython: language_level=3, embedsignature=True
# distutils: language = c
#
# Bounds/wraparound checks and cdivision are set once in setup.py (ENGINE_CYTHON_CHECKS=1
# turns them on).
"""The page cache and page tables around a load, natively: which pages of a mapping are
resident (``mincore``), mapping them ahead of use (``MADV_POPULATE_READ``), faulting fresh
memory in for writing (``MADV_POPULATE_WRITE``) and starting the write-back of a file
written meanwhile (``sync_file_range``).  Each call is advice or a census: it moves no
tensor byte, and the system calls run with the GIL released.

Private: the public wrappers are in :mod:`engine.io.reader` (``prefetch_mapping``,
``populate_mapping``, ``populate_write``, ``FaultAhead``, ``start_writeback``,
``resident_pages``).
"""

from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport int32_t, uint8_t, uintptr_t
from libc.stdlib cimport calloc, free

from engine.io._mman cimport (
    _MADV_POPULATE_READ, _MADV_POPULATE_WRITE, _SC_PAGESIZE, MADV_WILLNEED, madvise, mincore, sysconf,
)
from posix.types cimport off_t


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


# -- read-ahead of a file mapping, and fresh memory faulted in for writing -----------------------


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


# -- write-back of a file written during a load --------------------------------------------------

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
