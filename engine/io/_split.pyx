# cython: language_level=3, embedsignature=True
# distutils: language = c
#
# Bounds/wraparound checks and cdivision are set once in setup.py (ENGINE_CYTHON_CHECKS=1
# turns them on).
"""Split copies: one large batch of a load spread over a pool of native threads.

Private: the public wrapper is :func:`engine.io.reader.split_reader`, and
:func:`engine.io.reader.check_read` turns the error codes returned here into
:class:`~engine.errors.ReadError` with the file, offset and size.

A batch of a host load is hundreds of MiB; one thread copying it out of the page cache runs
at a fraction of the host's memory bandwidth, so it is dealt out in pieces to threads kept
for the whole load (:class:`SplitReader`), each copying its pieces with the copy engine of
``_io.pyx`` (``pread`` or a populated mapping), with the GIL released for the whole call:
the cost in Python is one call per batch.  Here: how the batch is cut into pieces, the pool
that takes them, and the per-target CRC-32C of a checksummed copy, joined from its pieces.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset

from engine.base._crc32c cimport crc32c_combine
from engine.io._io cimport (
    _DIGEST_BLOCK, _Choice, _Part, _copy_piece, _crc_landed, _guard_ready, _unmap_run, pthread_cond_broadcast, pthread_cond_destroy,
    pthread_cond_init, pthread_cond_signal, pthread_cond_t, pthread_cond_wait, pthread_create, pthread_join,
    pthread_mutex_destroy, pthread_mutex_init, pthread_mutex_lock, pthread_mutex_t, pthread_mutex_unlock, pthread_t,
)


cdef extern from *:
    """
    /* the next piece of a split copy: threads take pieces in order, each as it is free */
    static inline int64_t engine_take(int64_t *cursor, int64_t n) {
        return __atomic_fetch_add(cursor, n, __ATOMIC_RELAXED);
    }
    """
    int64_t _take "engine_take"(int64_t* cursor, int64_t n) noexcept nogil


# most threads one split read starts
cdef int _MAX_SPLIT_THREADS = 256


cdef inline void _release_run(_Part* p, int64_t lo, int64_t hi) noexcept nogil:
    """:func:`_unmap_run` for a part's run, except from a kept mapping, whose pages are kept
    mapped for the next load of the file (that is what keeping it is for)."""
    if not p.keep:
        _unmap_run(p.src, p.src_len, lo, hi)


# a checksummed copy goes this many bytes at a time, each block's CRC taken right after its
# copy while the block is still in the core's cache (one pass over the bytes from memory):


cdef int _copy_digest(_Part* p, uint8_t* out, int64_t nbytes, int64_t offset, uint32_t* crc) noexcept nogil:
    """:func:`_copy_piece`, block by block, each block's CRC-32C added to ``crc`` as it lands."""
    cdef int64_t n
    cdef int err
    while nbytes > 0:
        n = nbytes if nbytes < _DIGEST_BLOCK else _DIGEST_BLOCK
        err = _copy_piece(p, out, n, offset)
        if err:
            return err
        crc[0] = _crc_landed(p, out, n, offset, crc[0])
        out += n
        offset += n
        nbytes -= n
    return 0


