# cython: language_level=3, embedsignature=True
# distutils: language = c
#
# Bounds/wraparound checks and cdivision are set once in setup.py (ENGINE_CYTHON_CHECKS=1
# turns them on, and enables the C asserts below by leaving NDEBUG undefined).
"""Single-pass parser and region checker for safetensors headers (private; see engine.format.header).

The header is scanned straight from its bytes by a schema-directed recursive-descent
scanner.  The schema is fixed (top object -> tensor entry or ``__metadata__`` -> string or
array of integers), so nesting depth is at most 3 and there is no recursion: a nested value
where a string or a number belongs is an error on the spot.

Phase 1 (``scan_header``, GIL released) validates the JSON and the UTF-8, and fills C arrays:
name spans, dtype codes, dims, offsets, metadata spans; each tensor is checked (checked
element count, bits, sub-byte alignment, ``end - begin == nbytes``) as its entry closes.
Phase 2 (GIL held) decodes names into ``str``, detects duplicate keys, runs the region
check (GIL released), and builds the compact :class:`HeaderTable`.

No number read from the file sizes an allocation: every buffer grows with what has been
scanned, so memory is proportional to the header length, which the caller has capped.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.unicode cimport PyUnicode_DATA, PyUnicode_DecodeUTF8, PyUnicode_New
from libc.math cimport isinf
from libc.stdint cimport INT32_MAX, INT64_MAX, UINT64_MAX, int64_t, uint8_t, uint64_t
from libc.stdio cimport snprintf
from libc.stdlib cimport free, malloc, qsort, realloc
from libc.string cimport memcmp, memcpy, memset

from engine.base.dtypes import BITS as _BITS
from engine.base.dtypes import NAMES as _NAMES
from engine.errors import HeaderError

cdef extern from *:
    """
    /* A dict presized for n keys skips the rehashes of growing one key at a time.
       _PyDict_NewPresized is CPython-private: use it only where it is known to exist. */
    #if !defined(PYPY_VERSION) && PY_VERSION_HEX < 0x030D0000
    #define engine_dict_new(n) _PyDict_NewPresized(n)
    #else
    #define engine_dict_new(n) PyDict_New()
    #endif
    """
    dict engine_dict_new(Py_ssize_t n)

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(object)

cdef extern from "assert.h":
    # compiled out under NDEBUG (the default build); live in the ENGINE_CYTHON_CHECKS build
    void c_assert "assert" (bint) noexcept nogil


cdef object _numpy = None


cdef object numpy_module():
    """numpy, imported on first use: parsing a header and reading its names, dtypes and
    shapes import no numpy (a short-lived tool that only inspects headers never pays for
    it); the table's columns become numpy arrays when first asked for."""
    global _numpy
    if _numpy is None:
        import numpy
        _numpy = numpy
    return _numpy

__all__ = [
    "MAX_HEADER_SIZE",
    "HeaderTable",
    "header_length",
    "parse_header",
    "check_regions",
    "tensor_nbytes",
]

#: Largest header (the JSON part) accepted by default, as in the reference implementation.
MAX_HEADER_SIZE = 100_000_000

cdef enum:
    NDTYPES_MAX = 32
    MSG_LEN = 320
    MSG_SPAN_MAX = 120  # longest quoted name/string put into a message, in characters
    # string flags
    S_ESCAPED = 1   # contains backslash escapes: must be unescaped before use
    S_NONASCII = 2  # decodes to non-ASCII characters
    # entry fields
    F_DTYPE = 1
    F_SHAPE = 2
    F_OFFSETS = 4
    F_ALL = 7
    # deepest nesting of an ignored field's value: serde_json, which the reference parses
    # with, refuses a 128th level counting the header object and the tensor entry, which
    # leaves 125 to the value
    SKIP_DEPTH_MAX = 125
    # powers of ten that serde_json holds as doubles (1e0 .. 1e308)
    POW10_MAX = 308

