# cython: language_level=3, embedsignature=True
# distutils: language = c
#
# Bounds/wraparound checks and cdivision are set once in setup.py (ENGINE_CYTHON_CHECKS=1
# turns them on).
"""A device load's chunk plan, natively: its pieces cut into the chunks the ring moves.

Private: the public face is :mod:`engine.gpu.chunk_plan`, which sizes the output arrays and
trims them; :meth:`engine.gpu._ring.ChunkRing.run` takes the plan.
"""

from libc.stdint cimport int32_t, int64_t, uint64_t


def plan(const int32_t[::1] p_file, const int64_t[::1] p_off, const int64_t[::1] p_len,
         const uint64_t[::1] p_dst, int64_t chunk_bytes, int32_t[::1] c_file, int64_t[::1] c_seg,
         int64_t[::1] s_pos, int64_t[::1] s_off, int64_t[::1] s_len, uint64_t[::1] s_dst):
    """Cut pieces (file, file offset, bytes, device address), in load order, into chunks.

    A chunk holds the pieces of one file that fall in one ``chunk_bytes``-aligned block of
    it, packed back to back (a gap in the file costs no chunk space); a piece that crosses a
    block's end is split there.  So a whole file's chunks are its aligned blocks (2 MiB lines,
    where the page cache's large folios end, for chunk sizes that are multiples of 2 MiB),
    and adjacent pieces contiguous on both sides merge into one segment (one DMA).

    Output arrays must hold ``len(p_len) + total // chunk_bytes + 1`` chunks (``c_seg`` one
    more) and as many segments.  Returns ``(chunks, segments)``.
    """
    cdef Py_ssize_t i, n = p_len.shape[0]
    cdef int64_t k = -1, m = -1, off, left, take, used = 0, block = -1, dst
    cdef int32_t f = -1
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be positive")
    if p_off.shape[0] != n or p_file.shape[0] != n or p_dst.shape[0] != n:
        raise ValueError("the pieces' arrays differ in length")
    with nogil:
        for i in range(n):
            off = p_off[i]
            left = p_len[i]
            dst = <int64_t>p_dst[i]
            while left > 0:
                take = chunk_bytes - off % chunk_bytes
                if take > left:
                    take = left
                if p_file[i] != f or off // chunk_bytes != block or used + take > chunk_bytes:
                    k += 1
                    if k >= c_file.shape[0]:
                        with gil:
                            raise ValueError("too few chunks in the output")
                    f = p_file[i]
                    block = off // chunk_bytes
                    c_file[k] = f
                    c_seg[k] = m + 1
                    used = 0
                if (m >= 0 and c_seg[k] <= m and s_off[m] + s_len[m] == off
                        and <int64_t>s_dst[m] + s_len[m] == dst and s_pos[m] + s_len[m] == used):
                    s_len[m] += take
                else:
                    m += 1
                    if m >= s_len.shape[0]:
                        with gil:
                            raise ValueError("too few segments in the output")
                    s_pos[m] = used
                    s_off[m] = off
                    s_len[m] = take
                    s_dst[m] = <uint64_t>dst
                used += take
                off += take
                dst += take
                left -= take
        c_seg[k + 1] = m + 1
    return (k + 1, m + 1)
