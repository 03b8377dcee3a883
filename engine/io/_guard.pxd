# Copies out of a file mapping under the SIGBUS guard (engine/io/_guard.pyx), for the copy
# engine of engine/io/_io.pyx: a page the file no longer backs makes them return -1.
from libc.stdint cimport uint8_t, uint32_t


# what _guarded_crc runs under the guard (crc32c_update)
ctypedef uint32_t (*_crc_fn)(uint32_t, const uint8_t*, size_t) noexcept nogil

cdef int _bus_guard_ready() noexcept nogil
cdef int _guarded_copy(void* dst, const void* src, size_t n, int stream) noexcept nogil
cdef int _guarded_crc(_crc_fn f, uint32_t* crc, const void* src, size_t n) noexcept nogil