# ---------------------------------------------------------------------------------------
# dtype table, filled from engine.base.dtypes at import so there is one source of truth
# ---------------------------------------------------------------------------------------

cdef int n_dtypes = len(_NAMES)
if n_dtypes > NDTYPES_MAX:
    raise ImportError("engine.base.dtypes declares more dtypes than engine.format._header can hold")
cdef char dtype_names[NDTYPES_MAX][16]
cdef size_t dtype_lens[NDTYPES_MAX]
cdef uint64_t dtype_bits[NDTYPES_MAX]


cdef void init_dtypes() except *:
    cdef bytes b
    cdef Py_ssize_t i
    memset(dtype_names, 0, sizeof(dtype_names))
    for i, (name, bits) in enumerate(zip(_NAMES, _BITS)):
        b = name.encode("ascii")
        if len(b) >= 16:
            raise ImportError(f"dtype name {name!r} too long for engine.format._header")
        memcpy(dtype_names[i], <const char*>b, len(b))
        dtype_lens[i] = len(b)
        dtype_bits[i] = bits


init_dtypes()

cdef extern from *:
    """
    /* the doubles 1e0 .. 1e308 as serde_json holds them: decimal literals, which the C
       compiler rounds correctly (a table in the binary: nothing to compute at import) */
    static const double engine_pow10[309] = {
        1e0,1e1,1e2,1e3,1e4,1e5,1e6,1e7,1e8,1e9,1e10,1e11,1e12,1e13,1e14,1e15,
        1e16,1e17,1e18,1e19,1e20,1e21,1e22,1e23,1e24,1e25,1e26,1e27,1e28,1e29,1e30,1e31,
        1e32,1e33,1e34,1e35,1e36,1e37,1e38,1e39,1e40,1e41,1e42,1e43,1e44,1e45,1e46,1e47,
        1e48,1e49,1e50,1e51,1e52,1e53,1e54,1e55,1e56,1e57,1e58,1e59,1e60,1e61,1e62,1e63,
        1e64,1e65,1e66,1e67,1e68,1e69,1e70,1e71,1e72,1e73,1e74,1e75,1e76,1e77,1e78,1e79,
        1e80,1e81,1e82,1e83,1e84,1e85,1e86,1e87,1e88,1e89,1e90,1e91,1e92,1e93,1e94,1e95,
        1e96,1e97,1e98,1e99,1e100,1e101,1e102,1e103,1e104,1e105,1e106,1e107,1e108,1e109,1e110,1e111,
        1e112,1e113,1e114,1e115,1e116,1e117,1e118,1e119,1e120,1e121,1e122,1e123,1e124,1e125,1e126,1e127,
        1e128,1e129,1e130,1e131,1e132,1e133,1e134,1e135,1e136,1e137,1e138,1e139,1e140,1e141,1e142,1e143,
        1e144,1e145,1e146,1e147,1e148,1e149,1e150,1e151,1e152,1e153,1e154,1e155,1e156,1e157,1e158,1e159,
        1e160,1e161,1e162,1e163,1e164,1e165,1e166,1e167,1e168,1e169,1e170,1e171,1e172,1e173,1e174,1e175,
        1e176,1e177,1e178,1e179,1e180,1e181,1e182,1e183,1e184,1e185,1e186,1e187,1e188,1e189,1e190,1e191,
        1e192,1e193,1e194,1e195,1e196,1e197,1e198,1e199,1e200,1e201,1e202,1e203,1e204,1e205,1e206,1e207,
        1e208,1e209,1e210,1e211,1e212,1e213,1e214,1e215,1e216,1e217,1e218,1e219,1e220,1e221,1e222,1e223,
        1e224,1e225,1e226,1e227,1e228,1e229,1e230,1e231,1e232,1e233,1e234,1e235,1e236,1e237,1e238,1e239,
        1e240,1e241,1e242,1e243,1e244,1e245,1e246,1e247,1e248,1e249,1e250,1e251,1e252,1e253,1e254,1e255,
        1e256,1e257,1e258,1e259,1e260,1e261,1e262,1e263,1e264,1e265,1e266,1e267,1e268,1e269,1e270,1e271,
        1e272,1e273,1e274,1e275,1e276,1e277,1e278,1e279,1e280,1e281,1e282,1e283,1e284,1e285,1e286,1e287,
        1e288,1e289,1e290,1e291,1e292,1e293,1e294,1e295,1e296,1e297,1e298,1e299,1e300,1e301,1e302,1e303,
        1e304,1e305,1e306,1e307,1e308
    };
    """
    const double pow10 "engine_pow10"[309]