cdef void* _read_part(void* arg) noexcept nogil:
    cdef _Part* p = <_Part*>arg
    cdef Py_ssize_t i = 0
    cdef int64_t a, b, lo, hi, t, at, run_lo, run_hi
    cdef uint32_t crc
    while True:
        # pieces are the cursor's steps moved back by shift (the first one shorter)
        t = _take(p.cursor, p.piece)
        lo = t - p.shift
        if lo < 0:
            lo = 0
        if lo >= p.total:
            break
        hi = t + p.piece - p.shift
        if hi > p.total:
            hi = p.total
        run_lo = run_hi = -1  # the file-contiguous run copied so far, unmapped as a whole
        # first segment that ends after lo (pieces go forward: the scan goes on from there)
        while i < p.nseg and p.starts[i] + p.sizes[i] <= lo:
            i += 1
        while i < p.nseg and p.starts[i] < hi:
            a = lo if lo > p.starts[i] else p.starts[i]
            b = p.starts[i] + p.sizes[i]
            if b > hi:
                b = hi
            at = p.file_off[i] + (a - p.starts[i])
            if p.cells != NULL:
                # this piece's cell of segment i (the pieces since the segment's first one)
                crc = 0
                p.err = _copy_digest(p, p.dst[i] + (a - p.starts[i]), b - a, at, &crc)
                p.cells[p.cellbase[i] + (t // p.piece) - (p.starts[i] + p.shift) // p.piece] = crc
            else:
                p.err = _copy_piece(p, p.dst[i] + (a - p.starts[i]), b - a, at)
            if p.err:
                p.errpos = a
                _release_run(p, run_lo, run_hi)
                return NULL
            if at != run_hi:
                _release_run(p, run_lo, run_hi)
                run_lo = at
            run_hi = at + (b - a)
            if b < p.starts[i] + p.sizes[i]:
                break  # the segment goes on past this piece
            i += 1
        _release_run(p, run_lo, run_hi)
    return NULL


# A set of segments to copy: segment i is sizes[i] bytes at file offset file_off[i], going to
# dst[i]; starts[i] is its position in the concatenation.  Built with the GIL (it reads Python
# buffers), used without it.
cdef struct _Segs:
    Py_ssize_t n
    const int64_t* file_off
    int64_t* sizes
    int64_t* starts
    uint8_t** dst
    int64_t total
    uint32_t* cells       # with checksums: one CRC per (segment, piece) cell, else NULL
    int64_t* cellbase


cdef void _free_segs(_Segs* s) noexcept:
    free(s.sizes); free(s.starts); free(s.dst); free(s.cells); free(s.cellbase)
    s.sizes = NULL
    s.starts = NULL
    s.dst = NULL
    s.cells = NULL
    s.cellbase = NULL


cdef int _alloc_segs(_Segs* s, Py_ssize_t n) except -1:
    s.n = n
    s.total = 0
    s.sizes = <int64_t*>calloc(n if n else 1, sizeof(int64_t))
    s.starts = <int64_t*>calloc(n if n else 1, sizeof(int64_t))
    s.dst = <uint8_t**>calloc(n if n else 1, sizeof(uint8_t*))
    s.cells = NULL
    s.cellbase = NULL
    if s.sizes == NULL or s.starts == NULL or s.dst == NULL:
        _free_segs(s)
        raise MemoryError()
    return 0


cdef int _segs_in_targets(_Segs* s, const int64_t[::1] file_offsets, list targets) except -1:
    """Segments into many buffers: segment i fills the whole of ``targets[i]``."""
    cdef Py_ssize_t n = len(targets), i
    cdef uint8_t[::1] view
    if file_offsets.shape[0] != n:
        raise ValueError("file_offsets and targets differ in length")
    _alloc_segs(s, n)
    s.file_off = &file_offsets[0] if n else NULL
    try:
        for i in range(n):
            if file_offsets[i] < 0:
                raise ValueError("negative offset")
            view = targets[i]  # writable, contiguous bytes, or TypeError/ValueError
            s.sizes[i] = view.shape[0]
            s.starts[i] = s.total
            s.dst[i] = &view[0] if view.shape[0] else NULL
            s.total += view.shape[0]
    except BaseException:
        _free_segs(s)
        raise
    return 0


# Threads take pieces of this size in order, each the next one as soon as it is free (a shared
# cursor), so that together they move through the file as one front: a cold file is then read
# ahead as one sequential stream, where halves read at once would be two streams the kernel's
# read-ahead serves one window at a time; and a thread held up (descheduled, or on the slower
# source) takes fewer pieces instead of making the others wait for its fixed share at the end
# of the copy.  Large enough that a piece costs a few system calls.
cdef int64_t _PIECE = 8 << 20
PIECE_BYTES = _PIECE
# the largest folio the page cache maps with one entry (a PMD on x86-64 and arm64 with 4 KiB pages)
cdef int64_t _FOLIO = 2 << 20


cdef int _plan_parts(_Part* parts, int nparts, int fd, const uint8_t* src, int64_t src_len, _Segs* s,
                     int64_t align, _Choice* choices, int stream, int keep, int64_t* cursor) noexcept nogil:
    """Shares of the concatenated segments: pieces of ``_PIECE`` bytes (less for a small set:
    an equal share each) taken in order from a shared cursor.  Pieces of 2 MiB and more (a
    host load's) are a multiple of 2 MiB, cut where the file offset is a
    multiple of 2 MiB (the first piece shorter), so that mapped pieces unmap whole 2 MiB
    folios (see ``_unmap_run``); where the segments follow each other in the file (a whole
    load, a batch) every cut is on such a line.  Smaller ones are cut a multiple of ``align``
    bytes into the concatenation.  With ``keep`` (a kept mapping), the pages a piece mapped
    stay mapped."""
    cdef int k
    cdef int64_t shift = 0
    cdef int64_t piece = (s.total + nparts - 1) // nparts
    if piece > _PIECE:
        piece = _PIECE
    if piece >= _FOLIO and s.n:
        piece = (piece + _FOLIO - 1) // _FOLIO * _FOLIO  # at most _PIECE, a multiple of _FOLIO
        shift = s.file_off[0] % _FOLIO
    else:
        piece = (piece + align - 1) // align * align
    for k in range(nparts):
        memset(&parts[k], 0, sizeof(_Part))
        parts[k].fd = fd
        parts[k].src = src
        parts[k].src_len = src_len
        parts[k].choice = &choices[k] if choices != NULL else NULL
        parts[k].stream = stream
        parts[k].keep = keep
        parts[k].dst = s.dst
        parts[k].file_off = s.file_off
        parts[k].sizes = s.sizes
        parts[k].starts = s.starts
        parts[k].nseg = s.n
        parts[k].cursor = cursor
        parts[k].piece = piece
        parts[k].total = s.total
        parts[k].shift = shift
    return 0


cdef int _plan_cells(_Part* parts, int nparts, _Segs* s) noexcept nogil:
    """Give the parts one CRC cell per (segment, piece) pair (``s.cells``, ``s.cellbase``):
    each cell is written by the one thread that copies that piece of the segment, so the
    threads need no lock, and :func:`_join_cells` joins a segment's cells in order.
    Returns -1 where memory ran out."""
    cdef Py_ssize_t i
    cdef int k
    cdef int64_t ncells = 0, piece = parts[0].piece, shift = parts[0].shift
    s.cellbase = <int64_t*>calloc(s.n if s.n else 1, sizeof(int64_t))
    if s.cellbase == NULL:
        return -1
    for i in range(s.n):
        s.cellbase[i] = ncells
        if s.sizes[i]:
            ncells += (s.starts[i] + s.sizes[i] - 1 + shift) // piece - (s.starts[i] + shift) // piece + 1
    s.cells = <uint32_t*>calloc(ncells if ncells else 1, sizeof(uint32_t))
    if s.cells == NULL:
        return -1
    for k in range(nparts):
        parts[k].cells = s.cells
        parts[k].cellbase = s.cellbase
        # the blocks, smaller than the pieces the copy times, still learn their source
        parts[k].timed = _DIGEST_BLOCK // 2
    return 0


cdef void _join_cells(_Segs* s, int64_t piece, int64_t shift, uint32_t* out) noexcept nogil:
    """``out[i]``: the CRC-32C of segment ``i``, its cells joined in order."""
    cdef Py_ssize_t i
    cdef int64_t j, j0, j1, lo, hi, a, b
    cdef uint32_t crc
    for i in range(s.n):
        crc = 0
        if s.sizes[i]:
            a = s.starts[i]
            b = a + s.sizes[i]
            j0 = (a + shift) // piece
            j1 = (b - 1 + shift) // piece
            for j in range(j0, j1 + 1):
                lo = j * piece - shift
                hi = lo + piece
                if lo < a:
                    lo = a
                if hi > b:
                    hi = b
                crc = crc32c_combine(crc, s.cells[s.cellbase[i] + j - j0], <uint64_t>(hi - lo))
        out[i] = crc


cdef int _share_count(int threads, int64_t total, int64_t align) noexcept nogil:
    cdef int n = threads
    if n > _MAX_SPLIT_THREADS:
        n = _MAX_SPLIT_THREADS
    if n < 1:
        n = 1
    if n > (total + align - 1) // align:
        n = <int>((total + align - 1) // align)
    return n


cdef tuple _first_error(_Part* parts, int nparts):
    """The failure lowest in the concatenation, or (0, 0, 0)."""
    cdef int k, first = -1
    for k in range(nparts):
        if parts[k].err and (first < 0 or parts[k].errpos < parts[first].errpos):
            first = k
    if first < 0:
        return (0, 0, 0)
    return (parts[first].err, parts[first].at, parts[first].missing)


# A pool of native threads kept for the length of a load: each read wakes them instead of
# starting new ones (a host load reads a batch at a time, dozens of times per load).

cdef struct _PoolState:
    pthread_mutex_t lock
    pthread_cond_t go
    pthread_cond_t done
    _Part* parts          # the current read's shares; worker i reads share i (the caller share 0)
    int nparts
    long generation       # bumped for each read
    int remaining         # worker shares of the current read not finished yet
    int stop


cdef struct _WorkerArg:
    _PoolState* st
    int index


cdef void* _pool_worker(void* arg) noexcept nogil:
    cdef _WorkerArg* w = <_WorkerArg*>arg
    cdef _PoolState* st = w.st
    cdef long seen = 0
    cdef _Part* part
    while True:
        pthread_mutex_lock(&st.lock)
        while st.generation == seen and not st.stop:
            pthread_cond_wait(&st.go, &st.lock)
        if st.stop:
            pthread_mutex_unlock(&st.lock)
            return NULL
        seen = st.generation
        part = &st.parts[w.index] if w.index < st.nparts else NULL
        pthread_mutex_unlock(&st.lock)
        if part != NULL:
            _read_part(part)
            pthread_mutex_lock(&st.lock)
            st.remaining -= 1
            if st.remaining == 0:
                pthread_cond_signal(&st.done)
            pthread_mutex_unlock(&st.lock)


cdef class SplitReader:
    """Split copies (:meth:`copy`) on native threads started once: ``threads - 1`` workers
    plus the calling thread.  One copy at a time; :meth:`close` (or the end of a ``with``
    block) stops and joins the workers.

    With ``adaptive``, copies given a mapping choose per piece between it and ``pread``:
    each thread times what mapping the pages of its pieces (1 MiB and up) costs against
    copying them, maps while that is under a quarter, else ``pread``s and maps the first MiB
    of a piece again now and then (after 2 pieces, then 4, up to 32), learning over the
    reader's life (see ``_Choice``); :attr:`costs` shows what they learned and
    :attr:`sources` what each source copied.  With ``stream``, copies out of the mapping
    store past the caches (for destinations nobody reads soon: a caller's
    tensors, owned blocks; not a buffer the DMA engine reads next, which is better found in
    the cache)."""

    cdef _PoolState* st
    cdef _WorkerArg* args
    cdef pthread_t* tids
    cdef _Choice* choices  # per thread, kept between copies (NULL: mapped copies always map)
    cdef int stream
    cdef int nworkers
    cdef bint busy

    def __cinit__(self, int threads, bint adaptive=False, bint stream=False):
        cdef int k, want = threads - 1
        if want > _MAX_SPLIT_THREADS - 1:
            want = _MAX_SPLIT_THREADS - 1
        if want < 0:
            want = 0
        self.st = <_PoolState*>calloc(1, sizeof(_PoolState))
        self.args = <_WorkerArg*>calloc(want + 1, sizeof(_WorkerArg))
        self.tids = <pthread_t*>calloc(want + 1, sizeof(pthread_t))
        self.stream = stream
        self.choices = <_Choice*>calloc(want + 1, sizeof(_Choice)) if adaptive else NULL
        if self.st == NULL or self.args == NULL or self.tids == NULL or (adaptive and self.choices == NULL):
            free(self.st); free(self.args); free(self.tids); free(self.choices)
            self.st = NULL
            self.choices = NULL
            raise MemoryError()
        pthread_mutex_init(&self.st.lock, NULL)
        pthread_cond_init(&self.st.go, NULL)
        pthread_cond_init(&self.st.done, NULL)
        self.nworkers = 0
        for k in range(want):
            self.args[self.nworkers + 1].st = self.st
            self.args[self.nworkers + 1].index = self.nworkers + 1
            if pthread_create(&self.tids[self.nworkers + 1], NULL, _pool_worker, &self.args[self.nworkers + 1]) == 0:
                self.nworkers += 1

    @property
    def threads(self) -> int:
        """Threads that share each read (the workers that started, plus the caller)."""
        return self.nworkers + 1

    @property
    def costs(self) -> list:
        """Per thread, ``(mapping, copying)``: seconds per byte that mapping the pages of the
        last timed mapped piece took, and that copying out of the mapping takes (0.0 before
        the first timed mapped piece); empty unless ``adaptive``.  The thread maps while the
        first is under a quarter of the second (see :attr:`sources`)."""
        cdef int k
        if self.choices == NULL:
            return []
        return [(self.choices[k].populate, self.choices[k].copy) for k in range(self.nworkers + 1)]

    @property
    def sources(self) -> list:
        """Per thread, ``(pread, mapping)``: bytes copied with each source over the reader's
        life; empty unless ``adaptive``."""
        cdef int k
        if self.choices == NULL:
            return []
        return [(self.choices[k].nbytes[0], self.choices[k].nbytes[1]) for k in range(self.nworkers + 1)]

    cdef tuple _run(self, int fd, const uint8_t* src, int64_t src_len, _Segs* s, int64_t align, bint keep,
                    uint32_t* digests=NULL):
        """Split ``s`` over the pool and the calling thread, GIL released; the first error.
        With ``digests``, ``digests[i]`` is set to segment ``i``'s CRC-32C."""
        cdef int64_t cursor = 0
        cdef _Part* parts = NULL
        cdef int nparts
        cdef int planned = 0
        cdef Py_ssize_t i
        cdef _PoolState* st = self.st
        if s.total == 0:
            if digests != NULL:
                for i in range(s.n):
                    digests[i] = 0
            return (0, 0, 0)
        if align < 1:
            align = 1
        nparts = _share_count(self.nworkers + 1, s.total, align)
        parts = <_Part*>calloc(nparts, sizeof(_Part))
        if parts == NULL:
            raise MemoryError()
        try:
            with nogil:
                cursor = 0
                _plan_parts(parts, nparts, fd, src, src_len, s, align, self.choices, self.stream, keep, &cursor)
                if digests != NULL:
                    planned = _plan_cells(parts, nparts, s)
            if planned != 0:
                raise MemoryError()
            with nogil:
                pthread_mutex_lock(&st.lock)
                st.parts = parts
                st.nparts = nparts
                st.remaining = nparts - 1
                st.generation += 1
                pthread_cond_broadcast(&st.go)
                pthread_mutex_unlock(&st.lock)
                _read_part(&parts[0])
                pthread_mutex_lock(&st.lock)
                while st.remaining > 0:
                    pthread_cond_wait(&st.done, &st.lock)
                st.parts = NULL
                st.nparts = 0
                pthread_mutex_unlock(&st.lock)
                if digests != NULL:
                    _join_cells(s, parts[0].piece, parts[0].shift, digests)
            return _first_error(parts, nparts)
        finally:
            free(parts)

    cdef int _enter(self) except -1:
        if self.st == NULL:
            raise ValueError("the reader is closed")
        if self.busy:
            raise RuntimeError("one read at a time per SplitReader")
        self.busy = True
        return 0

    def copy(self, int fd, mapping, const int64_t[::1] file_offsets, list targets, int64_t align=65536,
             bint keep=False, uint32_t[::1] digests=None):
        """Fill each of ``targets`` (writable contiguous buffers) with the file's bytes from
        ``file_offsets[i]`` on, the total split evenly over this reader's threads, GIL
        released.

        ``mapping`` is None (each thread ``pread``s its share) or a read-only mapping of the
        whole file (each thread maps its share with ``MADV_POPULATE_READ`` and copies it
        out; a page the file no longer backs is an end-of-file error, never a SIGBUS), or,
        for an ``adaptive`` reader, whichever of the two its pieces measure faster.  With
        ``keep`` (a mapping kept between loads, :mod:`engine.io.kept_mappings`) the pages mapped
        stay mapped, where otherwise each run is unmapped once copied: the next copy of them
        maps nothing, and an ``adaptive`` reader sees that in what mapping them costs and
        takes them from the mapping.
        With ``digests`` (a ``uint32`` array, one per target), ``digests[i]`` is set to the
        CRC-32C of what landed in ``targets[i]``, taken by the thread that copied each block
        right after copying it (copied a block at a time; the checksum reads the block while
        the core holds it: the mapping's lines just read, or what ``pread`` just stored), so
        the bytes come from memory once; the figures are only meaningful when the copy
        succeeded.
        Returns ``(0, 0, 0)`` on success, else ``(errno or -1 for end of file, file offset,
        bytes missing)`` of the failure lowest in the concatenation of the targets.
        """
        cdef _Segs s
        cdef uint32_t* out = NULL
        cdef const uint8_t[::1] src
        cdef const uint8_t* base = NULL
        cdef int64_t length = 0
        self._enter()
        try:
            if mapping is not None:
                src = mapping
                length = src.shape[0]
                base = &src[0] if length else NULL
                if _guard_ready() != 0:
                    raise OSError("cannot install the SIGBUS guard of mapped copies")
            _segs_in_targets(&s, file_offsets, targets)
            try:
                if digests is not None:
                    if digests.shape[0] != s.n:
                        raise ValueError("digests and targets differ in length")
                    out = &digests[0] if s.n else NULL
                if mapping is not None and base == NULL and s.total:
                    return (-1, 0, s.total)  # an empty file maps to nothing
                return self._run(fd, base, length, &s, align, keep and base != NULL, out)
            finally:
                _free_segs(&s)
        finally:
            self.busy = False

    def close(self) -> None:
        """Stop and join the workers (idempotent)."""
        cdef int k
        cdef _PoolState* st = self.st
        if st == NULL:
            return
        with nogil:
            pthread_mutex_lock(&st.lock)
            st.stop = 1
            pthread_cond_broadcast(&st.go)
            pthread_mutex_unlock(&st.lock)
            for k in range(1, self.nworkers + 1):
                pthread_join(self.tids[k], NULL)
        pthread_cond_destroy(&st.go)
        pthread_cond_destroy(&st.done)
        pthread_mutex_destroy(&st.lock)
        free(st); free(self.args); free(self.tids); free(self.choices)
        self.st = NULL
        self.choices = NULL
        self.args = NULL
        self.tids = NULL
        self.nworkers = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __dealloc__(self):
        self.close()

