# The copy engine (engine/io/_io.pyx), cimported by the split copies (_split.pyx), the pread
# gathers (_spans.pyx) and the chunk ring's copy threads (engine/gpu/_copy_loop.pyx): pthreads, and a copy of file
# bytes into memory, from pread or a populated mapping, learning per thread which is faster.
from libc.stdint cimport int64_t, uint8_t, uint32_t
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

# bytes a checksummed copy takes at a time, each block's CRC read right after its copy while the
# core still holds it: small enough for an L2 beside the source, large enough that a mapped
# block's populate call costs nothing (_split's copies and the ring's copy threads alike)
cdef enum:
    _DIGEST_BLOCK = 512 << 10


cdef inline double _seconds() noexcept nogil:
    """Monotonic seconds, for the copies' own timings."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    int pthread_create(pthread_t* thread, const void* attr, void* (*start)(void*) noexcept nogil, void* arg)
    int pthread_join(pthread_t thread, void** retval)
    int pthread_mutex_init(pthread_mutex_t* m, const void* attr)
    int pthread_mutex_destroy(pthread_mutex_t* m)
    int pthread_mutex_lock(pthread_mutex_t* m)
    int pthread_mutex_unlock(pthread_mutex_t* m)
    int pthread_cond_init(pthread_cond_t* c, const void* attr)
    int pthread_cond_destroy(pthread_cond_t* c)
    int pthread_cond_wait(pthread_cond_t* c, pthread_mutex_t* m)
    int pthread_cond_timedwait(pthread_cond_t* c, pthread_mutex_t* m, const timespec* t)
    int pthread_cond_broadcast(pthread_cond_t* c)
    int pthread_cond_signal(pthread_cond_t* c)


cdef struct _Choice:
    double populate          # seconds per byte mapping the pages of the last timed mapped piece took
    double copy              # seconds per byte copying out of the mapping (recent pieces)
    int known                # populate and copy hold a figure
    int64_t turns            # timed pieces given to pread since the mapping was last timed
    int64_t every            # pieces between tries of the mapping while pread is chosen
    int64_t nbytes[2]        # bytes copied with each source: [pread, mapping]


cdef struct _Part:
    int fd
    const uint8_t* src       # a file mapping to copy from (MADV_POPULATE_READ, then memcpy), or NULL: pread
    int64_t src_len          # bytes of that mapping
    uint8_t** dst            # dst[i]: where segment i goes
    const int64_t* file_off
    const int64_t* sizes
    const int64_t* starts    # starts[i]: position of segment i in the concatenation
    Py_ssize_t nseg
    int64_t* cursor          # shared by the parts of one copy: the next piece's start; each
    int64_t piece            # thread takes pieces of this size in order until total
    int64_t total
    int64_t errpos           # position in the concatenation of the failure
    int err                  # 0, errno, or -1 for the end of the file
    int64_t at               # file offset of the failure
    int64_t missing          # bytes of the failing segment's share still unread
    _Choice* choice          # with a mapping: where this share's pieces learn which source is
                             # faster (NULL: always the mapping)
    int stream               # copies out of the mapping bypass the caches (engine_stream_copy)
    int64_t shift            # pieces start this many bytes before the cursor's multiples of
                             # piece (see _plan_parts)
    int keep                 # a kept mapping (engine.io.kept_mappings): its pages stay mapped
    int64_t timed            # pieces from this size on are timed (0: _TIMED_BYTES); the ring's
                             # chunks may be smaller than that, and still learn their source
    uint32_t* cells          # NULL, or the CRC-32C of each (segment, piece) cell copied
    int last_mapped          # the last _copy_piece call copied every byte out of the mapping
    const int64_t* cellbase  # cellbase[i]: the cell of segment i's first piece


cdef int _copy_piece(_Part* p, uint8_t* out, int64_t nbytes, int64_t offset) noexcept nogil
cdef uint32_t _crc_landed(_Part* p, const uint8_t* out, int64_t nbytes, int64_t offset, uint32_t crc) noexcept nogil
cdef void _unmap_run(const uint8_t* src, int64_t src_len, int64_t lo, int64_t hi) noexcept nogil
cdef int _guard_ready() noexcept nogil
cdef int _pread_full(int fd, uint8_t* out, int64_t nbytes, int64_t offset, int64_t* at,
                     int64_t* missing) noexcept nogil