# bytes that may appear unescaped in a JSON string and are plain ASCII: the fast path
cdef uint8_t str_plain[256]
memset(str_plain, 0, sizeof(str_plain))
for _i in range(0x20, 0x80):
    str_plain[_i] = _i != 0x22 and _i != 0x5C  # '"' and '\\' end the fast path

# ---------------------------------------------------------------------------------------
# scanner state
# ---------------------------------------------------------------------------------------

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
    return HeaderError(msg, reason=_REASONS[e.reason], tensors=tensors)


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
    cdef const uint64_t[::1] bv = b
    cdef const uint64_t[::1] ev = e
    cdef size_t n = bv.shape[0], i, bad = <size_t>-1
    cdef Rec* recs = <Rec*>malloc((n if n else 1) * sizeof(Rec))
    cdef RegionError err
    cdef int rc = 0
    if recs == NULL:
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
            raise HeaderError(f"tensor {nm!r}: negative data offset", reason="TensorInvalidInfo",
                              tensors=(nm,))
        if rc < 0:
            raise region_error(&err, names)
        return np.frombuffer(order_bytes(recs, n), dtype=np.intp)
    finally:
        free(recs)


# ---------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------

cdef class HeaderTable:
    """The validated header as a compact table (one row per tensor, in header order).

    ``codes`` index :data:`engine.base.dtypes.DTYPES`; ``begins``/``ends`` are relative to the
    start of the data region; ``order`` lists the rows by ``(begin, end)``, i.e. in file
    order.  The arrays are read-only numpy views of immutable ``bytes`` the table holds,
    made on first access (``names``, ``shapes``, :meth:`dtype_names`, :meth:`row` and
    :meth:`rows` need no numpy).
    """

    cdef readonly list names
    cdef readonly dict index
    cdef readonly list shapes
    cdef readonly object metadata
    cdef readonly Py_ssize_t header_size
    cdef readonly int64_t data_size
    # the columns: uint8 codes, int64 begins and ends, intp order, native byte order
    cdef bytes _codes_b, _begins_b, _ends_b, _order_b
    # pointers into those bytes (alive as long as the table), so row() reads them in C
    cdef const uint8_t* _codes
    cdef const int64_t* _begins
    cdef const int64_t* _ends
    cdef tuple _arrays  # (codes, begins, ends, order) as numpy arrays, on first use

    cdef void _set_columns(self, bytes codes, bytes begins, bytes ends, bytes order) except *:
        cdef Py_ssize_t n = len(self.names)
        if (len(codes) != n or len(begins) != n * 8 or len(ends) != n * 8
                or len(order) != n * <Py_ssize_t>sizeof(Py_ssize_t)):
            raise ValueError(f"table columns do not match its {n} names")
        cdef const uint8_t* c = <const uint8_t*>PyBytes_AS_STRING(codes)
        cdef Py_ssize_t i
        for i in range(n):  # every reader in C indexes dtype tables by code: none may lie outside
            if c[i] >= n_dtypes:
                raise ValueError(f"table columns hold an unknown dtype code {c[i]} at row {i}")
        self._codes_b, self._begins_b, self._ends_b, self._order_b = codes, begins, ends, order
        self._codes = c
        self._begins = <const int64_t*>PyBytes_AS_STRING(begins)
        self._ends = <const int64_t*>PyBytes_AS_STRING(ends)
        self._arrays = None

    cdef object _array(self, int i):
        if self._arrays is None:
            np = numpy_module()
            self._arrays = (
                np.frombuffer(self._codes_b, dtype=np.uint8),
                np.frombuffer(self._begins_b, dtype=np.int64),
                np.frombuffer(self._ends_b, dtype=np.int64),
                np.frombuffer(self._order_b, dtype=np.intp),
            )
        return self._arrays[i]

    @property
    def codes(self):
        """Dtype codes (``uint8``), one per row."""
        return self._array(0)

    @property
    def begins(self):
        """Start of each row's bytes in the data region (``int64``)."""
        return self._array(1)

    @property
    def ends(self):
        """End of each row's bytes in the data region (``int64``)."""
        return self._array(2)

    @property
    def order(self):
        """The rows in file order (``intp``)."""
        return self._array(3)

    def file_order(self):
        """The rows in file order, as a list of ints (``order.tolist()`` without numpy)."""
        cdef Py_ssize_t i, n = len(self.names)
        cdef const Py_ssize_t* o = <const Py_ssize_t*>PyBytes_AS_STRING(self._order_b)
        cdef list out = [None] * n
        for i in range(n):
            out[i] = o[i]
        return out

    def bytes_per_code(self):
        """``{code: bytes}`` of tensor data per dtype code present, in code order.

        Each sum is at most ``data_size`` (the regions tile the data region), so none
        overflows.
        """
        cdef int64_t sums[NDTYPES_MAX]
        cdef bint seen[NDTYPES_MAX]
        cdef Py_ssize_t i, n = len(self.names)
        cdef int c
        memset(sums, 0, sizeof(sums))
        memset(seen, 0, sizeof(seen))
        for i in range(n):
            c = self._codes[i]
            sums[c] += self._ends[i] - self._begins[i]
            seen[c] = True
        return {c: sums[c] for c in range(n_dtypes) if seen[c]}

    def dtype_names(self):
        """The format's dtype name (``"BF16"``, ...) of every row, in header order."""
        cdef Py_ssize_t i, n = len(self.names)
        cdef tuple names = _NAMES
        cdef list out = [None] * n
        for i in range(n):
            out[i] = names[self._codes[i]]
        return out

    def __len__(self):
        return len(self.names)

    def row(self, Py_ssize_t i, cls=tuple):
        """``cls((name, dtype_name, shape, (begin, end)))`` for row ``i``, built in C.

        ``cls`` is ``tuple`` or a subclass of it without extra fields (a NamedTuple such
        as ``engine.format.header.TensorInfo``).
        """
        cdef Py_ssize_t n = len(self.names)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {i} out of range for {n} tensors")
        check_row_type(cls)
        return make_row(cls, self.names[i], _NAMES[self._codes[i]], self.shapes[i],
                        self._begins[i], self._ends[i])

    def rows(self, cls=tuple):
        """``[self.row(i, cls) for i in range(len(self))]``, built in C in one go."""
        return self._rows(cls, False)

    def items(self, cls=tuple):
        """``[(name, self.row(i, cls)) for i, name in enumerate(self.names)]``, built in C."""
        return self._rows(cls, True)

    cdef list _rows(self, cls, bint pairs):
        check_row_type(cls)
        cdef Py_ssize_t i, n = len(self.names)
        cdef list names = self.names, shapes = self.shapes
        cdef list out = [None] * n
        cdef tuple dtype_names = _NAMES
        cdef tuple row, pair
        for i in range(n):
            row = make_row(cls, names[i], dtype_names[self._codes[i]], shapes[i], self._begins[i], self._ends[i])
            if pairs:
                pair = PyTuple_New(2)
                Py_INCREF(names[i])
                PyTuple_SET_ITEM(pair, 0, names[i])
                Py_INCREF(row)
                PyTuple_SET_ITEM(pair, 1, row)
                PyObject_GC_UnTrack(pair)  # holds a str and an untracked row: no cycle possible
                out[i] = pair
            else:
                out[i] = row
        return out

    def __repr__(self):
        return (f"<HeaderTable: {len(self.names)} tensors, header {self.header_size} bytes, "
                f"data {self.data_size} bytes>")

    def __reduce__(self):
        return (_rebuild_table, (self.names, self.index, self._codes_b, self.shapes, self._begins_b,
                                 self._ends_b, self._order_b, self.metadata, self.header_size, self.data_size))


