# Included by _header.pyx (one extension module: the scanner's C calls stay direct).
# The scanner's state and the JSON it reads: strings, numbers, whitespace and values skipped.


cdef enum Reason:
    R_OK = 0
    R_UTF8            # InvalidHeader
    R_START           # InvalidHeaderStart
    R_DESER           # InvalidHeaderDeserialization
    R_OVERFLOW        # ValidationOverflow
    R_DTYPE           # InvalidDtype
    R_DUP             # DuplicateKey
    R_MISALIGNED      # MisalignedSlice
    R_INFO            # TensorInvalidInfo
    R_OFFSET          # InvalidOffset
    R_INCOMPLETE      # MetadataIncompleteBuffer
    R_NOMEM           # malloc failed -> MemoryError

_REASONS = {
    R_UTF8: "InvalidHeader",
    R_START: "InvalidHeaderStart",
    R_DESER: "InvalidHeaderDeserialization",
    R_OVERFLOW: "ValidationOverflow",
    R_DTYPE: "InvalidDtype",
    R_DUP: "DuplicateKey",
    R_MISALIGNED: "MisalignedSlice",
    R_INFO: "TensorInvalidInfo",
    R_OFFSET: "InvalidOffset",
    R_INCOMPLETE: "MetadataIncompleteBuffer",
}

cdef struct Tensor:
    size_t name_start      # span of the key's raw content, between the quotes
    size_t name_end
    size_t key_pos         # byte of the key's opening quote
    size_t shape_pos       # byte of the shape's '['
    size_t offsets_pos     # byte of the data_offsets' '['
    size_t dim0            # first index into Scanner.dims
    size_t ndim
    uint64_t begin
    uint64_t end
    uint8_t code
    uint8_t name_flags

cdef struct Span:
    size_t start
    size_t end
    size_t pos             # byte of the opening quote
    int flags

cdef struct Rec:           # one region, for the region check
    uint64_t begin
    uint64_t end
    size_t row

cdef struct Scanner:
    const uint8_t* buf
    size_t n
    size_t pos
    Tensor* tensors
    size_t ntensors
    size_t cap_tensors
    uint64_t* dims
    size_t ndims
    size_t cap_dims
    Span* meta             # key, value, key, value, ...
    size_t nmeta
    size_t cap_meta
    bint has_meta
    size_t meta_pos
    bint strict            # reject unknown fields in tensor entries
    # first error met; phase 2 turns it into a HeaderError
    int reason
    size_t err_pos
    bint err_has_pos
    Py_ssize_t err_row     # tensor involved, -1 if none
    bint err_in_meta       # error inside __metadata__
    bint err_has_span      # msg contains "{span}", to be replaced by this string's repr
    Span err_span
    char msg[MSG_LEN]

cdef struct RegionError:
    int reason
    int kind               # see region_message()
    size_t row             # tensor at fault
    size_t prev            # previous tensor in file order (kinds 2, 3)
    uint64_t a
    uint64_t b


# ---------------------------------------------------------------------------------------
# small helpers (all nogil)
# ---------------------------------------------------------------------------------------

cdef inline int peek(const Scanner* s) noexcept nogil:
    """Current byte, or -1 at the end of the header."""
    if s.pos >= s.n:
        return -1
    return s.buf[s.pos]


cdef inline void skip_ws(Scanner* s) noexcept nogil:
    cdef uint8_t c
    while s.pos < s.n:
        c = s.buf[s.pos]
        if c == 0x20 or c == 0x0A or c == 0x0D or c == 0x09:
            s.pos += 1
        else:
            return


cdef int set_err(Scanner* s, int reason, size_t pos) noexcept nogil:
    """Record an error at byte ``pos`` whose message is already in ``s.msg``; returns -1."""
    s.reason = reason
    s.err_pos = pos
    s.err_has_pos = True
    return -1


cdef int fail(Scanner* s, int reason, size_t pos, const char* msg) noexcept nogil:
    """Record an error at byte ``pos`` with a fixed message; returns -1 for ``return fail(...)``."""
    snprintf(s.msg, MSG_LEN, "%s", msg)
    return set_err(s, reason, pos)


