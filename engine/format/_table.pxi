# Included by _header.pyx (one extension module: the scanner's C calls stay direct).
# Phase 2: the HeaderTable built from the scan (names decoded, duplicates found, rows made).

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
    return _errors().HeaderError(msg, reason=_REASONS[s.reason], position=pos, tensors=tensors)


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
                raise _errors().HeaderError(
                    f"tensor {short_repr(name)} appears twice in the header (at byte {t.key_pos} of the header)",
                    reason="DuplicateKey", position=t.key_pos, tensors=(name,))
            names.append(name)

        metadata = None
        if s.has_meta:
            meta = {}
            for i in range(0, s.nmeta, 2):
                key = decode_span(s.buf, s.meta[i], scratch)
                if key in meta:
                    raise _errors().HeaderError(
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
