# Included by _header.pyx (one extension module: the scanner's C calls stay direct).
# The region check: tensors' byte ranges sorted, contiguous from 0, covering the data exactly.

cdef int rec_cmp(const void* pa, const void* pb) noexcept nogil:
    cdef const Rec* a = <const Rec*>pa
    cdef const Rec* b = <const Rec*>pb
    if a.begin != b.begin:
        return -1 if a.begin < b.begin else 1
    if a.end != b.end:
        return -1 if a.end < b.end else 1
    if a.row != b.row:
        return -1 if a.row < b.row else 1
    return 0


cdef inline bint rec_less(const Rec* a, const Rec* b) noexcept nogil:
    if a.begin != b.begin:
        return a.begin < b.begin
    if a.end != b.end:
        return a.end < b.end
    return a.row < b.row


cdef void sort_recs(Rec* recs, size_t n) noexcept nogil:
    """Sort by (begin, end, row): a bottom-up merge sort with the comparison inlined (about
    3x faster than qsort's comparator calls); rows are unique, so the order is total."""
    cdef size_t RUN = 32, lo, hi, i, j, k, mid, width
    cdef Rec x
    cdef Rec* src = recs
    cdef Rec* dst
    cdef Rec* swap
    cdef Rec* tmp = <Rec*>malloc(n * sizeof(Rec)) if n > RUN else NULL
    if n > RUN and tmp == NULL:
        qsort(recs, n, sizeof(Rec), rec_cmp)  # no memory for the merge buffer
        return
    # insertion sort of short runs
    lo = 0
    while lo < n:
        hi = lo + RUN if lo + RUN < n else n
        for i in range(lo + 1, hi):
            x = recs[i]
            j = i
            while j > lo and rec_less(&x, &recs[j - 1]):
                recs[j] = recs[j - 1]
                j -= 1
            recs[j] = x
        lo = hi
    if tmp == NULL:
        return
    # merge runs of doubling width, ping-ponging between recs and tmp
    dst = tmp
    width = RUN
    while width < n:
        lo = 0
        while lo < n:
            mid = lo + width if lo + width < n else n
            hi = lo + 2 * width if lo + 2 * width < n else n
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                if rec_less(&src[j], &src[i]):
                    dst[k] = src[j]
                    j += 1
                else:
                    dst[k] = src[i]
                    i += 1
                k += 1
            if i < mid:
                memcpy(&dst[k], &src[i], (mid - i) * sizeof(Rec))
            elif j < hi:
                memcpy(&dst[k], &src[j], (hi - j) * sizeof(Rec))
            lo = hi
        swap = src
        src = dst
        dst = swap
        width *= 2
    if src != recs:
        memcpy(recs, src, n * sizeof(Rec))
    free(tmp)


cdef int region_check(Rec* recs, size_t n, uint64_t data_size, RegionError* err) noexcept nogil:
    """Sort by (begin, end, row) and walk once: the regions must tile [0, data_size) exactly.

    O(n log n) for the sort (skipped for input already in order), O(n) for the walk.

    Zero-size regions are legal anywhere on a boundary.  Input already in file order (the
    usual case: writers lay tensors out in header order) skips the sort.  ``recs`` is left
    sorted.
    """
    cdef size_t i
    cdef uint64_t expected = 0
    cdef bint is_sorted = True
    for i in range(n):
        if recs[i].end < recs[i].begin:
            err.reason = R_INFO
            err.kind = 0
            err.row = recs[i].row
            err.a = recs[i].begin
            err.b = recs[i].end
            return -1
        if i and is_sorted and rec_less(&recs[i], &recs[i - 1]):
            is_sorted = False
    if not is_sorted:
        sort_recs(recs, n)
    for i in range(n):
        if recs[i].begin != expected:
            err.reason = R_OFFSET
            err.row = recs[i].row
            err.a = recs[i].begin
            err.b = expected
            if i == 0:
                err.kind = 1
            else:
                err.kind = 2 if recs[i].begin < expected else 3
                err.prev = recs[i - 1].row
            return -1
        expected = recs[i].end
    if expected != data_size:
        err.reason = R_INCOMPLETE
        err.a = expected
        err.b = data_size
        if n == 0:
            err.kind = 4
        else:
            err.kind = 5 if expected < data_size else 6
            err.row = recs[n - 1].row
        return -1
    return 0


cdef str row_name(object names, size_t row):
    return names[row] if names is not None else f"#{row}"


