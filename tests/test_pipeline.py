"""The threaded pipeline on CPU: threads, the staging ring, completion, errors, cancellation.

Device destinations are exercised with an emulated asynchronous device whose copies run
later on a per-stream thread and read the staging slot only then: a ring that reused a slot
before its copy finished would corrupt the data, and these tests would see it.
"""

from __future__ import annotations

import errno
import os
import queue
import random
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import pipeline
from engine.errors import ReadError
from engine.plan import plan_reads
from engine.reader import pread_into


class _Stream:
    def __init__(self, delay: float) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.delay = delay
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.q.get()) is not None:
            job()

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()


class EmulatedDevice:
    """DeviceOps whose copies are asynchronous, like cudaMemcpyAsync on a stream."""

    def __init__(self, delay: float = 0.0005) -> None:
        self.delay = delay
        self.streams: list[_Stream] = []
        self.staging_bytes = 0
        self.lock = threading.Lock()

    def bind_thread(self) -> None:
        pass

    def alloc_staging(self, nbytes):
        buf = bytearray(nbytes)
        with self.lock:
            self.staging_bytes += nbytes
        return buf, memoryview(buf)

    def new_stream(self):
        s = _Stream(self.delay)
        with self.lock:
            self.streams.append(s)
        return s

    def copy_to_device(self, dst, dst_offset, src, src_offset, nbytes, stream) -> None:
        def job():
            time.sleep(random.random() * stream.delay)
            dst[dst_offset : dst_offset + nbytes] = src[src_offset : src_offset + nbytes]

        stream.q.put(job)

    def record(self, stream):
        event = threading.Event()
        stream.q.put(event.set)
        return event

    def wait(self, event) -> None:
        event.wait()

    def close(self) -> None:
        for s in self.streams:
            s.close()


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """A file of 40 'tensors' of random sizes (some empty) after a 64-byte 'header'."""
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 300_000, 40)
    sizes[[3, 17]] = 0
    ends = np.cumsum(sizes)
    begins = ends - sizes
    data = rng.integers(0, 256, int(ends[-1]) + 64, dtype=np.uint8)
    path = tmp_path_factory.mktemp("pipe") / "f.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    yield fd, str(path), begins, ends, data
    os.close(fd)


def _expected(data, begins, ends, row):
    return data[64 + begins[row] : 64 + ends[row]].tobytes()


@settings(max_examples=25, deadline=None)
@given(
    rows=st.lists(st.integers(0, 39), unique=True),
    threads=st.sampled_from([1, 2, 3, 8]),
    chunk=st.sampled_from([4096, 65_536, 1 << 20]),
    device=st.booleans(),
    slots=st.sampled_from([1, 2, 3]),
)
def test_every_selected_byte_lands_and_every_tensor_completes_once(layout, rows, threads, chunk, device, slots):
    fd, path, begins, ends, data = layout
    rows = sorted(rows, key=lambda r: begins[r])
    dst = {r: bytearray(int(ends[r] - begins[r])) for r in rows}
    completed = []
    requests = plan_reads(begins, ends, rows, 64, chunk)
    emu = EmulatedDevice() if device else None
    if device:
        dest = pipeline.Destination(device_targets=dst, device_ops=emu)
    else:
        dest = pipeline.Destination(host_views={r: memoryview(b) for r, b in dst.items() if len(b)})
    try:
        n = pipeline.run(fd, requests, dest, path=path, threads=threads, slots=slots, chunk_bytes=chunk,
                         on_complete=completed.append)
    finally:
        if emu:
            emu.close()
    nonempty = [r for r in rows if ends[r] > begins[r]]
    assert n == sum(int(ends[r] - begins[r]) for r in rows)
    assert sorted(completed) == sorted(nonempty)  # once each, and only when complete
    for r in rows:
        assert bytes(dst[r]) == _expected(data, begins, ends, r), r
    if device:  # staging is bounded by threads * slots * chunk, whatever the model size
        assert emu.staging_bytes <= max(1, min(threads, len(requests))) * slots * chunk


