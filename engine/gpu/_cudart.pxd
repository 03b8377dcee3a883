# Declarations shared with the chunk ring (engine/gpu/_ring.pyx, engine/gpu/_copy_loop.pyx): the
# CUDA runtime's and driver's entry points, looked up by name, and a device's primary context
# pushed around a thread's calls.

ctypedef int (*_f_int)(int) noexcept nogil
ctypedef int (*_f_intp)(int*) noexcept nogil
ctypedef int (*_f_register)(void*, size_t, unsigned int) noexcept nogil
ctypedef int (*_f_ptr)(void*) noexcept nogil
ctypedef int (*_f_memcpy)(void*, const void*, size_t, int, void*) noexcept nogil
ctypedef int (*_f_event_create)(void**, unsigned int) noexcept nogil
ctypedef int (*_f_record)(void*, void*) noexcept nogil
ctypedef int (*_f_void)() noexcept nogil
ctypedef const char* (*_f_errstr)(int) noexcept nogil
ctypedef int (*_f_wait)(void*, void*, unsigned int) noexcept nogil
ctypedef int (*_f_memcpy_sync)(void*, const void*, size_t, int) noexcept nogil
ctypedef int (*_f_ctx_get)(void**) noexcept nogil
ctypedef int (*_f_init)(unsigned int) noexcept nogil
ctypedef int (*_f_device_get)(int*, int) noexcept nogil
ctypedef int (*_f_retain)(void**, int) noexcept nogil

cdef struct _Rt:
    _f_int set_device
    _f_intp get_device
    _f_register host_register
    _f_ptr host_unregister
    _f_memcpy memcpy_async
    _f_event_create event_create
    _f_record event_record
    _f_ptr event_query
    _f_ptr event_synchronize
    _f_ptr event_destroy
    _f_ptr stream_synchronize
    _f_void get_last_error
    _f_errstr error_string
    _f_wait stream_wait_event
    _f_memcpy_sync memcpy_sync
    _f_event_create stream_create
    _f_ptr stream_destroy
    # the driver's (libcuda's): a device's primary context, pushed on a thread and popped
    _f_init driver_init
    _f_device_get device_get
    _f_retain primary_retain
    _f_int primary_release
    _f_ctx_get ctx_get_current
    _f_ptr ctx_push
    _f_ctx_get ctx_pop

cdef enum:
    _cudaErrorNotReady = 600
    _cudaMemcpyHostToDevice = 1
    _cudaHostRegisterPortable = 1
    _cudaEventDisableTiming = 2
    _cudaStreamNonBlocking = 1


cdef class Runtime:
    cdef void* handle
    cdef void* driver
    cdef _Rt rt
    cdef readonly str path
    cdef readonly bint driver_route

    cdef void _close(self)


cdef struct _Saved:
    int pushed      # ``ctx`` was pushed: pop it after


cdef int _enter(_Rt* rt, void* ctx, _Saved* saved) noexcept nogil
cdef void _leave(_Rt* rt, _Saved* saved) noexcept nogil
