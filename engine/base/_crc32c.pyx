# cython: language_level=3, embedsignature=True
# distutils: language = c
#
# Bounds/wraparound checks and cdivision are set once in setup.py (ENGINE_CYTHON_CHECKS=1
# turns them on).
"""CRC-32C natively: the per-tensor checksum of :mod:`engine.format.checksums`.

Private: the public face is :mod:`engine.format.checksums`.  The arithmetic is in
``_crc32c_impl.h`` (SSE4.2 ``crc32`` on three interleaved streams where the CPU has it, a
slicing-by-8 table elsewhere, chosen once at import); ``engine/io/_io.pyx`` and ``_split.pyx``
cimport :func:`crc32c_update` and :func:`crc32c_combine` (``_crc32c.pxd``).
"""

from libc.stdint cimport int64_t, uint32_t, uint8_t, uint64_t


cdef extern from "_crc32c_impl.h" nogil:
    void engine_crc32c_init()
    uint32_t engine_crc32c_update(uint32_t crc, const uint8_t* p, size_t n)
    uint32_t engine_crc32c_update_sw(uint32_t crc, const uint8_t* p, size_t n)
    uint32_t engine_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
    int engine_crc32c_hw


engine_crc32c_init()


cdef uint32_t crc32c_update(uint32_t crc, const uint8_t* p, size_t n) noexcept nogil:
    """The CRC-32C of the bytes whose CRC-32C is ``crc`` (0 for none) followed by ``p[:n]``."""
    return engine_crc32c_update(crc, p, n)


cdef uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) noexcept nogil:
    """The CRC-32C of ``A + B`` from ``crc1`` of ``A``, ``crc2`` of ``B`` and ``len(B)``."""
    return engine_crc32c_combine(crc1, crc2, len2)


def crc32c(const uint8_t[::1] data, uint32_t crc=0, bint hardware=True) -> int:
    """CRC-32C of ``data`` (any contiguous buffer), continuing ``crc``; GIL released.
    ``hardware=False`` forces the table (to test one against the other)."""
    cdef size_t n = data.shape[0]
    cdef const uint8_t* p = &data[0] if n else NULL
    with nogil:
        if n:
            crc = engine_crc32c_update(crc, p, n) if hardware else engine_crc32c_update_sw(crc, p, n)
    return crc


def combine(uint32_t crc1, uint32_t crc2, uint64_t len2) -> int:
    """The CRC-32C of ``A + B`` from the CRC-32C of each and ``len(B)``."""
    return engine_crc32c_combine(crc1, crc2, len2)


def hardware() -> bool:
    """Whether this CPU's ``crc32`` instruction computes the checksums."""
    return engine_crc32c_hw != 0


def combine_rows(const uint32_t[::1] crcs, const int64_t[::1] sizes, const int64_t[::1] groups,
                 uint32_t[::1] out) -> None:
    """``out[groups[i]] = combine(out[groups[i]], crcs[i], sizes[i])`` for each ``i`` in
    order: segments of several tensors, each tensor's in its byte order, joined per tensor."""
    cdef Py_ssize_t i, n = crcs.shape[0]
    cdef int64_t g
    if sizes.shape[0] != n or groups.shape[0] != n:
        raise ValueError("crcs, sizes and groups differ in length")
    for i in range(n):
        g = groups[i]
        if g < 0 or g >= out.shape[0]:
            raise IndexError("group out of range")
    with nogil:
        for i in range(n):
            out[groups[i]] = engine_crc32c_combine(out[groups[i]], crcs[i], <uint64_t>sizes[i])


def spans(const uint8_t[::1] buf, const int64_t[::1] lo, const int64_t[::1] hi, uint32_t[::1] out) -> None:
    """``out[i]`` = CRC-32C of ``buf[lo[i]:hi[i]]`` for each ``i``, GIL released (the
    verification of tensors handed out as views of a mapping, which copies nothing)."""
    cdef Py_ssize_t i, n = lo.shape[0]
    cdef const uint8_t* base
    if hi.shape[0] != n or out.shape[0] != n:
        raise ValueError("lo, hi and out differ in length")
    for i in range(n):
        if lo[i] < 0 or hi[i] < lo[i] or hi[i] > buf.shape[0]:
            raise IndexError("span out of the buffer")
    if n == 0:
        return
    base = &buf[0] if buf.shape[0] else NULL
    with nogil:
        for i in range(n):
            out[i] = engine_crc32c_update(0, base + lo[i], <size_t>(hi[i] - lo[i])) if hi[i] > lo[i] else 0