cdef extern from *:
    """
    /* tuple.__new__(cls, ...) for a field-less tuple subclass (a NamedTuple), without
       building an argument tuple: allocate through the type, then fill the items. */
    static PyObject *engine_alloc_tuple(PyObject *cls, Py_ssize_t n) {
        return ((PyTypeObject *)cls)->tp_alloc((PyTypeObject *)cls, n);
    }
    """
    tuple engine_alloc_tuple(object cls, Py_ssize_t n)


cdef object _checked_row_type = tuple  # the last class that passed check_row_type


cdef inline void check_row_type(cls) except *:
    global _checked_row_type
    if cls is _checked_row_type:
        return  # the common case, a loader asking for row after row of one NamedTuple
    check_row_type_slow(cls)
    _checked_row_type = cls


cdef void check_row_type_slow(cls) except *:
    if not (isinstance(cls, type) and issubclass(cls, tuple)
            and cls.__itemsize__ == tuple.__itemsize__ and cls.__basicsize__ == tuple.__basicsize__):
        raise TypeError(f"{cls!r} is not tuple or a subclass of it without extra fields")


cdef inline tuple make_row(object cls, object name, object dtype, object shape, int64_t b, int64_t e):
    """``cls((name, dtype, shape, (b, e)))``; PyTuple_SET_ITEM steals, hence the INCREFs.

    ``cls`` has no ``__dict__`` (checked by check_row_type), so nothing can be attached to
    a row to close a cycle.
    """
    cdef tuple offsets = PyTuple_New(2)
    cdef tuple row
    cdef object v = b
    Py_INCREF(v)
    PyTuple_SET_ITEM(offsets, 0, v)
    v = e
    Py_INCREF(v)
    PyTuple_SET_ITEM(offsets, 1, v)
    row = PyTuple_New(4) if cls is tuple else engine_alloc_tuple(cls, 4)
    Py_INCREF(name)
    PyTuple_SET_ITEM(row, 0, name)
    Py_INCREF(dtype)
    PyTuple_SET_ITEM(row, 1, dtype)
    Py_INCREF(shape)
    PyTuple_SET_ITEM(row, 2, shape)
    Py_INCREF(offsets)
    PyTuple_SET_ITEM(row, 3, offsets)
    # Immutable tuples of str, int and such tuples cannot be part of a reference cycle, so
    # the cyclic GC need not track them (CPython itself untracks such tuples, but only
    # lazily, after traversing them in a collection).  Untracked, 100,000 rows cost the
    # collector nothing, now or in every later full collection of the process.
    PyObject_GC_UnTrack(offsets)
    PyObject_GC_UnTrack(row)
    return row


