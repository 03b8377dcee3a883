# Included by _header.pyx: the per-name lookups of engine.loading.file_handle.safe_open in C, in
# the header's extension so that a first open loads one native module, not two.
#
# Callers walk every key of a file with ``f.get_slice(name).get_shape()`` and
# ``.get_dtype()``; on a header of 100,000 tensors those three calls are the whole cost of
# the loop, so they are C methods here: a dict lookup, one small object, a list or a str.

@cython.freelist(64)
@cython.final
@cython.auto_pickle(False)
cdef class TensorSlice:
    """Lazy handle on one tensor, as returned by ``safe_open.get_slice``.

    ``get_shape()``, ``get_dtype()`` (and the ``shape``/``dtype`` attributes) read the
    header; indexing (ints, negative ints, slices with steps, ``...``, an empty list) reads
    only the bytes the index covers.
    """

    cdef readonly object _handle
    cdef readonly Py_ssize_t _row
    cdef tuple _shape
    cdef str _dtype

    def get_shape(self):
        """The shape as a list of ints, as the reference returns it."""
        return list(self._shape)

    def get_dtype(self):
        """The format's dtype name (``"BF16"``, ...)."""
        return self._dtype

    @property
    def shape(self):
        return self._shape

    @property
    def dtype(self):
        return self._dtype

    def __len__(self):
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    def __getitem__(self, index):
        return self._handle._read_slice(self._row, index)

    def __repr__(self):
        name = self._handle.header.table.names[self._row]
        return f"<TensorSlice {name!r} {self._dtype}{list(self._shape)}>"


@cython.final
@cython.auto_pickle(False)
cdef class Slicer:
    """``get_slice`` of one open handle: name -> :class:`TensorSlice`.

    Holds the header table's per-row lists and a weak reference to the handle (which holds
    this object), so the handle is freed, and its file closed, as soon as the caller
    drops it.  ``closed`` is set by the handle's ``close()``.
    """

    cdef dict index
    cdef list shapes
    cdef list dtypes
    cdef object table
    cdef object handle_ref
    cdef public bint closed

    def __init__(self, handle, table):
        self.index = table.index
        self.shapes = table.shapes
        self.dtypes = None  # this handle's list of dtype names, built on the first lookup
        self.table = table
        self.handle_ref = weakref.ref(handle)
        self.closed = False

    def __call__(self, name):
        cdef PyObject* row
        cdef Py_ssize_t r
        cdef TensorSlice out
        handle = self.handle_ref()
        if handle is None:  # the handle was dropped: its file is closed
            raise _errors().SafetensorError("the file is closed", reason="FileClosed")
        # any key a dict takes (a str subclass such as numpy.str_); NULL for the rest
        row = PyDict_GetItem(self.index, name)
        if row == NULL or self.closed:
            return handle._missing(name)  # raises
        if self.dtypes is None:
            self.dtypes = self.table.dtype_names()  # a list of its own: read by index below
        r = <object>row
        out = TensorSlice.__new__(TensorSlice)
        out._handle = handle
        out._row = r
        out._shape = <tuple>PyList_GET_ITEM(self.shapes, r)
        out._dtype = <str>PyList_GET_ITEM(self.dtypes, r)
        return out