cdef inline int fail_span(Scanner* s, int reason, size_t pos, const char* msg, Span span) noexcept nogil:
    fail(s, reason, pos, msg)
    s.err_has_span = True
    s.err_span = span
    return -1


cdef size_t utf8_seq_len(const uint8_t* p, size_t avail) noexcept nogil:
    """Length (1-4) of the valid UTF-8 sequence at ``p``, or 0 if it is invalid.

    Rejects overlong forms, UTF-16 surrogates (U+D800..U+DFFF) encoded in UTF-8, code points
    above U+10FFFF and sequences cut short by the end of the buffer.
    """
    cdef uint8_t c = p[0]
    cdef uint8_t lo = 0x80, hi = 0xBF
    cdef size_t k, i
    if c < 0x80:
        return 1
    if 0xC2 <= c <= 0xDF:
        k = 2
    elif 0xE0 <= c <= 0xEF:
        k = 3
        if c == 0xE0:
            lo = 0xA0  # overlong below U+0800
        elif c == 0xED:
            hi = 0x9F  # surrogates
    elif 0xF0 <= c <= 0xF4:
        k = 4
        if c == 0xF0:
            lo = 0x90  # overlong below U+10000
        elif c == 0xF4:
            hi = 0x8F  # above U+10FFFF
    else:
        return 0  # continuation byte, overlong lead C0/C1, or F5..FF
    if avail < 2 or not (lo <= p[1] <= hi):
        return 0
    for i in range(2, k):
        if i >= avail or not (0x80 <= p[i] <= 0xBF):
            return 0
    return k


cdef int unexpected(Scanner* s, const char* what) noexcept nogil:
    """Syntax error at the current byte; invalid UTF-8 there is reported as such."""
    cdef int c = peek(s)
    if c < 0:
        snprintf(s.msg, MSG_LEN, "the header ends early: %s", what)
        s.reason = R_DESER
    elif c >= 0x80 and utf8_seq_len(s.buf + s.pos, s.n - s.pos) == 0:
        snprintf(s.msg, MSG_LEN, "invalid UTF-8 byte 0x%02X", c)
        s.reason = R_UTF8
    elif 0x20 <= c < 0x7F:
        snprintf(s.msg, MSG_LEN, "unexpected character '%c': %s", c, what)
        s.reason = R_DESER
    else:
        snprintf(s.msg, MSG_LEN, "unexpected byte 0x%02X: %s", c, what)
        s.reason = R_DESER
    s.err_pos = s.pos
    s.err_has_pos = True
    return -1


cdef inline int hexval(uint8_t c) noexcept nogil:
    if 0x30 <= c <= 0x39:
        return c - 0x30
    if 0x61 <= c <= 0x66:
        return c - 0x61 + 10
    if 0x41 <= c <= 0x46:
        return c - 0x41 + 10
    return -1


cdef int read_u_escape(const uint8_t* buf, size_t n, size_t pos, uint64_t* cp) noexcept nogil:
    """Read the 4 hex digits after ``\\u`` at ``buf[pos]``; -1 if they are not all there."""
    cdef uint64_t v = 0
    cdef int h, i
    if n - pos < 4:
        return -1
    for i in range(4):
        h = hexval(buf[pos + i])
        if h < 0:
            return -1
        v = (v << 4) | <uint64_t>h
    cp[0] = v
    return 0


cdef inline uint64_t swar_special(const uint8_t* p) noexcept nogil:
    """Non-zero if any of the 8 bytes at ``p`` is '"', '\\', a control character (< 0x20)
    or non-ASCII (>= 0x80): the bytes the string scanner must look at one by one."""
    cdef uint64_t w, ones = 0x0101010101010101ULL, high = 0x8080808080808080ULL, q, b
    memcpy(&w, p, 8)  # unaligned load
    q = w ^ (ones * 0x22)
    b = w ^ (ones * 0x5C)
    return (((w - ones * 0x20) & ~w)         # some byte < 0x20 (or >= 0x80, caught anyway)
            | ((q - ones) & ~q)              # some byte == '"'
            | ((b - ones) & ~b)              # some byte == '\\'
            | w) & high                      # some byte >= 0x80


