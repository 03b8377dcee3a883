# Included by _header.pyx (one extension module: the scanner's C calls stay direct).
# The format's rules, checked as each entry is scanned: dtypes, shapes, offsets, the tensor's size, __metadata__.

cdef int match_dtype(const Scanner* s, Span sp) noexcept nogil:
    """Code of a dtype string, or -1 if it names no dtype."""
    cdef uint8_t tmp[16]
    cdef const uint8_t* p
    cdef Py_ssize_t m
    cdef int i
    if sp.flags & S_ESCAPED:
        m = unescape(s.buf, sp.start, sp.end, tmp, 16)
        if m < 0:
            return -1
        p = tmp
    else:
        m = sp.end - sp.start
        p = s.buf + sp.start
    for i in range(n_dtypes):
        if <size_t>m == dtype_lens[i] and same_bytes(p, dtype_names[i], m):
            return i
    return -1


cdef int grow(void** arr, size_t* cap, size_t need, size_t item) noexcept nogil:
    """Make room for ``need`` items; sizes follow what was scanned, never a declared count."""
    cdef size_t newcap
    cdef void* p
    if need <= cap[0]:
        return 0
    newcap = cap[0] * 2 if cap[0] else 64
    while newcap < need:
        newcap *= 2
    p = realloc(arr[0], newcap * item)
    if p == NULL:
        return -1
    arr[0] = p
    cap[0] = newcap
    return 0


cdef int scan_uint(Scanner* s, uint64_t* out, const char* field) noexcept nogil:
    """A JSON number that must be a non-negative integer without fraction or exponent."""
    cdef size_t start = s.pos
    cdef uint64_t v = 0, d
    cdef int c = peek(s)
    if c == 0x2D:  # '-'
        snprintf(s.msg, MSG_LEN, "negative number in %s; only non-negative integers are allowed", field)
        return set_err(s, R_DESER, start)
    cdef char what[64]
    if c < 0x30 or c > 0x39:
        snprintf(what, 64, "expected a non-negative integer in %s", field)
        return unexpected(s, what)
    if c == 0x30 and s.pos + 1 < s.n and 0x30 <= s.buf[s.pos + 1] <= 0x39:
        snprintf(s.msg, MSG_LEN, "number with a leading zero in %s", field)
        return set_err(s, R_DESER, start)
    while s.pos < s.n and 0x30 <= s.buf[s.pos] <= 0x39:
        d = s.buf[s.pos] - 0x30
        # v * 10 + d > 2**64 - 1 = 18446744073709551615
        if v > 1844674407370955161ULL or (v == 1844674407370955161ULL and d > 5):
            snprintf(s.msg, MSG_LEN, "number in %s does not fit in 64 bits", field)
            return set_err(s, R_OVERFLOW, start)
        v = v * 10 + d
        s.pos += 1
    c = peek(s)
    if c == 0x2E or c == 0x65 or c == 0x45:  # '.', 'e', 'E'
        snprintf(s.msg, MSG_LEN, "%s holds a number with a fraction or exponent; only integers are allowed",
                 field)
        return set_err(s, R_DESER, start)
    out[0] = v
    return 0


cdef int scan_shape(Scanner* s, size_t row) noexcept nogil:
    cdef Tensor* t = &s.tensors[row]
    cdef uint64_t v
    if peek(s) != 0x5B:
        return unexpected(s, "shape must be an array of non-negative integers")
    t.shape_pos = s.pos
    t.dim0 = s.ndims
    s.pos += 1
    skip_ws(s)
    if peek(s) == 0x5D:
        s.pos += 1
        t.ndim = 0
        return 0
    while True:
        skip_ws(s)
        if scan_uint(s, &v, "shape") < 0:
            return -1
        if s.ndims == s.cap_dims and grow(<void**>&s.dims, &s.cap_dims, s.ndims + 1, sizeof(uint64_t)) < 0:
            s.reason = R_NOMEM
            return -1
        s.dims[s.ndims] = v
        s.ndims += 1
        skip_ws(s)
        if peek(s) == 0x2C:
            s.pos += 1
        elif peek(s) == 0x5D:
            s.pos += 1
            break
        else:
            return unexpected(s, "expected ',' or ']' in shape")
    t.ndim = s.ndims - t.dim0
    return 0


cdef int scan_offsets(Scanner* s, size_t row) noexcept nogil:
    cdef Tensor* t = &s.tensors[row]
    cdef uint64_t v[2]
    cdef uint64_t x
    cdef size_t count = 0
    if peek(s) != 0x5B:
        return unexpected(s, "data_offsets must be an array [begin, end] of two non-negative integers")
    t.offsets_pos = s.pos
    s.pos += 1
    skip_ws(s)
    if peek(s) != 0x5D:
        while True:
            skip_ws(s)
            if scan_uint(s, &x, "data_offsets") < 0:
                return -1
            if count < 2:
                v[count] = x
            count += 1
            skip_ws(s)
            if peek(s) == 0x2C:
                s.pos += 1
            elif peek(s) == 0x5D:
                break
            else:
                return unexpected(s, "expected ',' or ']' in data_offsets")
    s.pos += 1
    if count != 2:
        snprintf(s.msg, MSG_LEN, "data_offsets holds %zu integer%s; it must hold exactly 2: [begin, end]",
                 count, <const char*>("" if count == 1 else "s"))
        return set_err(s, R_DESER, t.offsets_pos)
    t.begin = v[0]
    t.end = v[1]
    return 0


