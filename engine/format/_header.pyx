# cython: language_level=3, embedsignature=True, binding=False
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

The source is in parts, included below in the order the scan uses them (one extension, so the
scanner's calls between them stay direct C calls): ``_json.pxi`` (the scanner's state and the
JSON it reads), ``_schema.pxi`` (the format's rules per entry), ``_regions.pxi`` (the region
check), ``_table.pxi`` (phase 2: the table), and ``_slices.pxi`` (a handle's per-name lookups,
here so that a first open loads one native module).
"""

import weakref

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_GET_ITEM
from cpython.object cimport PyObject
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
from libc.errno cimport EINTR, errno
from posix.fcntl cimport F_GETFL, F_SETFL, O_CLOEXEC, O_NONBLOCK, O_RDONLY, fcntl, open as c_open
from posix.stat cimport S_ISREG, fstat, struct_stat
from posix.types cimport off_t
from posix.unistd cimport close as c_close, pread

# _NAMES and _BITS: the format's dtypes, written by setup.py from engine/base/_dtype_rows.py
include "_dtype_rows.pxi"

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


cdef object _errors_module = None


cdef object _errors():
    """:mod:`engine.errors`, imported by the first error raised here: a first open that
    succeeds creates none of the hierarchy's classes."""
    global _errors_module
    if _errors_module is None:
        from engine import errors
        _errors_module = errors
    return _errors_module


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
    "Slicer",
    "TensorSlice",
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
# dtype table, filled from _NAMES and _BITS (engine.base._dtype_rows) at import so there is one source of truth
# ---------------------------------------------------------------------------------------

cdef int n_dtypes = len(_NAMES)
if n_dtypes > NDTYPES_MAX:
    raise ImportError("engine.base._dtype_rows declares more dtypes than engine.format._header can hold")
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

# ---------------------------------------------------------------------------------------
# the parts, in the order the scan uses them
# ---------------------------------------------------------------------------------------

include "_json.pxi"
include "_schema.pxi"
include "_regions.pxi"
include "_table.pxi"
include "_slices.pxi"


cdef int get_bytes(object buf, Py_buffer* view) except -1:
    """Fill ``view`` with the bytes of ``buf``, any C-contiguous bytes-like object (release it
    with ``PyBuffer_Release``).  The buffer protocol itself, not a typed memoryview: those
    bring Cython's memoryview types, whose set-up would be most of this module's import."""
    try:
        PyObject_GetBuffer(buf, view, PyBUF_SIMPLE)
        return 0
    except (ValueError, TypeError, BufferError):
        pass
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("the header buffer must be C-contiguous")
    PyObject_GetBuffer(mv.cast("B"), view, PyBUF_SIMPLE)
    return 0


def parse_header(buf, data_size, strict=False):
    """Parse and validate the ``N`` header bytes; ``data_size`` is the data region's length.

    ``buf`` is any C-contiguous bytes-like object (``bytes``, ``memoryview``, ``mmap``
    slice) holding exactly the header; it is scanned in place and not retained.
    Fields of a tensor entry other than dtype, shape and data_offsets are checked to be
    JSON and ignored, as the reference does; ``strict=True`` rejects them.
    Raises ``HeaderError`` for every rule of the format (see ``engine.format.header``).
    """
    cdef Py_buffer view
    cdef int64_t dsize
    cdef Scanner s
    cdef int rc
    cdef const uint8_t* empty = b""
    if data_size < 0:
        raise ValueError(f"data_size must be non-negative, got {data_size}")
    dsize = data_size
    get_bytes(buf, &view)
    memset(&s, 0, sizeof(Scanner))
    s.n = view.len
    s.buf = <const uint8_t*>view.buf if s.n else empty
    s.err_row = -1
    s.strict = bool(strict)
    try:
        with nogil:
            rc = scan_header(&s)
        if rc < 0:
            raise scan_error(&s)
        return build_table(&s, dsize)
    finally:
        PyBuffer_Release(&view)
        free(s.tensors)
        free(s.dims)
        free(s.meta)


cdef extern from "Python.h":
    object PyContextVar_New(const char* name, object default)
    bytes PyUnicode_EncodeFSDefault(object unicode)

#: Whether loads started in this context verify the checksums their files record (see
#: engine.format.verification, which sets it); here so that a first open asks it without
#: importing that module.
VERIFY = PyContextVar_New("engine_verify_checksums", True)