cdef int scan_string(Scanner* s, Span* out) noexcept nogil:
    """Validate the string at the current '"' and record its raw span; moves past it."""
    cdef const uint8_t* buf = s.buf
    cdef size_t n = s.n
    cdef size_t pos = s.pos
    cdef size_t k
    cdef uint8_t c, e
    cdef uint64_t cp, lo
    cdef int flags = 0
    c_assert(pos < n and buf[pos] == 0x22)
    out.pos = pos
    pos += 1
    out.start = pos
    while True:
        # fast path: plain printable ASCII, 8 bytes at a time, then byte by byte
        while pos + 8 <= n and not swar_special(buf + pos):
            pos += 8
        while pos < n and str_plain[buf[pos]]:
            pos += 1
        if pos >= n:
            s.pos = pos
            return fail(s, R_DESER, out.pos, "unterminated string")
        c = buf[pos]
        if c == 0x22:  # closing quote
            out.end = pos
            out.flags = flags
            s.pos = pos + 1
            return 0
        if c == 0x5C:  # backslash
            flags |= S_ESCAPED
            if pos + 1 >= n:
                return fail(s, R_DESER, pos, "unterminated escape sequence in string")
            e = buf[pos + 1]
            if e == 0x75:  # \uXXXX
                if read_u_escape(buf, n, pos + 2, &cp) < 0:
                    return fail(s, R_DESER, pos, "invalid \\u escape: expected 4 hex digits")
                if 0xDC00 <= cp <= 0xDFFF:
                    return fail(s, R_DESER, pos, "lone low surrogate in \\u escape")
                if 0xD800 <= cp <= 0xDBFF:
                    # a high surrogate must be followed by an escaped low surrogate
                    if (pos + 7 >= n or buf[pos + 6] != 0x5C or buf[pos + 7] != 0x75
                            or read_u_escape(buf, n, pos + 8, &lo) < 0
                            or not (0xDC00 <= lo <= 0xDFFF)):
                        return fail(s, R_DESER, pos, "lone high surrogate in \\u escape")
                    flags |= S_NONASCII
                    pos += 12
                else:
                    if cp >= 0x80:
                        flags |= S_NONASCII
                    pos += 6
            elif (e == 0x22 or e == 0x5C or e == 0x2F or e == 0x62 or e == 0x66
                    or e == 0x6E or e == 0x72 or e == 0x74):
                pos += 2
            else:
                return fail(s, R_DESER, pos, "invalid escape sequence in a string")
        elif c < 0x20:
            snprintf(s.msg, MSG_LEN, "raw control character 0x%02X in a string (it must be escaped)", c)
            return set_err(s, R_DESER, pos)
        else:  # c >= 0x80: a multi-byte UTF-8 sequence
            k = utf8_seq_len(buf + pos, n - pos)
            if k == 0:
                snprintf(s.msg, MSG_LEN, "invalid UTF-8 byte 0x%02X in a string", c)
                return set_err(s, R_UTF8, pos)
            flags |= S_NONASCII
            pos += k


cdef inline void put_utf8(uint8_t* out, size_t* j, uint64_t cp) noexcept nogil:
    cdef size_t o = j[0]
    if cp < 0x80:
        out[o] = <uint8_t>cp
        o += 1
    elif cp < 0x800:
        out[o] = <uint8_t>(0xC0 | (cp >> 6))
        out[o + 1] = <uint8_t>(0x80 | (cp & 0x3F))
        o += 2
    elif cp < 0x10000:
        out[o] = <uint8_t>(0xE0 | (cp >> 12))
        out[o + 1] = <uint8_t>(0x80 | ((cp >> 6) & 0x3F))
        out[o + 2] = <uint8_t>(0x80 | (cp & 0x3F))
        o += 3
    else:
        out[o] = <uint8_t>(0xF0 | (cp >> 18))
        out[o + 1] = <uint8_t>(0x80 | ((cp >> 12) & 0x3F))
        out[o + 2] = <uint8_t>(0x80 | ((cp >> 6) & 0x3F))
        out[o + 3] = <uint8_t>(0x80 | (cp & 0x3F))
        o += 4
    j[0] = o