cdef int check_tensor(Scanner* s, size_t row) noexcept nogil:
    """Per-tensor rules, as the reference orders them: checked element count, bits, byte
    alignment of sub-byte dtypes, then ``end - begin == nbytes``."""
    cdef Tensor* t = &s.tensors[row]
    cdef uint64_t numel = 1, bits = dtype_bits[t.code], nbits, nbytes
    cdef size_t i
    cdef uint64_t d
    for i in range(t.ndim):
        d = s.dims[t.dim0 + i]
        # fold left to right with checked multiplication, like the reference
        if d != 0 and numel > UINT64_MAX // d:
            return fail(s, R_OVERFLOW, t.shape_pos,
                        "the product of the shape's dimensions overflows 64 bits")
        numel *= d
    if numel != 0 and bits > UINT64_MAX // numel:
        snprintf(s.msg, MSG_LEN, "%llu elements of %llu bits overflow 64 bits",
                 <unsigned long long>numel, <unsigned long long>bits)
        return set_err(s, R_OVERFLOW, t.shape_pos)
    nbits = numel * bits
    if nbits % 8 != 0:
        snprintf(s.msg, MSG_LEN,
                 "%llu elements of the %llu-bit dtype %s take %llu bits, which is not a whole number of bytes",
                 <unsigned long long>numel, <unsigned long long>bits, dtype_names[t.code],
                 <unsigned long long>nbits)
        return set_err(s, R_MISALIGNED, t.shape_pos)
    nbytes = nbits // 8
    if t.end < t.begin:
        snprintf(s.msg, MSG_LEN, "data_offsets [%llu, %llu] end before they begin",
                 <unsigned long long>t.begin, <unsigned long long>t.end)
        return set_err(s, R_INFO, t.offsets_pos)
    if t.end - t.begin != nbytes:
        snprintf(s.msg, MSG_LEN,
                 "data_offsets [%llu, %llu] span %llu bytes but %llu elements of %s need %llu bytes",
                 <unsigned long long>t.begin, <unsigned long long>t.end,
                 <unsigned long long>(t.end - t.begin), <unsigned long long>numel, dtype_names[t.code],
                 <unsigned long long>nbytes)
        return set_err(s, R_INFO, t.offsets_pos)
    return 0


cdef int scan_entry(Scanner* s, size_t row) noexcept nogil:
    """``{"dtype": str, "shape": [int...], "data_offsets": [int, int]}``, fields in any order."""
    cdef int seen = 0, which, code
    cdef Span key, val
    cdef const char* missing
    if peek(s) != 0x7B:
        return unexpected(s, "a tensor entry must be an object with dtype, shape and data_offsets")
    s.pos += 1
    skip_ws(s)
    if peek(s) != 0x7D:
        while True:
            skip_ws(s)
            if peek(s) != 0x22:
                return unexpected(s, "expected a field name: dtype, shape or data_offsets")
            if scan_string(s, &key) < 0:
                return -1
            if span_is(s, key, "dtype", 5):
                which = F_DTYPE
            elif span_is(s, key, "shape", 5):
                which = F_SHAPE
            elif span_is(s, key, "data_offsets", 12):
                which = F_OFFSETS
            elif s.strict:
                return fail_span(s, R_DESER, key.pos,
                                 "unknown field {span}; an entry has exactly dtype, shape and data_offsets",
                                 key)
            else:
                # the format does not forbid other fields and the reference ignores them;
                # their values are still checked to be JSON
                skip_ws(s)
                if peek(s) != 0x3A:
                    return unexpected(s, "expected ':' after the field name")
                s.pos += 1
                if skip_value(s) < 0:
                    return -1
                skip_ws(s)
                if peek(s) == 0x2C:
                    s.pos += 1
                    continue
                elif peek(s) == 0x7D:
                    break
                return unexpected(s, "expected ',' or '}' in the tensor entry")
            if seen & which:
                return fail_span(s, R_DUP, key.pos, "field {span} appears twice", key)
            seen |= which
            skip_ws(s)
            if peek(s) != 0x3A:
                return unexpected(s, "expected ':' after the field name")
            s.pos += 1
            skip_ws(s)
            if which == F_DTYPE:
                if peek(s) != 0x22:
                    return unexpected(s, "dtype must be a string such as \"F32\"")
                if scan_string(s, &val) < 0:
                    return -1
                code = match_dtype(s, val)
                if code < 0:
                    return fail_span(s, R_DTYPE, val.pos, "unknown dtype {span}", val)
                s.tensors[row].code = <uint8_t>code
            elif which == F_SHAPE:
                if scan_shape(s, row) < 0:
                    return -1
            else:
                if scan_offsets(s, row) < 0:
                    return -1
            skip_ws(s)
            if peek(s) == 0x2C:
                s.pos += 1
            elif peek(s) == 0x7D:
                break
            else:
                return unexpected(s, "expected ',' or '}' in the tensor entry")
    if seen != F_ALL:
        missing = ("dtype" if not (seen & F_DTYPE) else
                   "shape" if not (seen & F_SHAPE) else "data_offsets")
        snprintf(s.msg, MSG_LEN, "the entry has no '%s' field", missing)
        return set_err(s, R_DESER, s.pos)
    s.pos += 1
    return check_tensor(s, row)