@pytest.mark.parametrize("device", [False, True])
def test_fill_hook_replaces_the_read_and_sees_one_target_per_piece(layout, device):
    fd, path, begins, ends, data = layout
    rows = [r for r in range(40) if ends[r] > begins[r]]
    dst = {r: bytearray(int(ends[r] - begins[r])) for r in rows}
    requests = plan_reads(begins, ends, rows, 64, 65_536)
    seen = []
    lock = threading.Lock()

    def fill(fd_, req, targets):
        assert len(targets) == len(req.pieces)
        pread_into(fd_, req.offset, targets, path=path)
        with lock:  # what the hook saw is what a plain read would have landed
            seen.extend((p.row, p.tensor_offset, bytes(t)) for p, t in zip(req.pieces, targets, strict=True))

    emu = EmulatedDevice() if device else None
    if device:
        dest = pipeline.Destination(device_targets=dst, device_ops=emu)
    else:
        dest = pipeline.Destination(host_views={r: memoryview(b) for r, b in dst.items()})
    try:
        pipeline.run(fd, requests, dest, path=path, threads=3, chunk_bytes=65_536, fill=fill)
    finally:
        if emu:
            emu.close()
    for r in rows:
        assert bytes(dst[r]) == _expected(data, begins, ends, r), r
        parts = sorted((off, b) for row, off, b in seen if row == r)
        assert b"".join(b for _, b in parts) == _expected(data, begins, ends, r), r


def test_completion_is_reported_only_after_the_device_copy(layout):
    fd, path, begins, ends, data = layout
    rows = list(range(40))
    dst = {r: bytearray(int(ends[r] - begins[r])) for r in rows}
    emu = EmulatedDevice(delay=0.002)
    seen_complete_and_correct = []

    def check(row):
        seen_complete_and_correct.append(bytes(dst[row]) == _expected(data, begins, ends, row))

    try:
        pipeline.run(fd, plan_reads(begins, ends, rows, 64, 65_536),
                     pipeline.Destination(device_targets=dst, device_ops=emu),
                     path=path, threads=2, slots=2, chunk_bytes=65_536, on_complete=check)
    finally:
        emu.close()
    assert seen_complete_and_correct and all(seen_complete_and_correct)


def test_worker_error_reaches_caller_and_threads_end(layout, monkeypatch):
    fd, path, begins, ends, _ = layout
    real = os.preadv

    def flaky(fd_, buffers, offset):
        if offset > 2_000_000:
            raise OSError(errno.EIO, "disk on fire")
        return real(fd_, buffers, offset)

    monkeypatch.setattr(os, "preadv", flaky)
    before = threading.active_count()
    rows = list(range(40))
    dst = {r: memoryview(bytearray(int(ends[r] - begins[r]))) for r in rows if ends[r] > begins[r]}
    with pytest.raises(ReadError, match="disk on fire") as info:
        pipeline.run(fd, plan_reads(begins, ends, rows, 64, 65_536), pipeline.Destination(host_views=dst),
                     path=path, threads=4, chunk_bytes=65_536)
    assert info.value.offset > 2_000_000 and path in str(info.value)
    assert threading.active_count() == before


def test_device_error_drains_copies_before_releasing_slots(layout, monkeypatch):
    fd, path, begins, ends, _ = layout
    real = os.preadv
    calls = [0]

    def flaky(fd_, buffers, offset):
        calls[0] += 1
        if calls[0] == 5:
            raise OSError(errno.EIO, "boom")
        return real(fd_, buffers, offset)

    monkeypatch.setattr(os, "preadv", flaky)
    rows = list(range(40))
    dst = {r: bytearray(int(ends[r] - begins[r])) for r in rows}
    emu = EmulatedDevice()
    pending = []
    orig_wait = emu.wait
    emu.wait = lambda ev: (pending.append(ev), orig_wait(ev))
    try:
        with pytest.raises(ReadError):
            pipeline.run(fd, plan_reads(begins, ends, rows, 64, 65_536),
                         pipeline.Destination(device_targets=dst, device_ops=emu),
                         path=path, threads=2, chunk_bytes=65_536)
        # every recorded event was waited on before run() returned
        assert all(ev.is_set() for ev in pending)
    finally:
        emu.close()


def test_cancel_stops_the_workers(layout):
    fd, path, begins, ends, _ = layout
    rows = list(range(40))
    dst = {r: memoryview(bytearray(int(ends[r] - begins[r]))) for r in rows if ends[r] > begins[r]}
    cancel = threading.Event()
    done = []

    def on_complete(row):
        done.append(row)
        if len(done) == 3:
            cancel.set()

    with pytest.raises(pipeline.Cancelled):
        pipeline.run(fd, plan_reads(begins, ends, rows, 64, 4096), pipeline.Destination(host_views=dst),
                     path=path, threads=2, chunk_bytes=4096, on_complete=on_complete, cancel=cancel)
    assert len(done) < 38


def test_destination_arguments():
    with pytest.raises(ValueError):
        pipeline.Destination()
    with pytest.raises(ValueError):
        pipeline.Destination(device_targets={})