cdef object region_error(const RegionError* e, object names):
    cdef str msg
    cdef tuple tensors = ()
    if e.kind == 0:
        tensors = (row_name(names, e.row),)
        msg = f"tensor {tensors[0]!r}: data_offsets end at {e.b} before they begin at {e.a}"
    elif e.kind == 1:
        tensors = (row_name(names, e.row),)
        msg = (f"tensor {tensors[0]!r} is the first in the data region but starts at {e.a}, not 0 "
               f"(a hole of {e.a} bytes at the start)")
    elif e.kind in (2, 3):
        tensors = (row_name(names, e.row), row_name(names, e.prev))
        msg = (f"tensor {tensors[0]!r} starts at {e.a} but the previous tensor {tensors[1]!r} ends at {e.b} "
               + (f"(overlap of {e.b - e.a} bytes)" if e.kind == 2 else f"(hole of {e.a - e.b} bytes)"))
    elif e.kind == 4:
        msg = f"the header declares no tensors but the data region holds {e.b} bytes"
    elif e.kind == 5:
        tensors = (row_name(names, e.row),)
        msg = (f"the last tensor {tensors[0]!r} ends at byte {e.a} of the data region but the data region "
               f"holds {e.b} bytes ({e.b - e.a} bytes not covered by any tensor)")
    else:
        tensors = (row_name(names, e.row),)
        msg = (f"tensor {tensors[0]!r} ends at byte {e.a} of the data region but the data region holds "
               f"only {e.b} bytes (file truncated?)")
    return _errors().HeaderError(msg, reason=_REASONS[e.reason], tensors=tensors)


cdef bytes order_bytes(const Rec* recs, size_t n):
    """The rows in file order, as native ``intp`` values in an immutable ``bytes``."""
    cdef bytes out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>(n * sizeof(Py_ssize_t)))
    cdef Py_ssize_t* o = <Py_ssize_t*>PyBytes_AS_STRING(out)
    cdef size_t i
    for i in range(n):
        o[i] = <Py_ssize_t>recs[i].row
    return out


def check_regions(begins, ends, data_size, names=None):
    """Check that regions tile ``[0, data_size)`` exactly; return the rows in file order.

    ``begins``/``ends`` are 1-d integer arrays (or sequences) of equal length.  The sort and
    the walk run with the GIL released, in O(n log n).  Raises ``HeaderError`` with reason
    ``TensorInvalidInfo`` (end < begin; or a negative offset), ``InvalidOffset`` (hole,
    overlap, first region not at 0) or ``MetadataIncompleteBuffer`` (the regions end
    before or after ``data_size``).  ``names[row]`` names the tensors in messages.
    """
    cdef uint64_t dsize
    if data_size < 0:
        raise ValueError(f"data_size must be non-negative, got {data_size}")
    dsize = data_size
    np = numpy_module()
    b = np.asarray(begins)
    e = np.asarray(ends)
    if b.ndim != 1 or e.ndim != 1 or b.shape[0] != e.shape[0]:
        raise ValueError("begins and ends must be 1-d arrays of the same length")
    cdef bint signed_b = b.dtype != np.uint64
    cdef bint signed_e = e.dtype != np.uint64
    if b.size and b.dtype.kind not in "iu" or e.size and e.dtype.kind not in "iu":
        raise TypeError("begins and ends must be integer arrays")
    b = np.ascontiguousarray(b, dtype=np.uint64 if not signed_b else np.int64).view(np.uint64)
    e = np.ascontiguousarray(e, dtype=np.uint64 if not signed_e else np.int64).view(np.uint64)
    cdef Py_buffer bbuf, ebuf
    get_bytes(b, &bbuf)
    try:
        get_bytes(e, &ebuf)
    except BaseException:
        PyBuffer_Release(&bbuf)
        raise
    cdef const uint64_t* bv = <const uint64_t*>bbuf.buf
    cdef const uint64_t* ev = <const uint64_t*>ebuf.buf
    cdef size_t n = <size_t>bbuf.len // 8, i, bad = <size_t>-1
    cdef Rec* recs = <Rec*>malloc((n if n else 1) * sizeof(Rec))
    cdef RegionError err
    cdef int rc = 0
    if recs == NULL:
        PyBuffer_Release(&bbuf)
        PyBuffer_Release(&ebuf)
        raise MemoryError()
    try:
        with nogil:
            for i in range(n):
                recs[i].begin = bv[i]
                recs[i].end = ev[i]
                recs[i].row = i
                if (signed_b and bv[i] > INT64_MAX) or (signed_e and ev[i] > INT64_MAX):
                    bad = i
                    break
            if bad == <size_t>-1:
                rc = region_check(recs, n, dsize, &err)
        if bad != <size_t>-1:
            nm = names[bad] if names is not None else f"#{bad}"
            raise _errors().HeaderError(f"tensor {nm!r}: negative data offset", reason="TensorInvalidInfo",
                              tensors=(nm,))
        if rc < 0:
            raise region_error(&err, names)
        return np.frombuffer(order_bytes(recs, n), dtype=np.intp)
    finally:
        PyBuffer_Release(&bbuf)
        PyBuffer_Release(&ebuf)
        free(recs)


# ---------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------