def verifying():
    """Whether loads started now verify the checksums their files carry (default True)."""
    return VERIFY.get()


def open_regular(path):
    """``engine.base._files.open_regular(path)``, with its common case in C: a regular file
    opened read-only (close-on-exec; ``O_NONBLOCK`` while it is checked, so that a FIFO never
    blocks the open).  Anything else (an error, a FIFO, a directory, a NUL in the name) goes
    to that function, which raises what it raises.  A handle's open, without importing it."""
    cdef bytes name
    cdef const char* c_name
    cdef int fd
    cdef struct_stat st
    cdef bint done = False
    if type(path) is str:
        name = PyUnicode_EncodeFSDefault(path)
    elif type(path) is bytes:
        name = path
    else:
        name = None
    if name is not None and b"\0" not in name:
        c_name = name
        with nogil:
            fd = c_open(c_name, O_RDONLY | O_CLOEXEC | O_NONBLOCK)
            if fd >= 0:
                if fstat(fd, &st) == 0 and S_ISREG(st.st_mode) and fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) == 0:
                    done = True
                else:
                    c_close(fd)
        if done:
            return fd
    from engine.base._files import open_regular as checked_open

    return checked_open(path)


cdef object pread_full(int fd, Py_ssize_t size, int64_t offset):
    """``size`` bytes at ``offset`` (the GIL released), or None where the file ends first or a
    read fails."""
    out = PyBytes_FromStringAndSize(NULL, size)
    cdef char* p = PyBytes_AS_STRING(out)
    cdef Py_ssize_t got = 0
    cdef ssize_t r
    with nogil:
        while got < size:
            r = pread(fd, p + got, <size_t>(size - got), <off_t>(offset + got))
            if r < 0 and errno == EINTR:
                continue
            if r <= 0:
                break
            got += r
    return out if got == size else None


def read_table(int fd, file_size, max_header_size=MAX_HEADER_SIZE, path=None):
    """The :class:`HeaderTable` of the open file ``fd`` of ``file_size`` bytes: its ``8 + N``
    header bytes read with two ``pread`` calls, then parsed (``strict=False``).

    None where the 8-byte length fails :func:`header_length`'s checks or a read comes back
    short (a read error, or a file shorter than ``file_size``): the caller reads the file again
    with ``engine.format.header.read_header_fd``, which names the failure.  A ``HeaderError``
    of the parse names ``path``.  A handle's open, in one native call.
    """
    if file_size < 8 or max_header_size < 0:
        return None
    prefix = pread_full(fd, 8, 0)
    if prefix is None:
        return None
    n = int.from_bytes(prefix, "little")
    if n > max_header_size or n > file_size - 8:
        return None
    buf = pread_full(fd, n, 8)
    if buf is None:
        return None
    try:
        return parse_header(buf, file_size - 8 - n, False)
    except BaseException as err:
        if path is not None and isinstance(err, _errors().HeaderError) and err.path is None:
            err.path = path
        raise


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
        raise _errors().HeaderError(
            f"the file holds {file_size} bytes, fewer than the 8-byte header length",
            reason="HeaderTooSmall")
    prefix = bytes(prefix[:8])
    if len(prefix) < 8:
        raise ValueError("prefix must hold the file's first 8 bytes")
    n = int.from_bytes(prefix, "little")
    fsize = file_size
    cap = min(max_header_size, UINT64_MAX)
    if n > cap:
        raise _errors().HeaderError(
            f"the header declares a length of {n} bytes, more than the limit of {max_header_size} "
            f"(raise max_header_size to accept it)",
            reason="HeaderTooLarge")
    if n > fsize - 8:  # 8 + n > fsize, without wrapping
        raise _errors().HeaderError(
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
            raise _errors().HeaderError(f"dimension {dim} does not fit in 64 bits", reason="ValidationOverflow")
        d = dim
        if d != 0 and numel > UINT64_MAX // d:
            raise _errors().HeaderError(f"the product of shape {tuple(shape)} overflows 64 bits",
                              reason="ValidationOverflow")
        numel *= d
    if numel != 0 and bits > UINT64_MAX // numel:
        raise _errors().HeaderError(f"{numel} elements of {bits} bits overflow 64 bits", reason="ValidationOverflow")
    if (numel * bits) % 8:
        raise _errors().HeaderError(
            f"{numel} elements of {_NAMES[c]} take {numel * bits} bits, not a whole number of bytes",
            reason="MisalignedSlice")
    return numel * bits // 8
