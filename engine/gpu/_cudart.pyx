# cython: language_level=3, embedsignature=True
# distutils: language = c
#
# Bounds/wraparound checks and cdivision are set once in setup.py (ENGINE_CYTHON_CHECKS=1
# turns them on).
"""The CUDA runtime the chunk ring calls, natively: opened by path, its entry points looked up by name.

Private: the public face is :mod:`engine.gpu.cudart`, which finds the runtime's path and opens
each path once; the ring (:mod:`engine.gpu._ring`) cimports :class:`Runtime`'s table of entry
points and :func:`_enter`/:func:`_leave`.

The CUDA runtime is not linked: :class:`Runtime` opens a ``libcudart`` by path (the one torch
already loaded, so the same instance, contexts and streams) and looks its entry points up by
name; the tests pass an emulated runtime with the same ones (``tests/emucudart``).  Where the
process maps no runtime (CuPy links its own in statically), ``Runtime(path, driver=True)`` fills
the same table from the driver (``libcuda.so.1``, one per process, whose contexts, streams and
events every runtime in the process shares): the driver's entry points where their signatures
are the runtime's, small adapters where they are not (:func:`_d_set_device` and the others).

What a driver holds per thread is left as the caller had it.  A thread the engine does not
own (the caller's, a finaliser's) gets the ring's device's primary context pushed around the
ring's calls and popped after (the driver's ``cuCtxPushCurrent`` / ``cuCtxPopCurrent``:
:func:`_enter`, :func:`_leave`, :class:`OnDevice`): its own context, or none, and its runtime
device stay as they were, where ``cudaSetDevice`` would change the device and restoring one
would make a context on GPU 0 for a thread that had none.
"""

from libc.stdint cimport uintptr_t


cdef extern from "<dlfcn.h>" nogil:
    void* dlopen(const char* path, int flags)
    void* dlsym(void* handle, const char* name)
    int dlclose(void* handle)
    char* dlerror()
    int RTLD_NOW
    int RTLD_LOCAL


#: the entry points a ring calls, in the order of _Rt
ENTRY_POINTS = ("cudaSetDevice", "cudaGetDevice", "cudaHostRegister", "cudaHostUnregister",
                "cudaMemcpyAsync", "cudaEventCreateWithFlags", "cudaEventRecord", "cudaEventQuery",
                "cudaEventSynchronize", "cudaEventDestroy", "cudaStreamSynchronize", "cudaGetLastError",
                "cudaGetErrorString", "cudaStreamWaitEvent", "cudaMemcpy", "cudaStreamCreateWithFlags",
                "cudaStreamDestroy")
#: the driver's entry points a ring calls (after ENTRY_POINTS in _Rt): looked up in the runtime's
#: library first (the emulated one has them), else in the driver's, which every CUDA process maps
DRIVER_ENTRY_POINTS = ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2",
                       "cuCtxGetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2")
