# Declarations shared by the chunk ring's copy loop (engine/gpu/_copy_loop.pyx) and the ring
# itself (engine/gpu/_ring.pyx): a ring's state as its threads see it, and the loop's steps.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from posix.time cimport timespec

from engine.gpu._cudart cimport _Rt
from engine.io._io cimport _Choice, _Part, pthread_cond_t, pthread_mutex_t


cdef extern from *:
    """
    #include <time.h>
    static inline int64_t engine_ring_take(int64_t *counter) {
        return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
    }
    static inline int64_t engine_ring_take_n(int64_t *counter, int64_t n) {
        return __atomic_fetch_add(counter, n, __ATOMIC_RELAXED);
    }
    static inline int engine_ring_stopped(int *flag) {
        return __atomic_load_n(flag, __ATOMIC_ACQUIRE);
    }
    static inline void engine_ring_stop(int *flag) {
        __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
    }
    /* an absolute CLOCK_REALTIME deadline ns from now, for pthread_cond_timedwait */
    static inline void engine_ring_deadline(struct timespec *ts, long ns) {
        clock_gettime(CLOCK_REALTIME, ts);
        ts->tv_nsec += ns;
        while (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
    }
    """
    int64_t _take "engine_ring_take"(int64_t* counter) noexcept nogil
    int64_t _take_n "engine_ring_take_n"(int64_t* counter, int64_t n) noexcept nogil
    int _stopped "engine_ring_stopped"(int* flag) noexcept nogil
    void _stop "engine_ring_stop"(int* flag) noexcept nogil
    void _deadline "engine_ring_deadline"(timespec* ts, long ns) noexcept nogil


# error kinds in the tuple a run returns
cdef enum:
    _ERR_NONE = 0
    _ERR_READ = 1      # code: errno or -1 for the end of the file; at, missing: where
    _ERR_CUDA = 2      # code: the runtime's error; at: the chunk
    _ERR_ALLOC = 3     # code: errno of mmap
    _ERR_FILL = 5      # an external filler failed chunk ``chunk`` (it holds its own error)

cdef struct _Plan:
    int64_t nchunks
    const int32_t* c_file      # chunk -> file index
    const int64_t* c_seg       # chunk k's segments are c_seg[k] .. c_seg[k + 1]
    const int64_t* s_pos       # segment -> position in its chunk
    const int64_t* s_off       # segment -> file offset
    const int64_t* s_len
    const uint64_t* s_dst      # segment -> device address
    const int32_t* fds
    const uint64_t* maps       # file -> address of its read-only mapping, or 0: pread
    const int64_t* map_lens
    const uint8_t* keeps       # file -> its mapping is kept between loads: leave its pages mapped
    # checksums (cells NULL: none): the load's pieces sorted by file and offset (d_off, d_len;
    # file f's are d_first[f] .. d_first[f + 1]); the CRC of piece i's part in the file's
    # chunk_bytes-aligned block b goes to cells[d_cell[i] + b - d_off[i] // chunk_bytes]
    const int64_t* d_off
    const int64_t* d_len
    const int64_t* d_first
    const int64_t* d_cell
    uint32_t* cells


cdef struct _State:
    _Rt* rt
    int device
    void* stream
    int64_t chunk_bytes
    int nslots
    uint8_t* base              # nslots * chunk_bytes of host memory
    uint8_t* blocks            # per block of slots (see _block_of): 0 pageable, 1 being
                               # page-locked, 2 page-locked, 3 refused
    int nblocks
    int locked_refused         # a registration was refused: the chunks stay pageable
    void** events
    int64_t* filled            # per slot: the chunk it holds, filled (-1: none yet)
    _Plan plan
    pthread_mutex_t lock
    pthread_cond_t filled_cond # a chunk filled (the issuing thread waits)
    pthread_cond_t issued_cond # a chunk issued, or the run stops (copy threads wait)
    pthread_cond_t run_cond    # a new run, a worker out of it, the ring closing
    pthread_cond_t lock_cond   # a block's page-locking ended
    int seats                  # workers the current run still takes (small runs wake fewer)
    int64_t next_chunk         # the next chunk a copy thread takes
    int64_t issued             # chunks whose copies are issued, in order
    int generation             # bumped per run: wakes the workers
    int active                 # workers still in the current run
    int stop                   # the ring closes: workers exit
    int cancel                 # the run stops (an error, or the caller's cancel)
    int err_kind
    int err_code
    int64_t err_chunk
    int64_t err_at
    int64_t err_missing
    double wait_slot           # seconds copy threads waited for a slot's copy (summed)
    double wait_fill           # seconds the issuing thread waited for a chunk to fill
    double lock_s              # seconds spent page-locking blocks (this run, or lock_all)
    int lock_calls             # cudaHostRegister calls made (the same)
    double* fill_s             # per worker (and the issuing thread, last): seconds filling
    int adaptive               # threads learn pread or the mapping (else a mapping is always used)
    int stream_stores          # copies out of a mapping store past the caches
    _Choice* choices
    void* ctx                  # the device's primary context (retained by the ring)
    int external               # the run's chunks are filled by callers' threads (take/filled)
    int64_t net_bytes          # bytes external fillers filled (over the ring's life)


cdef struct _Worker:
    _State* st
    int index


cdef inline int _block_lo(int b) noexcept nogil:
    return 0 if b == 0 else 1 << (b - 1)


cdef inline int _block_hi(int b, int nslots) noexcept nogil:
    cdef int hi = 1 << b
    return hi if hi < nslots else nslots


cdef int _block_of(int s) noexcept nogil
cdef void _lock_block(_State* st, int b) noexcept nogil
cdef void _fail(_State* st, int kind, int code, int64_t chunk, int64_t at, int64_t missing) noexcept nogil
cdef void _digest_filled(_State* st, int64_t k) noexcept nogil
cdef int _fill(_State* st, _Part* part, int64_t k, uint8_t* out, _Choice* tally) noexcept nogil
cdef void _part_for(_State* st, _Part* part, int index) noexcept nogil
cdef int _claim(_State* st, int64_t k) noexcept nogil
cdef void* _worker_main(void* arg) noexcept nogil
cdef void _issue(_State* st, int64_t n, object poll, double poll_seconds, list raised) noexcept nogil
