"""The threaded pipeline on CPU: threads, the chunk ring, completion, errors, cancellation.

Device destinations are exercised through the native chunk ring over the emulated CUDA
runtime (tests/emucudart), whose copies run later on a stream thread and read their chunk
only then: a ring that reused a chunk before its copy finished would corrupt the data, and
these tests would see it (the ring's own tests: test_device_ring.py).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time

import numpy as np
import pytest
from conftest import SplitCopies
from emucudart import EmulatedRingOps, Emulator
from gil import ticks_during
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import DeviceError, ReadError
from engine.gpu import rings
from engine.gpu.geometry import cores, geometry_for
from engine.io.reader import pread_into
from engine.loading import pipeline
from engine.planning.plan import plan_reads


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


_EMULATOR: list[Emulator] = []


class RingDevice(EmulatedRingOps):
    """The ring's device operations over the emulated runtime, reset for each load, with
    the checks that nothing is left behind."""

    def __init__(self) -> None:
        if not _EMULATOR:
            _EMULATOR.append(Emulator())
        _EMULATOR[0].reset()
        super().__init__(_EMULATOR[0])

    def close(self) -> None:
        rings.release_rings()  # a ring lingers briefly after a load: closed now
        super().close()

    def assert_clean(self) -> None:
        self.emulator.assert_clean()


def _expected(data, begins, ends, row):
    return data[64 + begins[row] : 64 + ends[row]].tobytes()


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.integers(0, 39), unique=True),
    threads=st.sampled_from([1, 2, 3, 8]),
    chunk=st.sampled_from([4096, 65_536, 1 << 20]),
    device=st.booleans(),
    slot_bytes=st.sampled_from([5000, 65_536, 1 << 20, 1 << 24]),
    gpu_path=st.sampled_from(["auto", "copy"]),
)
def test_every_selected_byte_lands_and_every_tensor_completes_once(
    layout, rows, threads, chunk, device, slot_bytes, gpu_path
):
    fd, path, begins, ends, data = layout
    rows = sorted(rows, key=lambda r: begins[r])
    dst = {r: bytearray(int(ends[r] - begins[r])) for r in rows}
    completed = []
    requests = plan_reads(begins, ends, rows, 64, chunk)
    emu = RingDevice() if device else None
    if device:
        dest = pipeline.Destination(device_targets=dst, device_ops=emu)
    else:
        dest = pipeline.Destination(host_views={r: memoryview(b) for r, b in dst.items() if len(b)})
    try:
        n = pipeline.run(fd, requests, dest, path=path, threads=threads, slot_bytes=slot_bytes,
                         gpu_path=gpu_path, on_complete=completed.append)
    finally:
        if emu:
            emu.close()
    nonempty = [r for r in rows if ends[r] > begins[r]]
    assert n == sum(int(ends[r] - begins[r]) for r in rows)
    assert sorted(completed) == sorted(nonempty)  # once each, and only when complete
    for r in rows:
        assert bytes(dst[r]) == _expected(data, begins, ends, r), r
    if device:
        emu.assert_clean()
        assert (emu.emulator.stats()["copies"] > 0) == (n > 0)  # through the ring's DMAs


def test_fill_hook_replaces_the_read_and_sees_one_target_per_piece(layout):
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

    pipeline.run(fd, requests, pipeline.Destination(host_views={r: memoryview(b) for r, b in dst.items()}),
                 path=path, threads=3, fill=fill)
    for r in rows:
        assert bytes(dst[r]) == _expected(data, begins, ends, r), r
        parts = sorted((off, b) for row, off, b in seen if row == r)
        assert b"".join(b for _, b in parts) == _expected(data, begins, ends, r), r


def test_completion_is_reported_only_after_the_device_copy(layout):
    fd, path, begins, ends, data = layout
    rows = list(range(40))
    dst = {r: bytearray(int(ends[r] - begins[r])) for r in rows}
    emu = RingDevice()
    emu.emulator.delay(0.002)  # each copy lands late: a tensor reported early shows stale bytes
    seen_complete_and_correct = []

    def check(row):
        seen_complete_and_correct.append(bytes(dst[row]) == _expected(data, begins, ends, row))

    try:
        pipeline.run(fd, plan_reads(begins, ends, rows, 64, 65_536),
                     pipeline.Destination(device_targets=dst, device_ops=emu),
                     path=path, threads=2, slot_bytes=65_536, on_complete=check)
    finally:
        emu.close()
        emu.emulator.delay(0)
    assert seen_complete_and_correct and all(seen_complete_and_correct)


def test_worker_error_reaches_caller_and_threads_end(layout, monkeypatch):
    fd, path, begins, ends, _ = layout
    monkeypatch.setattr(pipeline, "HOST_BATCH_BYTES", 65_536)

    def failing(call, fd_, offsets, targets):
        if offsets[0] > 2_000_000:  # a disk error surfaces as the native copy's errno
            raise ReadError("reading failed: disk on fire", reason="IoError", path=path, offset=int(offsets[0]))

    SplitCopies(monkeypatch, before=failing)
    before = threading.active_count()
    rows = list(range(40))
    dst = {r: memoryview(bytearray(int(ends[r] - begins[r]))) for r in rows if ends[r] > begins[r]}
    with pytest.raises(ReadError, match="disk on fire") as info:
        pipeline.run(fd, plan_reads(begins, ends, rows, 64, 65_536), pipeline.Destination(host_views=dst),
                     path=path, threads=4)
    assert info.value.offset > 2_000_000 and path in str(info.value)
    assert threading.active_count() == before


@pytest.mark.parametrize("source", ["mmap", "pread", "auto"])
def test_host_copy_errors_name_the_file_and_offset(layout, monkeypatch, source):
    # the native copy's own error: a plan that reaches past the end of the file, named where
    # the file ends whichever source the copy takes
    fd, path, begins, ends, _ = layout
    monkeypatch.setenv("ENGINE_COPY_SOURCE", source)
    size = os.fstat(fd).st_size
    rows = list(range(40))
    dst = {r: memoryview(bytearray(int(ends[r] - begins[r]))) for r in rows if ends[r] > begins[r]}
    with pytest.raises(ReadError) as info:
        pipeline.run(fd, plan_reads(begins, ends, rows, size - 1000, 65_536), pipeline.Destination(host_views=dst),
                     path=path, threads=2)
    assert info.value.reason == "ShortRead" and path in str(info.value)
    assert info.value.offset == size and info.value.size > 0


def test_cancel_stops_the_workers(layout, monkeypatch):
    fd, path, begins, ends, _ = layout
    monkeypatch.setattr(pipeline, "HOST_BATCH_BYTES", 4096)
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
                     path=path, threads=2, on_complete=on_complete, cancel=cancel)
    assert len(done) < 38


def test_destination_arguments():
    with pytest.raises(ValueError):
        pipeline.Destination()
    with pytest.raises(ValueError):
        pipeline.Destination(device_targets={})


# -- device loads through the pipeline (the ring itself: test_device_ring.py) --------------------------


def _device_load(layout, emu, *, rows=None, slot_bytes=65_536, **kw):
    fd, path, begins, ends, data = layout
    rows = list(range(40)) if rows is None else rows
    dst = {r: bytearray(int(ends[r] - begins[r])) for r in rows}
    try:
        pipeline.run(fd, plan_reads(begins, ends, rows, 64, 1 << 20),
                     pipeline.Destination(device_targets=dst, device_ops=emu),
                     path=path, slot_bytes=slot_bytes, **kw)
    finally:
        emu.close()
    for r in rows:
        assert bytes(dst[r]) == _expected(data, begins, ends, r), r
    return dst


def test_a_device_load_copies_every_byte_through_the_ring(layout):
    emu = RingDevice()
    _device_load(layout, emu)
    emu.assert_clean()
    assert emu.emulator.stats()["copies"] > 0


def test_device_operations_without_the_rings_entry_points_are_a_device_error(layout):
    """The ring is the one device path: operations it cannot drive fail the load, naming what
    they lack, before anything is read."""

    class NoRing:
        def address(self, target):
            return 0

    fd, path, begins, ends, _ = layout
    dst = {r: bytearray(int(ends[r] - begins[r])) for r in range(40)}
    with pytest.raises(DeviceError, match="cannot drive the chunk ring.*runtime_path") as info:
        pipeline.run(fd, plan_reads(begins, ends, range(40), 64, 1 << 20),
                     pipeline.Destination(device_targets=dst, device_ops=NoRing()), path=path)
    assert info.value.path == path
    assert not any(any(b) for b in dst.values())


def test_a_device_load_takes_no_fill_hook(layout):
    fd, path, begins, ends, _ = layout
    emu = RingDevice()
    dst = {r: bytearray(int(ends[r] - begins[r])) for r in range(40)}
    try:
        with pytest.raises(ValueError, match="no fill hook"):
            pipeline.run(fd, plan_reads(begins, ends, range(40), 64, 1 << 20),
                         pipeline.Destination(device_targets=dst, device_ops=emu), path=path,
                         fill=lambda *a: None)
    finally:
        emu.close()
    assert emu.emulator.stats()["copies"] == 0


def test_gpu_path_is_checked(layout):
    with pytest.raises(ValueError, match="gpu_path"):
        _device_load(layout, RingDevice(), gpu_path="fast")
    # page-locking the file's own mapping was removed, with the reason
    with pytest.raises(ValueError, match="removed.*slower"):
        _device_load(layout, RingDevice(), gpu_path="register")


@pytest.fixture
def copy_of_layout(layout, tmp_path):
    """A private copy of the layout's file (the tests truncate it)."""
    _, _, begins, ends, data = layout
    path = tmp_path / "g.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDWR)
    yield fd, str(path), begins, ends, data
    os.close(fd)