cdef Py_ssize_t unescape(const uint8_t* buf, size_t start, size_t end,
                         uint8_t* out, size_t cap) noexcept nogil:
    """Decode a span that ``scan_string`` validated into UTF-8 at ``out``.

    Returns the decoded length, or -1 if it would exceed ``cap``.  The decoded length never
    exceeds the raw length (an escape is always longer than what it stands for).
    """
    cdef size_t i = start, j = 0
    cdef uint8_t c, e
    cdef uint64_t cp, lo
    while i < end:
        # one step writes at most 4 bytes, and the rest decodes to at most end - i bytes
        if j + 4 > cap and j + (end - i) > cap:
            return -1  # the rest might not fit (callers match short literals: no match)
        c = buf[i]
        if c != 0x5C:
            out[j] = c
            j += 1
            i += 1
            continue
        e = buf[i + 1]
        if e == 0x75:
            read_u_escape(buf, end, i + 2, &cp)
            if 0xD800 <= cp <= 0xDBFF:
                read_u_escape(buf, end, i + 8, &lo)
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)
                i += 12
            else:
                i += 6
            put_utf8(out, &j, cp)
        else:
            if e == 0x62:
                out[j] = 0x08
            elif e == 0x66:
                out[j] = 0x0C
            elif e == 0x6E:
                out[j] = 0x0A
            elif e == 0x72:
                out[j] = 0x0D
            elif e == 0x74:
                out[j] = 0x09
            else:  # '"', '\\', '/'
                out[j] = e
            j += 1
            i += 2
    return <Py_ssize_t>j


cdef inline bint same_bytes(const uint8_t* a, const char* b, size_t n) noexcept nogil:
    # a short literal compare; inline loop rather than a libc call per key
    cdef size_t i
    for i in range(n):
        if a[i] != <uint8_t>b[i]:
            return False
    return True


cdef inline bint span_is(const Scanner* s, Span sp, const char* lit, size_t litlen) noexcept nogil:
    """Whether a validated string equals the ASCII literal, escapes decoded."""
    cdef uint8_t tmp[32]
    cdef Py_ssize_t m
    if not (sp.flags & S_ESCAPED):
        return sp.end - sp.start == litlen and same_bytes(s.buf + sp.start, lit, litlen)
    if litlen > 32:
        return False
    m = unescape(s.buf, sp.start, sp.end, tmp, 32)
    return m == <Py_ssize_t>litlen and same_bytes(tmp, lit, litlen)


cdef inline bint digit_overflows(uint64_t v, uint64_t d) noexcept nogil:
    """Whether ``v * 10 + d`` overflows 64 bits (serde_json's test, digit by digit)."""
    return v >= UINT64_MAX // 10 and (v > UINT64_MAX // 10 or d > UINT64_MAX % 10)


cdef int skip_number(Scanner* s) noexcept nogil:
    """A JSON number (RFC 8259 grammar), consumed and discarded.

    A number that serde_json (the reference's parser) refuses as out of range is refused
    too: its significand (the first digits that fit 64 bits), as a double, times the power
    of ten, overflows to infinity.  The arithmetic is serde_json's own, step for step, so
    the same numbers pass (``1e-400`` is 0, ``1.7976931348623158e308`` overflows there).
    """
    cdef size_t start = s.pos
    cdef int c = peek(s)
    cdef uint64_t sig = 0, d
    cdef int64_t exp10 = 0, e = 0
    cdef bint is_float = False, frozen = False, exp_negative = False, exp_overflow = False
    if c == 0x2D:  # '-'
        s.pos += 1
        c = peek(s)
    if c == 0x30:  # a leading zero stands alone
        s.pos += 1
    elif 0x31 <= c <= 0x39:
        while 0x30 <= peek(s) <= 0x39:
            d = peek(s) - 0x30
            if frozen or digit_overflows(sig, d):
                # past 64 bits the digits only scale the number
                frozen = is_float = True
                exp10 += 1
            else:
                sig = sig * 10 + d
            s.pos += 1
    else:
        return fail(s, R_DESER, start, "invalid number")
    frozen = False
    if peek(s) == 0x2E:  # '.'
        is_float = True
        s.pos += 1
        if not 0x30 <= peek(s) <= 0x39:
            return fail(s, R_DESER, start, "invalid number: a digit must follow '.'")
        while 0x30 <= peek(s) <= 0x39:
            d = peek(s) - 0x30
            if frozen or digit_overflows(sig, d):
                frozen = True  # later fraction digits are dropped
            else:
                sig = sig * 10 + d
                exp10 -= 1
            s.pos += 1
    c = peek(s)
    if c == 0x65 or c == 0x45:  # 'e' / 'E'
        is_float = True
        s.pos += 1
        c = peek(s)
        if c == 0x2B or c == 0x2D:
            exp_negative = c == 0x2D
            s.pos += 1
        if not 0x30 <= peek(s) <= 0x39:
            return fail(s, R_DESER, start, "invalid number: a digit must follow the exponent")
        while 0x30 <= peek(s) <= 0x39:
            d = peek(s) - 0x30
            if not exp_overflow:
                if e >= INT32_MAX // 10 and (e > INT32_MAX // 10 or <int64_t>d > INT32_MAX % 10):
                    exp_overflow = True
                else:
                    e = e * 10 + <int64_t>d
            s.pos += 1
        if exp_overflow:
            if sig != 0 and not exp_negative:
                return fail(s, R_DESER, start, "number out of range (beyond a 64-bit float)")
            return 0
        exp10 = exp10 - e if exp_negative else exp10 + e
    if not is_float or sig == 0 or exp10 < 0:
        return 0  # an integer that fits 64 bits, a zero, or a division: never infinite
    if exp10 > POW10_MAX or isinf(<double>sig * pow10[exp10]):
        return fail(s, R_DESER, start, "number out of range (beyond a 64-bit float)")
    return 0


