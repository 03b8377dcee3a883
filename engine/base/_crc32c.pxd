# CRC-32C for the copies of engine/io/_io.pyx and _split.pyx: cimport these and
# call them without the GIL (the tables and the hardware choice live in this one module).
from libc.stdint cimport uint32_t, uint8_t, uint64_t


cdef uint32_t crc32c_update(uint32_t crc, const uint8_t* p, size_t n) noexcept nogil
cdef uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) noexcept nogil