def _rebuild_table(names, index, codes, shapes, begins, ends, order, metadata, header_size, data_size):
    cdef HeaderTable t = HeaderTable.__new__(HeaderTable)
    t.names, t.index, t.shapes = names, index, shapes
    t._set_columns(codes, begins, ends, order)
    t.metadata = metadata
    t.header_size, t.data_size = header_size, data_size
    return t


# ---------------------------------------------------------------------------------------
# phase 2: Python objects
# ---------------------------------------------------------------------------------------

cdef str decode_span(const uint8_t* buf, Span sp, uint8_t* scratch):
    """``str`` of a validated string span; ``scratch`` holds at least the raw span length."""
    cdef Py_ssize_t m
    cdef str text
    if sp.flags == 0:  # plain ASCII: no decoder needed
        text = PyUnicode_New(sp.end - sp.start, 127)
        memcpy(PyUnicode_DATA(text), buf + sp.start, sp.end - sp.start)
        return text
    if not (sp.flags & S_ESCAPED):
        return PyUnicode_DecodeUTF8(<const char*>buf + sp.start, sp.end - sp.start, NULL)
    m = unescape(buf, sp.start, sp.end, scratch, sp.end - sp.start)
    c_assert(m >= 0)
    return PyUnicode_DecodeUTF8(<const char*>scratch, m, NULL)


