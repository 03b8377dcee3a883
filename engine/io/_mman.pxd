# The page-table calls and advice numbers of the native I/O modules (engine/io/_io.pyx,
# engine/io/_pages.pyx): declarations only, no module of their own.
cdef extern from "<sys/mman.h>" nogil:
    int mincore(void* addr, size_t length, unsigned char* vec)
    int madvise(void* addr, size_t length, int advice)
    int MADV_WILLNEED

cdef extern from "<unistd.h>" nogil:
    long sysconf(int name)
    enum: _SC_PAGESIZE

# Linux 5.14+; the headers of older C libraries may lack the name, the number is the ABI's
cdef enum:
    _MADV_POPULATE_READ = 22
    _MADV_POPULATE_WRITE = 23
    _MADV_DONTNEED = 4
