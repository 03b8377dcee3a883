# cython: language_level=3, embedsignature=True
# distutils: language = c
#
# Bounds/wraparound checks and cdivision are set once in setup.py (ENGINE_CYTHON_CHECKS=1
# turns them on).
"""Gathers of strided runs, GIL released: many positional reads in one call.

Private: the public wrappers are :func:`engine.io.reader.pread_runs`,
:func:`~engine.io.reader.pread_spans` and :func:`~engine.io.reader.spans_bytes`, which turn
the error codes returned here into :class:`~engine.errors.ReadError` with the file, offset
and size.  A column block of a tensor is read a run per row: one ``pread`` per run, or one
per dense span of runs through a small bounce buffer.  Every read goes through the one
``pread`` loop of the copy engine (``_pread_full``, ``_io.pxd``).
"""

from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcpy

from engine.io._io cimport _pread_full


cdef bint _runs_to_read(Py_ssize_t n, Py_ssize_t run_bytes, Py_ssize_t room) except -1:
    """Whether ``n`` runs of ``run_bytes`` hold any byte to read; ValueError where they do not
    fit in the ``room`` bytes of the destination."""
    if n * run_bytes > room:
        raise ValueError("destination too small for the runs")
    return n != 0 and run_bytes != 0


def pread_runs(int fd, uint8_t[::1] dst, const int64_t[::1] src, Py_ssize_t run_bytes, int64_t base):
    """Read ``len(src)`` runs of ``run_bytes`` bytes at file offsets ``base + src[i]`` into
    ``dst[i * run_bytes : (i + 1) * run_bytes]``.

    Returns ``(0, 0, 0)`` on success, else ``(errno or -1 for end of file, file offset,
    bytes missing)`` of the first failure.  The loop runs without the GIL.
    """
    cdef Py_ssize_t n = src.shape[0], i
    cdef int err = 0
    cdef int64_t at = 0, missing = 0
    if not _runs_to_read(n, run_bytes, dst.shape[0]):
        return (0, 0, 0)
    cdef uint8_t* out = &dst[0]
    with nogil:
        for i in range(n):
            err = _pread_full(fd, out + i * run_bytes, run_bytes, base + src[i], &at, &missing)
            if err:
                break
    return (err, at, missing)


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
    cdef int64_t at = 0, missing = 0
    if not _runs_to_read(n, run_bytes, dst.shape[0]):
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