# a file truncated under a device load: test_device_ring.py


def test_a_file_shorter_than_its_plan_is_a_read_error_at_its_end(copy_of_layout):
    fd, path, begins, ends, data = copy_of_layout
    os.ftruncate(fd, len(data) - 100_000)
    emu = RingDevice()
    dst = {r: bytearray(int(ends[r] - begins[r])) for r in range(40)}
    with pytest.raises(ReadError) as info:
        try:
            pipeline.run(fd, plan_reads(begins, ends, range(40), 64, 1 << 20),
                         pipeline.Destination(device_targets=dst, device_ops=emu), path=path,
                         slot_bytes=65_536)
        finally:
            emu.close()
    assert info.value.offset == len(data) - 100_000
    emu.assert_clean()


def _os_threads(until: int = 1 << 30) -> int:
    """Threads of this process, native ones included; waits up to 2 s for the count to come
    down to ``until`` (a joined Python thread may take a moment to leave the kernel's list)."""
    deadline = time.monotonic() + 2.0
    while True:
        n = len(os.listdir("/proc/self/task"))
        if n <= until or time.monotonic() > deadline:
            return n
        time.sleep(0.01)


@pytest.mark.parametrize("gpu_path", ["auto", "copy"])
def test_cancel_of_a_device_load_frees_everything(layout, gpu_path):
    fd, path, begins, ends, _ = layout
    before = _os_threads()
    emu = RingDevice()
    emu.emulator.delay(0.002)  # copies land slowly: the cancel comes mid-load
    cancel = threading.Event()
    done = []

    def on_complete(row):
        done.append(row)
        if len(done) == 2:
            cancel.set()

    dst = {r: bytearray(int(ends[r] - begins[r])) for r in range(40)}
    with pytest.raises(pipeline.Cancelled):
        try:
            pipeline.run(fd, plan_reads(begins, ends, range(40), 64, 1 << 20),
                         pipeline.Destination(device_targets=dst, device_ops=emu), path=path,
                         slot_bytes=16_384, gpu_path=gpu_path, on_complete=on_complete, cancel=cancel)
        finally:
            emu.close()
    assert len(done) < 38
    emu.assert_clean()
    # the native reader's threads were joined too (fewer is fine: a thread an earlier test
    # started may leave the kernel's list meanwhile)
    assert _os_threads(until=before) <= before