cdef str span_str(const uint8_t* buf, Span sp):
    """Like decode_span, allocating its own scratch (error paths)."""
    cdef uint8_t* scratch = <uint8_t*>malloc(sp.end - sp.start + 1)
    if scratch == NULL:
        raise MemoryError()
    try:
        return decode_span(buf, sp, scratch)
    finally:
        free(scratch)


cdef str short_repr(str text):
    if len(text) > MSG_SPAN_MAX:
        return repr(text[:MSG_SPAN_MAX]) + "..."
    return repr(text)


cdef inline Span name_span(const Tensor* t):
    cdef Span sp
    sp.start = t.name_start
    sp.end = t.name_end
    sp.pos = t.key_pos
    sp.flags = t.name_flags
    return sp


cdef object scan_error(Scanner* s):
    if s.reason == R_NOMEM:
        return MemoryError("out of memory while parsing the safetensors header")
    msg = s.msg.decode("utf-8", "replace")
    if s.err_has_span:
        msg = msg.replace("{span}", short_repr(span_str(s.buf, s.err_span)))
    tensors = ()
    if s.err_row >= 0:
        name = span_str(s.buf, name_span(&s.tensors[s.err_row]))
        tensors = (name,)
        msg = f"tensor {short_repr(name)}: {msg}"
    elif s.err_in_meta:
        msg = f"__metadata__: {msg}"
    pos = s.err_pos if s.err_has_pos else None
    if pos is not None:
        msg = f"{msg} (at byte {pos} of the header)"
    return HeaderError(msg, reason=_REASONS[s.reason], position=pos, tensors=tensors)


cdef inline uint64_t hash_dims(const uint64_t* dims, size_t nd) noexcept nogil:
    cdef uint64_t h = nd * 0x9E3779B97F4A7C15ULL
    cdef size_t j
    for j in range(nd):
        h = (h ^ dims[j]) * 0x9E3779B97F4A7C15ULL
        h ^= h >> 29
    return h


cdef list make_shapes(const Scanner* s):
    """One tuple per tensor; tensors of equal shape share one tuple (weights repeat shapes
    layer after layer), found through an open-addressing table over the dims."""
    cdef size_t nt = s.ntensors, cap = 16, i, j, r, mask
    cdef size_t empty = <size_t>-1
    cdef const Tensor* t
    cdef size_t* slots
    cdef list shapes = [None] * <Py_ssize_t>nt
    while cap < 2 * nt:
        cap *= 2
    mask = cap - 1
    slots = <size_t*>malloc(cap * sizeof(size_t))
    if slots == NULL:
        raise MemoryError()
    try:
        memset(slots, 0xFF, cap * sizeof(size_t))
        for i in range(nt):
            t = &s.tensors[i]
            j = hash_dims(s.dims + t.dim0, t.ndim) & mask
            while True:
                r = slots[j]
                if r == empty:
                    slots[j] = i
                    shapes[i] = make_shape(s.dims + t.dim0, t.ndim)
                    break
                if (s.tensors[r].ndim == t.ndim and
                        memcmp(s.dims + s.tensors[r].dim0, s.dims + t.dim0, t.ndim * sizeof(uint64_t)) == 0):
                    shapes[i] = shapes[r]
                    break
                j = (j + 1) & mask
        return shapes
    finally:
        free(slots)


