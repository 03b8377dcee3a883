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