def test_a_failing_device_copy_still_frees_everything(layout):
    emu = RingDevice()
    emu.emulator.fail_copy(7)
    with pytest.raises(DeviceError):
        _device_load(layout, emu)
    emu.assert_clean()


# -- several files as one pipeline ---------------------------------------------------------------------


@pytest.mark.parametrize("device", [False, True])
def test_several_files_run_as_one_pipeline(layout, tmp_path, device):
    fd, path, begins, ends, data = layout
    other = np.random.default_rng(7).integers(0, 256, len(data), dtype=np.uint8)
    path2 = tmp_path / "h.bin"
    path2.write_bytes(other.tobytes())
    fd2 = os.open(path2, os.O_RDONLY)
    rows = [r for r in range(40) if ends[r] > begins[r]]
    dst = {base + r: bytearray(int(ends[r] - begins[r])) for base in (0, 100) for r in rows}
    emu = RingDevice() if device else None
    if device:
        dest = pipeline.Destination(device_targets=dst, device_ops=emu)
    else:
        dest = pipeline.Destination(host_views={k: memoryview(b) for k, b in dst.items()})
    completed = []
    try:
        n = pipeline.run_sources(
            [pipeline.Source(fd, path, plan_reads(begins, ends, rows, 64, 65_536)),
             pipeline.Source(fd2, str(path2), plan_reads(begins, ends, rows, 64, 65_536), 100)],
            dest, threads=3, slot_bytes=100_000, on_complete=completed.append,
        )
    finally:
        os.close(fd2)
        if emu:
            emu.close()
    assert n == 2 * sum(int(ends[r] - begins[r]) for r in rows)
    assert sorted(completed) == sorted(dst)
    for r in rows:
        assert bytes(dst[r]) == _expected(data, begins, ends, r)
        assert bytes(dst[100 + r]) == _expected(other, begins, ends, r)
    if device:
        emu.assert_clean()