cdef int scan_metadata(Scanner* s) noexcept nogil:
    """``{"key": "value", ...}``: strings only."""
    cdef Span key, val
    if peek(s) != 0x7B:
        if s.n - s.pos >= 4 and memcmp(s.buf + s.pos, b"null", 4) == 0:
            return fail(s, R_DESER, s.pos, "it is null; it must be an object mapping strings to strings")
        return unexpected(s, "it must be an object mapping strings to strings")
    s.pos += 1
    skip_ws(s)
    if peek(s) == 0x7D:
        s.pos += 1
        return 0
    while True:
        skip_ws(s)
        if peek(s) != 0x22:
            return unexpected(s, "expected a metadata key (a string)")
        if scan_string(s, &key) < 0:
            return -1
        skip_ws(s)
        if peek(s) != 0x3A:
            return unexpected(s, "expected ':' after the metadata key")
        s.pos += 1
        skip_ws(s)
        if peek(s) != 0x22:
            if peek(s) < 0 or peek(s) >= 0x80:
                return unexpected(s, "metadata values must be strings")
            return fail_span(s, R_DESER, s.pos, "the value of metadata key {span} is not a string", key)
        if scan_string(s, &val) < 0:
            return -1
        if grow(<void**>&s.meta, &s.cap_meta, s.nmeta + 2, sizeof(Span)) < 0:
            s.reason = R_NOMEM
            return -1
        s.meta[s.nmeta] = key
        s.meta[s.nmeta + 1] = val
        s.nmeta += 2
        skip_ws(s)
        if peek(s) == 0x2C:
            s.pos += 1
        elif peek(s) == 0x7D:
            s.pos += 1
            return 0
        else:
            return unexpected(s, "expected ',' or '}' in __metadata__")


cdef int scan_header(Scanner* s) noexcept nogil:
    """Phase 1: the whole header, GIL released.  0 on success, -1 with ``s.reason`` set."""
    cdef Span key
    cdef size_t row
    cdef Tensor* t
    if s.n == 0:
        return fail(s, R_START, 0, "the header is empty; it must be a JSON object starting with '{'")
    if s.buf[0] != 0x7B:
        return fail(s, R_START, 0, "the header does not start with '{'")
    s.pos = 1
    skip_ws(s)
    if peek(s) == 0x7D:
        s.pos += 1
    else:
        while True:
            skip_ws(s)
            if peek(s) != 0x22:
                return unexpected(s, "expected a tensor name (a string)")
            if scan_string(s, &key) < 0:
                return -1
            skip_ws(s)
            if peek(s) != 0x3A:
                return unexpected(s, "expected ':' after the key")
            s.pos += 1
            skip_ws(s)
            if span_is(s, key, "__metadata__", 12):
                if s.has_meta:
                    return fail(s, R_DUP, key.pos, "'__metadata__' appears twice")
                s.has_meta = True
                s.meta_pos = key.pos
                s.err_in_meta = True
                if scan_metadata(s) < 0:
                    return -1
                s.err_in_meta = False
            else:
                if grow(<void**>&s.tensors, &s.cap_tensors, s.ntensors + 1, sizeof(Tensor)) < 0:
                    s.reason = R_NOMEM
                    return -1
                row = s.ntensors
                s.ntensors += 1
                t = &s.tensors[row]
                memset(t, 0, sizeof(Tensor))
                t.name_start = key.start
                t.name_end = key.end
                t.name_flags = <uint8_t>key.flags
                t.key_pos = key.pos
                s.err_row = <Py_ssize_t>row
                if scan_entry(s, row) < 0:
                    return -1
                s.err_row = -1
            skip_ws(s)
            if peek(s) == 0x2C:
                s.pos += 1
            elif peek(s) == 0x7D:
                s.pos += 1
                break
            else:
                return unexpected(s, "expected ',' or '}' after a header entry")
    skip_ws(s)
    if s.pos != s.n:
        return unexpected(s, "only JSON whitespace (the writer pads with spaces) may follow the header object")
    return 0


# ---------------------------------------------------------------------------------------
# region check
# ---------------------------------------------------------------------------------------
