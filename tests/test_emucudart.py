"""The emulated CUDA runtime's own behaviour where the tests of the device path rely on it
being as strict as a driver and a framework's allocator (tests/emucudart)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from emucudart import Emulator


@pytest.fixture(scope="module")
def emu():
    e = Emulator()
    e.reset()
    return e


def test_a_freed_block_goes_to_the_next_allocation_for_its_stream_at_once(emu):
    emu.reset()
    stream = emu.new_stream()
    try:
        a = emu.pool_empty(5000)
        view = a[100:200]
        where = a.ctypes.data
        del a
        b = emu.pool_empty(5000)  # a view still holds the first block
        assert b.ctypes.data != where and emu.pool_reused() == 0
        del view
        c = emu.pool_empty(4700)  # the same rounded size, the same stream: the freed block
        assert c.ctypes.data == where and emu.pool_reused() == 1
        del c
        d = emu.pool_empty(4700, stream)  # another stream's pool: a block of its own
        assert d.ctypes.data != where and emu.pool_reused() == 1
        del b, d
    finally:
        emu.destroy_stream(stream)


def test_a_queued_read_reads_when_its_stream_runs_it(emu):
    """A block handed out again while a slow operation queued before still reads it: the
    operation reads the new owner's bytes (as on a device, where nothing orders the two)."""
    emu.reset()
    src = emu.pool_empty(4096)
    src[:] = 1
    out = np.zeros(4096, np.uint8)
    emu.launch_copy(0, out, src.ctypes.data, 0.5)
    where = src.ctypes.data
    del src  # freed now (reference counting): back to the pool
    again = emu.pool_empty(4096)
    assert again.ctypes.data == where
    again[:] = 2  # the next owner writes before the queued read has run
    assert emu.synchronize(0) == 0
    assert (out == 2).all()


@pytest.mark.parametrize("late", [False, True])
def test_a_call_during_the_runtimes_teardown_ends_the_process(late):
    """The runtime's library destructor at exit takes ``EMUCUDART_TEARDOWN_MS``; a thread that
    calls an entry point meanwhile ends the process with status 86, as such a call crashes a
    real one; a process whose threads are quiet by then exits as it would."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = f"""
import ctypes, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from emucudart import Emulator
emu = Emulator()
if {late}:  # a native thread: an interpreter's thread ends at its next try to take the GIL
    emu.lib.emu_call_every(ctypes.c_int64(10_000_000))
    time.sleep(0.05)
"""
    env = dict(os.environ, EMUCUDART_TEARDOWN_MS="300")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    if late:
        assert out.returncode == 86 and "during the runtime's teardown" in out.stderr
    else:
        assert out.returncode == 0, out.stderr


def test_work_behind_a_spinning_kernel_waits_for_its_flag(emu):
    emu.reset()
    stream = emu.new_stream()
    try:
        flag = np.zeros(1, np.int32)
        src = np.full(64, 7, np.uint8)
        out = np.zeros(64, np.uint8)
        emu.wait_flag(stream, flag)
        emu.launch_copy(stream, out, src.ctypes.data, 0.0)
        fence = emu.fence(stream, 0)
        try:
            assert emu.lib.cudaEventQuery(ctypes.c_void_p(fence)) == 600  # not ready: held behind the flag
            emu.last_error()
            assert not out.any()
            flag[0] = 1
            assert emu.synchronize(stream) == 0
            assert (out == 7).all()
        finally:
            emu.destroy_event(fence)
    finally:
        emu.destroy_stream(stream)


def test_a_primary_context_release_needs_a_retain(emu):
    emu.reset()
    ctx = ctypes.c_void_p()
    assert emu.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert emu.primary_refs(0) == 1
    assert emu.lib.cuDevicePrimaryCtxRelease_v2(0) == 0
    assert emu.lib.cuDevicePrimaryCtxRelease_v2(0) == 201  # CUDA_ERROR_INVALID_CONTEXT: none left
    assert emu.primary_refs(0) == 0 and emu.bad_releases() == 1
    with emu.on_device(0):  # a framework's guard: retained and released
        assert emu.primary_refs(0) == 1
    assert emu.primary_refs(0) == 0 and emu.bad_releases() == 1


def test_a_synchronous_copy_may_return_before_its_bytes_land(emu):
    """``cudaMemcpy`` from pageable memory returns once the source is staged; the bytes land
    when the legacy default stream gets there (the caller's source may change meanwhile)."""
    emu.reset()
    emu.delay(0.2)
    try:
        src = np.full(4096, 3, np.uint8)
        dst = np.zeros(4096, np.uint8)
        assert emu.lib.cudaMemcpy(ctypes.c_void_p(dst.ctypes.data), ctypes.c_void_p(src.ctypes.data),
                                  ctypes.c_size_t(4096), 1) == 0
        src[:] = 9  # staged already: the copy lands the 3s
        assert not dst.any()
        assert emu.synchronize(0) == 0
        assert (dst == 3).all()
    finally:
        emu.delay(0)


def test_the_drivers_calls_need_a_current_context(emu):
    """The driver route's entry points fail on a thread with no current context
    (CUDA_ERROR_INVALID_CONTEXT), where the runtime's bind the device's primary context."""
    import threading

    emu.reset()
    got: dict = {}

    def fresh() -> None:  # a thread that never made a context current
        ev = ctypes.c_void_p()
        got["driver"] = emu.lib.cuEventCreate(ctypes.byref(ev), 2)
        ctx = ctypes.c_void_p()
        emu.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
        emu.lib.cuCtxSetCurrent(ctx)
        got["with a context"] = emu.lib.cuEventCreate(ctypes.byref(ev), 2)
        got["destroyed"] = emu.lib.cuEventDestroy_v2(ev)
        emu.lib.cuCtxSetCurrent(None)
        emu.lib.cuDevicePrimaryCtxRelease_v2(0)
        got["runtime"] = emu.lib.cudaEventCreateWithFlags(ctypes.byref(ev), 2)  # binds one
        emu.lib.cudaEventDestroy(ev)

    t = threading.Thread(target=fresh)
    t.start()
    t.join()
    assert got == {"driver": 201, "with a context": 0, "destroyed": 0, "runtime": 0}
    text = ctypes.c_char_p()
    assert emu.lib.cuGetErrorString(2, ctypes.byref(text)) == 0 and text.value == b"out of memory"
    assert emu.lib.cuGetErrorString(12345, ctypes.byref(text)) == 1