# -- the native split read -----------------------------------------------------------------------


def test_split_copy_reads_segments_over_threads_and_reports_the_first_short_read(layout):
    from engine.io import _split

    fd, _, _, _, data = layout
    file_offsets = np.array([100, 2_000_000, 3_000_000, 5], dtype=np.int64)
    sizes = np.array([1_500_000, 700_000, 0, 4000], dtype=np.int64)
    dst_offsets = np.array([0, 1_600_000, 2_400_000, 2_400_000], dtype=np.int64)
    for threads in (1, 3, 16):
        out = np.zeros(2_500_000, np.uint8)
        targets = [memoryview(out)[d : d + n] for d, n in zip(dst_offsets, sizes, strict=True)]
        with _split.SplitReader(threads) as reader:
            assert reader.copy(fd, None, file_offsets, targets) == (0, 0, 0)
        for f, d, n in zip(file_offsets, dst_offsets, sizes, strict=True):
            assert (out[d : d + n] == data[f : f + n]).all()
    end = len(data)
    with _split.SplitReader(4) as reader:
        err, at, missing = reader.copy(fd, None, np.array([end - 300_000], np.int64),
                                       [memoryview(np.zeros(1 << 20, np.uint8))], 4096)
        assert (err, at) == (-1, end)
        assert 0 < missing <= (1 << 20) - 300_000
        with pytest.raises(ValueError):  # an offset for each target
            reader.copy(fd, None, np.array([0, 5], np.int64), [memoryview(np.zeros(10, np.uint8))])


def test_resident_pages_of_a_fresh_file_and_of_an_empty_range(layout):
    from engine.io import _pages

    fd, _, _, _, data = layout
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        resident, pages = _pages.resident_pages(view[123 : 123 + 3 * mmap.PAGESIZE])
        assert pages == 4 and 0 <= resident <= pages
        assert _pages.resident_pages(view[:0]) == (0, 0)
        view.release()


def test_default_sizes():
    assert pipeline.default_copy_threads() == cores() >= 1
    # slot_bytes is the ring's chunk size, page-aligned
    assert geometry_for(5000).chunk_bytes == 4096
    assert geometry_for(1 << 20).chunk_bytes == 1 << 20


def test_split_reader_keeps_its_threads_between_reads(layout):
    from engine.io import _split

    fd, _, _, _, data = layout
    rng = np.random.default_rng(3)
    with _split.SplitReader(5) as reader:
        assert reader.threads == 5
        for _ in range(200):
            n = int(rng.integers(1, 6))
            sizes = rng.integers(0, 200_000, n)
            file_offsets = rng.integers(0, len(data) - 200_000, n).astype(np.int64)
            targets = [np.zeros(int(k), np.uint8) for k in sizes]
            align = int(rng.choice([1, 64, 4096]))
            assert reader.copy(fd, None, file_offsets, [memoryview(t) for t in targets], align) == (0, 0, 0)
            for t, off in zip(targets, file_offsets, strict=True):
                assert (t == data[off : off + len(t)]).all()
        end = len(data)
        err, at, _ = reader.copy(fd, None, np.array([end - 1000], np.int64), [memoryview(np.zeros(1 << 20, np.uint8))])
        assert (err, at) == (-1, end)
    with pytest.raises(ValueError, match="closed"):
        reader.copy(fd, None, np.array([0], np.int64), [memoryview(np.zeros(8, np.uint8))])
    reader.close()  # again: harmless