cdef tuple make_shape(const uint64_t* dims, size_t nd):
    cdef tuple t = PyTuple_New(nd)
    cdef size_t j
    for j in range(nd):
        v = PyLong_FromUnsignedLongLong(dims[j])
        Py_INCREF(v)  # PyTuple_SET_ITEM steals a reference
        PyTuple_SET_ITEM(t, j, v)
    PyObject_GC_UnTrack(t)  # ints only: see make_row
    return t


cdef HeaderTable build_table(Scanner* s, int64_t data_size):
    cdef size_t nt = s.ntensors, i
    cdef Py_ssize_t before
    cdef Tensor* t
    cdef list names = []
    cdef dict index = engine_dict_new(<Py_ssize_t>s.ntensors)
    cdef dict meta
    cdef str name, key
    cdef Rec* recs = NULL
    cdef RegionError rerr
    cdef int rc
    cdef bytes codes, begins, ends
    cdef uint8_t* cp
    cdef int64_t* bp
    cdef int64_t* ep
    cdef list shapes
    cdef HeaderTable table
    cdef uint8_t* scratch = <uint8_t*>malloc(s.n + 1)  # proportional to the header length
    if scratch == NULL:
        raise MemoryError()
    try:
        for i in range(nt):
            t = &s.tensors[i]
            name = decode_span(s.buf, name_span(t), scratch)
            before = len(index)
            index[name] = i
            if len(index) == before:
                raise HeaderError(
                    f"tensor {short_repr(name)} appears twice in the header (at byte {t.key_pos} of the header)",
                    reason="DuplicateKey", position=t.key_pos, tensors=(name,))
            names.append(name)

        metadata = None
        if s.has_meta:
            meta = {}
            for i in range(0, s.nmeta, 2):
                key = decode_span(s.buf, s.meta[i], scratch)
                if key in meta:
                    raise HeaderError(
                        f"__metadata__: key {short_repr(key)} appears twice "
                        f"(at byte {s.meta[i].pos} of the header)",
                        reason="DuplicateKey", position=s.meta[i].pos)
                meta[key] = decode_span(s.buf, s.meta[i + 1], scratch)
            metadata = meta

        recs = <Rec*>malloc((nt if nt else 1) * sizeof(Rec))
        if recs == NULL:
            raise MemoryError()
        for i in range(nt):
            recs[i].begin = s.tensors[i].begin
            recs[i].end = s.tensors[i].end
            recs[i].row = i
        with nogil:
            rc = region_check(recs, nt, <uint64_t>data_size, &rerr)
        if rc < 0:
            raise region_error(&rerr, names)
        # from here on every offset is <= data_size <= 2**63 - 1: int64 holds them

        codes = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>nt)
        begins = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>(nt * 8))
        ends = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>(nt * 8))
        # new bytes objects, not yet shared with anyone: filled in place, then immutable
        cp = <uint8_t*>PyBytes_AS_STRING(codes)
        bp = <int64_t*>PyBytes_AS_STRING(begins)
        ep = <int64_t*>PyBytes_AS_STRING(ends)
        for i in range(nt):
            t = &s.tensors[i]
            cp[i] = t.code
            bp[i] = <int64_t>t.begin
            ep[i] = <int64_t>t.end
        shapes = make_shapes(s)

        table = HeaderTable.__new__(HeaderTable)
        table.names = names
        table.index = index
        table.shapes = shapes
        table._set_columns(codes, begins, ends, order_bytes(recs, nt))
        table.metadata = metadata
        table.header_size = <Py_ssize_t>s.n
        table.data_size = data_size
        return table
    finally:
        free(scratch)
        free(recs)


cdef const uint8_t[::1] as_byte_view(buf) except *:
    try:
        return buf
    except (ValueError, TypeError):
        pass
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("the header buffer must be C-contiguous")
    return mv.cast("B")