cdef int skip_key(Scanner* s) noexcept nogil:
    """An object key and its ':' inside an ignored value, checked and consumed."""
    cdef Span sp
    skip_ws(s)
    if peek(s) != 0x22:
        return unexpected(s, "expected a string key in an object")
    if scan_string(s, &sp) < 0:
        return -1
    skip_ws(s)
    if peek(s) != 0x3A:
        return unexpected(s, "expected ':' after an object key")
    s.pos += 1
    return 0


cdef int skip_value(Scanner* s) noexcept nogil:
    """Validate and discard any JSON value: the value of a field the format does not define.

    Iterative, with the open brackets kept in a fixed array, so a hostile nesting depth
    costs neither stack nor heap: past ``SKIP_DEPTH_MAX`` levels it is an error.
    """
    cdef uint8_t stack[SKIP_DEPTH_MAX]
    cdef int depth = 0
    cdef int c
    cdef Span sp
    while True:
        # a value
        skip_ws(s)
        c = peek(s)
        if c == 0x7B or c == 0x5B:  # '{' or '['
            if depth == SKIP_DEPTH_MAX:
                return fail(s, R_DESER, s.pos, "a field's value nests deeper than 125 levels (127 with the header and its entry)")
            stack[depth] = <uint8_t>c
            depth += 1
            s.pos += 1
            skip_ws(s)
            if peek(s) == (0x7D if c == 0x7B else 0x5D):  # empty object or array
                s.pos += 1
                depth -= 1
            elif c == 0x7B:
                if skip_key(s) < 0:
                    return -1
                continue  # its value
            else:
                continue  # the array's first value
        elif c == 0x22:
            if scan_string(s, &sp) < 0:
                return -1
        elif c == 0x2D or 0x30 <= c <= 0x39:
            if skip_number(s) < 0:
                return -1
        elif c == 0x74 and s.n - s.pos >= 4 and memcmp(s.buf + s.pos, b"true", 4) == 0:
            s.pos += 4
        elif c == 0x66 and s.n - s.pos >= 5 and memcmp(s.buf + s.pos, b"false", 5) == 0:
            s.pos += 5
        elif c == 0x6E and s.n - s.pos >= 4 and memcmp(s.buf + s.pos, b"null", 4) == 0:
            s.pos += 4
        else:
            return unexpected(s, "expected a JSON value")
        # after a value: close what is complete, or move on to the next element
        while True:
            if depth == 0:
                return 0
            skip_ws(s)
            c = peek(s)
            if c == 0x2C:  # ','
                s.pos += 1
                if stack[depth - 1] == 0x7B and skip_key(s) < 0:
                    return -1
                break  # the next value
            if c == (0x7D if stack[depth - 1] == 0x7B else 0x5D):
                s.pos += 1
                depth -= 1
                continue
            return unexpected(s, "expected ',' or a closing bracket")