@pytest.mark.parametrize("source", ["mmap", "pread", "auto"])
def test_split_copy_fills_every_target_from_either_source(layout, source):
    from engine.io import _split

    fd, _, _, _, data = layout
    rng = np.random.default_rng(4)
    mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if source != "pread" else None
    try:
        with _split.SplitReader(3, adaptive=source == "auto") as reader:
            for _ in range(100):
                n = int(rng.integers(1, 8))
                sizes = rng.integers(0, 300_000, n)
                offsets = rng.integers(0, len(data) - 300_000, n).astype(np.int64)
                targets = [np.full(int(k), 7, np.uint8) for k in sizes]
                align = int(rng.choice([1, 4096, 65_536]))
                assert reader.copy(fd, mapping, offsets, [memoryview(t) for t in targets], align) == (0, 0, 0)
                for t, off in zip(targets, offsets, strict=True):
                    assert (t == data[off : off + len(t)]).all()
            # past the end of the file: the end-of-file code, at or before the end, and no fault
            end = len(data)
            err, at, missing = reader.copy(fd, mapping, np.array([end - 1000], np.int64),
                                           [memoryview(np.zeros(1 << 20, np.uint8))])
            assert (err, at) == (-1, end) and missing > 0
    finally:
        if mapping is not None:
            mapping.close()


def test_split_copy_refuses_read_only_targets(layout):
    from engine.io import _split

    fd, _, _, _, _ = layout
    with _split.SplitReader(2) as reader, pytest.raises((TypeError, ValueError, BufferError)):
        reader.copy(fd, None, np.array([0], np.int64), [memoryview(bytes(16))])


@pytest.mark.parametrize("source", ["mmap", "pread", "auto"])
def test_split_copy_releases_the_gil(layout, source):
    from engine.io import _split

    fd, _, _, _, data = layout
    n = len(data) // 4096
    offsets = np.zeros(n * 8, dtype=np.int64)
    out = np.zeros(4096 * n * 8, np.uint8)
    targets = [memoryview(out)[i * 4096 : (i + 1) * 4096] for i in range(n * 8)]
    mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if source != "pread" else None
    try:
        with _split.SplitReader(2, adaptive=source == "auto") as reader:

            def work():
                for _ in range(10):
                    assert reader.copy(fd, mapping, offsets, targets)[0] == 0

            assert ticks_during(work) > 100
    finally:
        if mapping is not None:
            mapping.close()