def parse_header(buf, data_size, strict=False):
    """Parse and validate the ``N`` header bytes; ``data_size`` is the data region's length.

    ``buf`` is any C-contiguous bytes-like object (``bytes``, ``memoryview``, ``mmap``
    slice) holding exactly the header; it is scanned in place and not retained.
    Fields of a tensor entry other than dtype, shape and data_offsets are checked to be
    JSON and ignored, as the reference does; ``strict=True`` rejects them.
    Raises ``HeaderError`` for every rule of the format (see ``engine.format.header``).
    """
    cdef const uint8_t[::1] view = as_byte_view(buf)
    cdef int64_t dsize
    cdef Scanner s
    cdef int rc
    cdef const uint8_t* empty = b""
    if data_size < 0:
        raise ValueError(f"data_size must be non-negative, got {data_size}")
    dsize = data_size
    memset(&s, 0, sizeof(Scanner))
    s.n = view.shape[0]
    s.buf = &view[0] if s.n else empty
    s.err_row = -1
    s.strict = bool(strict)
    try:
        with nogil:
            rc = scan_header(&s)
        if rc < 0:
            raise scan_error(&s)
        return build_table(&s, dsize)
    finally:
        free(s.tensors)
        free(s.dims)
        free(s.meta)


def header_length(prefix, file_size, max_header_size=MAX_HEADER_SIZE):
    """Header length ``N`` from the file's first ``min(8, file_size)`` bytes, validated.

    Raises ``HeaderError``: ``HeaderTooSmall`` (file shorter than 8 bytes),
    ``HeaderTooLarge`` (``N > max_header_size``), ``InvalidHeaderLength``
    (``8 + N > file_size``; computed without wrapping).
    """
    cdef uint64_t n, fsize, cap
    if file_size < 0:
        raise ValueError(f"file_size must be non-negative, got {file_size}")
    if max_header_size < 0:
        raise ValueError(f"max_header_size must be non-negative, got {max_header_size}")
    if file_size < 8:
        raise HeaderError(
            f"the file holds {file_size} bytes, fewer than the 8-byte header length",
            reason="HeaderTooSmall")
    prefix = bytes(prefix[:8])
    if len(prefix) < 8:
        raise ValueError("prefix must hold the file's first 8 bytes")
    n = int.from_bytes(prefix, "little")
    fsize = file_size
    cap = min(max_header_size, UINT64_MAX)
    if n > cap:
        raise HeaderError(
            f"the header declares a length of {n} bytes, more than the limit of {max_header_size} "
            f"(raise max_header_size to accept it)",
            reason="HeaderTooLarge")
    if n > fsize - 8:  # 8 + n > fsize, without wrapping
        raise HeaderError(
            f"the header declares a length of {n} bytes but the file holds only {fsize - 8} bytes "
            f"after the 8-byte length",
            reason="InvalidHeaderLength")
    return n


def tensor_nbytes(code, shape):
    """Bytes taken by a tensor of dtype ``code`` and ``shape``, with the header's checks.

    Raises ``HeaderError``: ``ValidationOverflow`` (element count or bits overflow 64
    bits), ``MisalignedSlice`` (sub-byte dtype whose bits are not whole bytes).
    """
    cdef int c = code
    cdef uint64_t numel = 1, d, bits
    if not 0 <= c < n_dtypes:
        raise ValueError(f"invalid dtype code {code}")
    bits = dtype_bits[c]
    for dim in shape:
        if dim < 0:
            raise ValueError(f"negative dimension in shape {tuple(shape)}")
        if dim > UINT64_MAX:
            raise HeaderError(f"dimension {dim} does not fit in 64 bits", reason="ValidationOverflow")
        d = dim
        if d != 0 and numel > UINT64_MAX // d:
            raise HeaderError(f"the product of shape {tuple(shape)} overflows 64 bits",
                              reason="ValidationOverflow")
        numel *= d
    if numel != 0 and bits > UINT64_MAX // numel:
        raise HeaderError(f"{numel} elements of {bits} bits overflow 64 bits", reason="ValidationOverflow")
    if (numel * bits) % 8:
        raise HeaderError(
            f"{numel} elements of {_NAMES[c]} take {numel * bits} bits, not a whole number of bytes",
            reason="MisalignedSlice")
    return numel * bits // 8