DRIVER = "libcuda.so.1"
#: the driver's entry points that stand for ENTRY_POINTS on the driver route, in the order of _Drv
DRIVER_ROUTE = ("cuMemHostRegister_v2", "cuMemHostUnregister", "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoD_v2",
                "cuEventCreate", "cuEventRecord", "cuEventQuery", "cuEventSynchronize", "cuEventDestroy_v2",
                "cuStreamCreate", "cuStreamSynchronize", "cuStreamWaitEvent", "cuStreamDestroy_v2",
                "cuGetErrorString", "cuCtxGetDevice", "cuCtxSetCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                "cuDevicePrimaryCtxRelease_v2")

ctypedef int (*_d_copy_async)(unsigned long long, const void*, size_t, void*) noexcept nogil
ctypedef int (*_d_copy)(unsigned long long, const void*, size_t) noexcept nogil
ctypedef int (*_d_errstr)(int, const char**) noexcept nogil

cdef struct _Drv:
    _f_register host_register
    _f_ptr host_unregister
    _d_copy_async copy_async
    _d_copy copy
    _f_event_create event_create
    _f_record event_record
    _f_ptr event_query
    _f_ptr event_synchronize
    _f_ptr event_destroy
    _f_event_create stream_create
    _f_ptr stream_synchronize
    _f_wait stream_wait_event
    _f_ptr stream_destroy
    _d_errstr error_string
    _f_intp ctx_get_device
    _f_ptr ctx_set_current
    _f_device_get device_get
    _f_retain primary_retain
    _f_int primary_release

#: the driver the adapters call: one library per process (the adapters are plain C functions)
cdef _Drv _drv
cdef str _drv_path = None


cdef int _d_set_device(int device) noexcept nogil:
    """cudaSetDevice: the device's primary context current on this thread (called by the
    ring's own threads, while the ring holds a reference to that context)."""
    cdef int dev = 0, rc
    cdef void* ctx = NULL
    rc = _drv.device_get(&dev, device)
    if rc == 0:
        rc = _drv.primary_retain(&ctx, dev)
    if rc != 0:
        return rc
    rc = _drv.ctx_set_current(ctx)
    _drv.primary_release(dev)
    return rc


cdef int _d_get_device(int* device) noexcept nogil:
    return _drv.ctx_get_device(device)


cdef int _d_copy_async_rt(void* dst, const void* src, size_t n, int kind, void* stream) noexcept nogil:
    if kind != _cudaMemcpyHostToDevice:
        return 1  # invalid value: the ring copies host to device only
    return _drv.copy_async(<unsigned long long><uintptr_t>dst, src, n, stream)


cdef int _d_copy_rt(void* dst, const void* src, size_t n, int kind) noexcept nogil:
    if kind != _cudaMemcpyHostToDevice:
        return 1
    return _drv.copy(<unsigned long long><uintptr_t>dst, src, n)


cdef int _d_last_error() noexcept nogil:
    return 0  # the driver returns each error from its call and keeps none


cdef const char* _d_error_string(int code) noexcept nogil:
    cdef const char* s = NULL
    if _drv.error_string(code, &s) != 0:
        return NULL
    return s


cdef int _open_driver(void* lib, str path) except -1:
    """Fill :data:`_drv` from ``lib`` (once per process; the same library again is a no-op)."""
    global _drv, _drv_path
    cdef _Drv table
    cdef void** slots = <void**>&table
    cdef void* fn
    cdef int i
    if _drv_path is not None:
        if _drv_path != path:
            raise OSError(f"the CUDA driver is {_drv_path} in this process, not {path}")
        return 0
    for i, name in enumerate(DRIVER_ROUTE):
        fn = dlsym(lib, (<str>name).encode())
        if fn == NULL:
            raise OSError(f"the CUDA driver {path} has no {name}")
        slots[i] = fn
    _drv = table
    _drv_path = path
    return 0


cdef class Runtime:
    """A CUDA runtime opened by path; its entry points looked up by name.  Opening a library
    the process has already loaded gives that same instance (the same contexts and streams).
    ``driver=True``: ``path`` is the CUDA driver, which stands for the runtime (module doc)."""

    def __cinit__(self, str path, bint driver=False):
        cdef bytes raw = path.encode()
        cdef void** slots = <void**>&self.rt
        cdef int i, n = len(ENTRY_POINTS)
        cdef void* fn
        self.path = path
        self.driver_route = driver
        self.handle = dlopen(raw, RTLD_NOW | RTLD_LOCAL)
        if self.handle == NULL:
            err = dlerror()
            what = "driver" if driver else "runtime"
            raise OSError(f"cannot open the CUDA {what} {path}: {err.decode() if err != NULL else 'unknown'}")
        if driver:
            try:
                _open_driver(self.handle, path)
            except OSError:
                self._close()
                raise
            self.rt.set_device = _d_set_device
            self.rt.get_device = _d_get_device
            self.rt.host_register = _drv.host_register
            self.rt.host_unregister = _drv.host_unregister
            self.rt.memcpy_async = _d_copy_async_rt
            self.rt.event_create = _drv.event_create
            self.rt.event_record = _drv.event_record
            self.rt.event_query = _drv.event_query
            self.rt.event_synchronize = _drv.event_synchronize
            self.rt.event_destroy = _drv.event_destroy
            self.rt.stream_synchronize = _drv.stream_synchronize
            self.rt.get_last_error = _d_last_error
            self.rt.error_string = _d_error_string
            self.rt.stream_wait_event = _drv.stream_wait_event
            self.rt.memcpy_sync = _d_copy_rt
            self.rt.stream_create = _drv.stream_create
            self.rt.stream_destroy = _drv.stream_destroy
        else:
            for i, name in enumerate(ENTRY_POINTS):
                fn = dlsym(self.handle, (<str>name).encode())
                if fn == NULL:
                    self._close()
                    raise OSError(f"the CUDA runtime {path} has no {name}")
                slots[i] = fn
        lib = self.handle
        if dlsym(lib, b"cuCtxPushCurrent_v2") == NULL:
            self.driver = dlopen((<str>DRIVER).encode(), RTLD_NOW | RTLD_LOCAL)
            if self.driver == NULL:
                err = dlerror()
                self._close()
                raise OSError(f"cannot open the CUDA driver {DRIVER}: {err.decode() if err != NULL else 'unknown'}")
            lib = self.driver
        for i, name in enumerate(DRIVER_ENTRY_POINTS):
            fn = dlsym(lib, (<str>name).encode())
            if fn == NULL:
                self._close()
                raise OSError(f"the CUDA driver has no {name}")
            slots[n + i] = fn
        self.rt.driver_init(0)  # initialised already where a framework loaded CUDA; cheap then

    def primary_context(self, int device) -> int:
        """Retain ``device``'s primary context (made if need be, not made current); its
        handle.  Released by :meth:`release_primary`."""
        cdef void* ctx = NULL
        cdef int dev = 0, rc
        with nogil:
            rc = self.rt.device_get(&dev, device)
            if rc == 0:
                rc = self.rt.primary_retain(&ctx, dev)
        if rc != 0:
            raise RuntimeError(f"cannot retain the primary context of device {device} (CUDA driver error {rc})")
        return <uintptr_t>ctx

    def release_primary(self, int device) -> None:
        cdef int dev = 0
        with nogil:
            if self.rt.device_get(&dev, device) == 0:
                self.rt.primary_release(dev)

    cdef void _close(self):
        if self.handle != NULL:
            dlclose(self.handle)
            self.handle = NULL
        if self.driver != NULL:
            dlclose(self.driver)
            self.driver = NULL

    def wait_event(self, uintptr_t stream, uintptr_t event) -> None:
        """``cudaStreamWaitEvent``: work queued on ``stream`` after this waits for ``event``'s
        last record, on the calling thread's current context (:class:`OnDevice`).  Raises
        RuntimeError naming the runtime's error."""
        cdef int rc
        with nogil:
            rc = self.rt.stream_wait_event(<void*>stream, <void*>event, 0)
            if rc != 0:
                self.rt.get_last_error()
        if rc != 0:
            raise RuntimeError(f"cudaStreamWaitEvent failed: {self.error_string(rc)} ({rc})")

    def error_string(self, int code) -> str:
        """The runtime's description of an error code."""
        cdef const char* s = self.rt.error_string(code)
        return s.decode(errors="replace") if s != NULL else f"CUDA error {code}"


cdef int _enter(_Rt* rt, void* ctx, _Saved* saved) noexcept nogil:
    """Make the primary context ``ctx`` current on this thread for the ring's calls: nothing
    where it is current already, else pushed (the thread's own context, or none, and its
    runtime device are untouched).  0 or the driver's error."""
    cdef void* cur = NULL
    cdef int rc
    saved.pushed = 0
    if rt.ctx_get_current(&cur) == 0 and cur == ctx:
        return 0
    rc = rt.ctx_push(ctx)
    saved.pushed = rc == 0
    return rc


cdef void _leave(_Rt* rt, _Saved* saved) noexcept nogil:
    """Pop what :func:`_enter` pushed: the thread is as it was."""
    cdef void* popped = NULL
    if saved.pushed:
        rt.ctx_pop(&popped)
        saved.pushed = 0


cdef class OnDevice:
    """``with OnDevice(runtime, device):`` the device's primary context current on this thread
    for the block, the thread as it was after (a framework's stream made for a ring on a
    thread of the engine's: no context on GPU 0, the thread's device untouched)."""

    cdef Runtime runtime
    cdef int device
    cdef void* ctx
    cdef _Saved saved

    def __cinit__(self, Runtime runtime, int device):
        self.runtime = runtime
        self.device = device

    def __enter__(self):
        cdef int rc
        self.ctx = <void*><uintptr_t>self.runtime.primary_context(self.device)
        with nogil:
            rc = _enter(&self.runtime.rt, self.ctx, &self.saved)
        if rc != 0:
            self.runtime.release_primary(self.device)
            raise RuntimeError(f"cannot make device {self.device} current (CUDA driver error {rc})")
        return self

    def __exit__(self, *exc):
        with nogil:
            _leave(&self.runtime.rt, &self.saved)
        self.runtime.release_primary(self.device)