def test_a_copy_from_pages_the_file_lost_is_an_error_not_a_crash(tmp_path):
    # The populate step reports pages past the end before any copy; a file cut between the
    # populate and the copy faults inside the copy, and the guard turns that into -1.  Run in
    # a fresh interpreter, with faulthandler enabled before and after the guard is first set
    # up (it must come first in line either way, and print no crash report).
    code = """
import faulthandler, mmap, os, sys
import numpy as np
from engine.io import _guard, _split
path = sys.argv[1]
np.ones(1 << 20, np.uint8).tofile(path)
fd = os.open(path, os.O_RDONLY)
m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
out = np.zeros(8192, np.uint8)
faulthandler.enable()
assert _guard.guarded_copy(m, 4096, out) == 0 and out.sum() == 8192
faulthandler.disable(); faulthandler.enable()   # a handler set after the guard's
os.truncate(path, 0)
out[:] = 0
print(_guard.guarded_copy(m, 4096, out), _guard.guarded_copy(m, 0, out))
with _split.SplitReader(2) as r:
    print(r.copy(fd, m, np.array([4096], np.int64), [memoryview(out)]))
    # a kept mapping (engine.io.kept_mappings) of the file as it was: the same error
    print(r.copy(fd, m, np.array([4096], np.int64), [memoryview(out)], keep=True))
"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "f.bin")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    assert lines[0] == "-1 -1"
    assert lines[1].startswith("(-1, 4096,")
    assert lines[2].startswith("(-1, 4096,")
    assert "Fatal Python error" not in done.stderr


@contextlib.contextmanager
def _random_file(tmp_path, nbytes: int, seed: int, mapped: bool = True):
    """A file of ``nbytes`` random bytes: ``(data, path, fd, mapping)``, its descriptor and
    read-only mapping (None unless ``mapped``) closed afterwards."""
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    path = tmp_path / "big.bin"
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if mapped else None
    try:
        yield data, path, fd, mapping
    finally:
        if mapping is not None:
            mapping.close()
        os.close(fd)


@pytest.mark.parametrize("source", ["mmap", "pread", "auto"])
def test_split_copy_deals_pieces_in_turn_over_a_large_set(tmp_path, source):
    # more than a piece (8 MiB) per thread: the threads take pieces in turn, and segments
    # start and end anywhere inside and across pieces
    from engine.io import _split

    rng = np.random.default_rng(6)
    with _random_file(tmp_path, 60 << 20, 6, mapped=source != "pread") as (data, path, fd, mapping):
        with _split.SplitReader(3, adaptive=source == "auto") as reader:
            cuts = np.sort(rng.integers(0, len(data) - 1000, 9))
            offsets = np.concatenate([[17], cuts]).astype(np.int64)
            sizes = np.diff(np.concatenate([offsets, [len(data) - 5]]))
            targets = [np.zeros(int(n), np.uint8) for n in sizes]
            assert reader.copy(fd, mapping, offsets, [memoryview(t) for t in targets], 4096) == (0, 0, 0)
            for t, off in zip(targets, offsets, strict=True):
                assert (t == data[off : off + len(t)]).all()
            # a short file: the failure named is the one lowest in the set, wherever its thread is
            os.truncate(path, 30 << 20)
            err, at, _ = reader.copy(fd, mapping, offsets, [memoryview(t) for t in targets], 4096)
            assert (err, at) == (-1, 30 << 20)


@pytest.mark.parametrize("source", ["mmap", "pread", "auto"])
@pytest.mark.parametrize("start", [0, 8, (2 << 20) - 8, (2 << 20) + 4096])
@pytest.mark.parametrize("threads", [2, 5])
def test_split_copy_cuts_pieces_on_two_mib_file_lines(tmp_path, source, start, threads):
    # pieces of 2 MiB and more are cut where the file offset is a multiple of 2 MiB: the first
    # piece is shorter by the first segment's offset into its 2 MiB line and one more piece
    # comes at the end; every byte lands once, the set starting on a line, just past one or
    # just before, a single segment or many with gaps, a total of a slot's size (pieces
    # rounded up to 4 MiB) or just over a full piece per thread
    from engine.io import _split

    rng = np.random.default_rng(start + threads)
    with _random_file(tmp_path, 60 << 20, 12, mapped=source != "pread") as (data, _, fd, mapping):
        with _split.SplitReader(threads, adaptive=source == "auto", stream=True) as reader:
            for total in ((5 << 20) + 7, (8 << 20) * threads + 3, len(data) - start - 1):
                out = np.zeros(total, np.uint8)
                assert reader.copy(fd, mapping, np.array([start], np.int64), [memoryview(out)]) == (0, 0, 0)
                assert (out == data[start : start + total]).all(), total
            cuts = np.sort(rng.choice(np.arange(start, len(data) - 1, 4099), 40, replace=False))
            offsets, ends = cuts[:-1:2], cuts[1::2]  # every other span: gaps between them
            outs = [np.zeros(int(e - o), np.uint8) for o, e in zip(offsets, ends, strict=True)]
            assert reader.copy(fd, mapping, offsets.astype(np.int64), [memoryview(o) for o in outs]) == (0, 0, 0)
            for o, off in zip(outs, offsets, strict=True):
                assert (o == data[off : off + o.size]).all()


def test_an_adaptive_reader_times_the_mapping_and_copies_exact_bytes(tmp_path):
    # each thread maps part of its first timed piece, timing the mapping of the pages apart
    # from the copy, then keeps to the mapping or to pread by that figure, trying the
    # mapping again now and then; whichever it takes, the bytes are the file's
    from engine.io import _split

    with _random_file(tmp_path, 72 << 20, 8) as (data, _, fd, mapping):
        with _split.SplitReader(2, adaptive=True) as reader:
            assert reader.costs == [(0.0, 0.0), (0.0, 0.0)]
            assert reader.sources == [(0, 0), (0, 0)]
            # pieces under 1 MiB are not timed, and before a figure they are read
            small = np.zeros(100_000, np.uint8)
            assert reader.copy(fd, mapping, np.array([5], np.int64), [memoryview(small)]) == (0, 0, 0)
            assert (small == data[5:100_005]).all() and reader.costs == [(0.0, 0.0), (0.0, 0.0)]
            assert sum(p for p, _ in reader.sources) == 100_000 and all(m == 0 for _, m in reader.sources)
            copied = 100_000
            for rnd in range(3):  # 9 pieces of 8 MiB per call, over two threads, three calls
                out = np.zeros(len(data) - 3, np.uint8)
                assert reader.copy(fd, mapping, np.array([3], np.int64), [memoryview(out)], 4096) == (0, 0, 0)
                assert (out == data[3:]).all(), rnd
                copied += out.size
            costs = reader.costs
            assert len(costs) == 2 and all(p > 0 and c > 0 for p, c in costs), costs
            # every byte went through one source or the other, and each thread mapped
            sources = reader.sources
            assert sum(p + m for p, m in sources) == copied and all(m > 0 for _, m in sources), sources
        with _split.SplitReader(2) as fixed:
            assert fixed.costs == [] and fixed.sources == []


@pytest.mark.parametrize("stream", [False, True])
def test_mapped_copies_are_exact_at_every_alignment_and_length(tmp_path, stream):
    # the streaming copy (stores past the caches) copies a head up to a 16-byte line, then
    # 64-byte blocks, then a tail, and small copies whole: every seam, in every position
    from engine.io import _split

    with _random_file(tmp_path, 1 << 20, 10) as (data, _, fd, mapping):
        with _split.SplitReader(1, stream=stream) as reader:
            for length in (1, 15, 1023, 1024, 1025, 1024 + 63, 4096, 65_536 + 17, 300_001):
                for shift in range(17):
                    buf = np.zeros(length + 32, np.uint8)
                    out = buf[shift : shift + length]
                    src = 1000 + 7 * shift
                    assert reader.copy(fd, mapping, np.array([src], np.int64), [memoryview(out)], 1) == (0, 0, 0)
                    assert (out == data[src : src + length]).all(), (length, shift)
                    assert not buf[:shift].any() and not buf[shift + length :].any(), (length, shift)


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc/self/status")
@pytest.mark.parametrize("gaps", [False, True])
def test_mapped_copies_leave_no_file_pages_mapped(tmp_path, gaps):
    # each piece's pages are unmapped again once copied: a mapped load does not hold the
    # file's size in resident memory until its end (the page cache keeps the pages); the
    # unmap covers each run of file-contiguous segments (tensors) whole, and runs broken by
    # gaps (a selective load) one by one
    from engine.io import _split

    with _random_file(tmp_path, 64 << 20, 9) as (data, _, fd, mapping):
        cuts = np.linspace(100, len(data) - 100, 200).astype(np.int64)  # 199 segments
        offsets, sizes = cuts[:-1], np.diff(cuts)
        if gaps:  # every third segment skipped
            keep = np.arange(len(offsets)) % 3 != 2
            offsets, sizes = offsets[keep], sizes[keep]
        outs = [np.zeros(int(n), np.uint8) for n in sizes]
        for o in outs:
            o[::4096] = 1  # pre-faulted: anonymous memory, not counted in RssFile
        with _split.SplitReader(2) as reader:
            before = _rss_file_kib()
            assert reader.copy(fd, mapping, offsets, [memoryview(o) for o in outs], 4096) == (0, 0, 0)
            grown = _rss_file_kib() - before
        for o, off in zip(outs, offsets, strict=True):
            assert (o == data[off : off + o.size]).all()
        # 43-64 MiB copied; what may stay mapped: a page at each end of each run
        assert grown < 4 << 10, f"{grown} KiB of the file still mapped"


def test_a_host_load_starts_no_more_threads_than_it_has_pieces(layout, monkeypatch):
    fd, path, begins, ends, data = layout
    asked = []
    real = pipeline.split_reader

    def reader(threads, **kw):
        asked.append(threads)
        return real(threads, **kw)

    monkeypatch.setattr(pipeline, "split_reader", reader)
    dst = {r: memoryview(bytearray(int(ends[r] - begins[r]))) for r in range(40) if ends[r] > begins[r]}
    pipeline.run(fd, plan_reads(begins, ends, range(40), 64, 65_536), pipeline.Destination(host_views=dst),
                 path=path, threads=6)
    assert asked == [1]  # 5.5 MB: less than one 8 MiB piece
    for r, v in dst.items():
        assert bytes(v) == _expected(data, begins, ends, r)
    monkeypatch.setattr(pipeline, "split_piece_bytes", lambda: 1 << 20)
    pipeline.run(fd, plan_reads(begins, ends, range(40), 64, 65_536), pipeline.Destination(host_views=dst),
                 path=path, threads=4)
    assert asked[1] == 4  # six 1 MiB pieces: every thread asked for


@pytest.mark.parametrize("fresh", [True, False])
def test_remote_sources_are_read_by_requests_and_fresh_memory_is_faulted_in_first(monkeypatch, fresh):
    """A Source with ``ranges`` (a remote file) is read one request per call on worker
    threads; fresh host memory has its pages faulted in before each receive, and only then."""
    from engine.planning.plan import plan_reads

    data = bytes(range(256)) * 4096  # 1 MiB "file"
    begins, ends = np.array([0, 300_000, 700_000]), np.array([300_000, 700_000, 1_048_576])
    requests = plan_reads(begins, ends, [0, 1, 2], 0, 128 << 10, 64)
    calls, populated = [], []

    def ranges(offset, views):
        calls.append(offset)
        pos = offset
        for v in views:
            v[:] = data[pos : pos + len(v)]
            pos += len(v)

    monkeypatch.setattr(pipeline, "populate_write", lambda v: populated.append(len(v)) or 0)
    out = {r: bytearray(int(ends[r] - begins[r])) for r in range(3)}
    done = []
    dest = pipeline.Destination(host_views={r: memoryview(b) for r, b in out.items()}, fresh=fresh)
    pipeline.run_sources([pipeline.Source(-1, "http://x/m", requests, 0, ranges)], dest, threads=3,
                         on_complete=done.append)
    assert all(bytes(out[r]) == data[begins[r] : ends[r]] for r in range(3)) and sorted(done) == [0, 1, 2]
    assert sorted(calls) == sorted(r.offset for r in requests)
    assert (sum(populated) == len(data)) if fresh else not populated


@pytest.mark.parametrize("ahead", [0, 2])
def test_fresh_remote_destinations_are_faulted_in_ahead_in_the_order_of_the_work(monkeypatch, ahead):
    """With fault-ahead threads, every byte of a fresh destination is handed to them in
    the order the requests fill it (the threads race the receivers; the bytes never depend
    on who wins); without, none start."""
    from engine.planning.plan import plan_reads

    data = bytes(range(256)) * 8192  # 2 MiB "file"
    begins, ends = np.array([0, 600_000, 1_400_000]), np.array([600_000, 1_400_000, 2_097_152])
    requests = plan_reads(begins, ends, [0, 1, 2], 0, 256 << 10, 64)

    def ranges(offset, views):
        pos = offset
        for v in views:
            v[:] = data[pos : pos + len(v)]
            pos += len(v)

    handed = []
    real = pipeline.FaultAhead

    class Recording(real):
        def __init__(self, views, threads=None):
            views = list(views)
            super().__init__(views, threads)
            handed.append(([len(v) for v in views], self.threads))

    monkeypatch.setattr(pipeline, "FaultAhead", Recording)
    monkeypatch.setenv("ENGINE_FAULT_AHEAD", str(ahead))
    out = {r: bytearray(int(ends[r] - begins[r])) for r in range(3)}
    dest = pipeline.Destination(host_views={r: memoryview(b) for r, b in out.items()}, fresh=True)
    pipeline.run_sources([pipeline.Source(-1, "http://x/m", requests, 0, ranges)], dest, threads=3)
    assert all(bytes(out[r]) == data[begins[r] : ends[r]] for r in range(3))
    # 2 MiB is one step: at most one thread
    assert handed == [([p.nbytes for req in requests for p in req.pieces if p.nbytes], min(ahead, 1))]
    # not fresh: the caller's tensors are already there, nothing is faulted in ahead
    handed.clear()
    dest = pipeline.Destination(host_views={r: memoryview(b) for r, b in out.items()}, fresh=False)
    pipeline.run_sources([pipeline.Source(-1, "http://x/m", requests, 0, ranges)], dest, threads=3)
    assert handed == []
