"""``pread_into``: the one read primitive. Short reads, end of file, I/O errors."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from gil import ticks_during

from engine.errors import ReadError
from engine.io import reader


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    data = np.random.default_rng(0).integers(0, 256, 1_000_000, dtype=np.uint8)
    path = tmp_path_factory.mktemp("reader") / "blob"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    yield fd, data, str(path)
    os.close(fd)


def test_scatters_into_several_buffers(data_file):
    fd, data, path = data_file
    bufs = [bytearray(n) for n in (10, 0, 4096, 1, 70_000)]
    reader.pread_into(fd, 77, [memoryview(b) for b in bufs], path=path)
    assert b"".join(bufs) == data[77 : 77 + sum(map(len, bufs))].tobytes()


def test_short_reads_are_continued(data_file, monkeypatch):
    fd, data, path = data_file
    real = os.preadv

    def dribble(fd_, buffers, offset):  # the kernel may return fewer bytes than asked
        return real(fd_, [buffers[0][: max(1, min(len(buffers[0]), 777))]], offset)

    monkeypatch.setattr(os, "preadv", dribble)
    bufs = [bytearray(5000), bytearray(3), bytearray(20_000)]
    reader.pread_into(fd, 123, [memoryview(b) for b in bufs], path=path)
    assert b"".join(bufs) == data[123 : 123 + 25_003].tobytes()


def test_end_of_file_is_a_read_error(data_file):
    fd, _, path = data_file
    with pytest.raises(ReadError) as info:
        reader.pread_into(fd, 999_990, [memoryview(bytearray(100))], path=path)
    err = info.value
    assert err.reason == "ShortRead" and err.offset == 1_000_000 and err.size == 90
    assert path in str(err) and isinstance(err, OSError)


def test_io_error_is_a_read_error_with_cause(data_file, monkeypatch):
    fd, _, path = data_file

    def failing(*_):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(ReadError) as info:
        reader.pread_into(fd, 0, [memoryview(bytearray(10))], path=path)
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.offset == 0 and info.value.size == 10 and "Input/output" in str(info.value)


def test_default_threads_is_bounded():
    assert 2 <= reader.default_threads() <= 8


def test_pread_runs_matches_slicing_and_reports_eof(data_file):
    fd, data, path = data_file
    src = np.arange(0, 900_000, 3000, dtype=np.int64)
    out = bytearray(len(src) * 100)
    reader.pread_runs(fd, memoryview(out), src, 100, 17, path=path, threads=3)
    expect = b"".join(data[17 + s : 17 + s + 100].tobytes() for s in src.tolist())
    assert bytes(out) == expect
    with pytest.raises(ReadError) as info:
        reader.pread_runs(fd, memoryview(bytearray(200)), np.array([0, 999_950]), 100, 0, path=path)
    assert info.value.reason == "ShortRead" and info.value.offset == 1_000_000 and info.value.size == 50


def test_the_gil_probe_tells_holding_from_releasing():
    """tests/gil.py, which every "releases the GIL" test uses, is able to fail: a C loop
    that keeps the GIL (sum over a range) lets the spinner count next to nothing."""
    import time

    assert ticks_during(lambda: sum(range(5_000_000))) < 10
    assert ticks_during(lambda: time.sleep(0.05)) > 100


def test_pread_runs_releases_the_gil(data_file):
    """The spinner gives the GIL back after every tick (sleep(0)) and, with a 100 s switch
    interval, the main thread never hands it over on its own: so the counter can only move
    while the main thread has released the GIL, i.e. inside the native loop."""

    fd, _, path = data_file
    src = np.zeros(20_000, dtype=np.int64)  # 20k reads of the same 4 KiB: a long native loop
    out = bytearray(len(src) * 4096)
    # five long native loops: a window wide enough that the spinner gets its ticks in even when
    # other work shares the cores (CI installs packages beside the suite)
    assert ticks_during(lambda: [reader.pread_runs(fd, memoryview(out), src, 4096, 0, path=path)
                                 for _ in range(5)]) > 100


def test_short_read_names_the_files_real_size(tmp_path):
    from engine.io.reader import pread_into, pread_runs

    path = tmp_path / "short.bin"
    path.write_bytes(bytes(100))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ReadError) as e:
            pread_into(fd, 60, [memoryview(bytearray(80))], path=str(path))
        assert e.value.reason == "ShortRead" and "holds 100 bytes" in str(e.value)
        with pytest.raises(ReadError) as e:
            pread_runs(fd, memoryview(bytearray(40)), np.array([0, 90]), 20, 0, path=str(path))
        assert e.value.reason == "ShortRead" and "holds 100 bytes" in str(e.value)
    finally:
        os.close(fd)

# -- prefetch of a file mapping ------------------------------------------------------------------


@pytest.fixture
def mapped_file(tmp_path, monkeypatch):
    import mmap

    monkeypatch.setattr(reader, "PREFETCH_PIECE", 1 << 20)  # several pieces from a small file
    monkeypatch.setattr(reader, "PREFETCH_MIN_BYTES", 1)
    data = np.random.default_rng(1).integers(0, 256, (6 << 20) + 12_345, dtype=np.uint8)
    path = tmp_path / "mapped"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold where the file system allows
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    yield mm, data
    mm.close()
    os.close(fd)


def _cold_pieces(mm, lo, hi):
    from engine.io import _pages

    view = memoryview(mm)
    try:
        return sum(not _pages.mapping_resident(view, p, min(p + reader.PREFETCH_PIECE, hi))
                   for p in range(lo, hi, reader.PREFETCH_PIECE))
    finally:
        view.release()


def test_prefetch_reads_exactly_the_cold_pieces_and_leaves_them_resident(mapped_file):
    mm, data = mapped_file
    lo, hi = 1000, len(data) - 7
    before = _cold_pieces(mm, lo, hi)
    assert reader.prefetch_mapping(mm, [(lo, 5 << 20), (5 << 20, hi)], threads=3) == before
    assert _cold_pieces(mm, lo, hi) == 0
    assert reader.prefetch_mapping(mm, [(lo, hi)]) == 0  # warm: nothing to do
    assert np.array_equal(np.frombuffer(mm, np.uint8), data)


def test_prefetch_ignores_empty_and_small_ranges(mapped_file, monkeypatch):
    mm, _ = mapped_file
    assert reader.prefetch_mapping(mm, []) == 0
    assert reader.prefetch_mapping(mm, [(10, 10), (50, 40)]) == 0
    monkeypatch.setattr(reader, "PREFETCH_MIN_BYTES", 1 << 30)
    assert reader.prefetch_mapping(mm, [(0, len(mm))]) == 0


def test_populate_makes_the_range_resident_and_an_empty_range_is_a_no_op(mapped_file):
    from engine.io import _pages

    mm, _ = mapped_file
    view = memoryview(mm)
    try:
        assert reader.populate_mapping(view, 0, len(mm)) == 0
        assert _pages.mapping_resident(view, 0, len(mm))
        assert reader.populate_mapping(view, 5, 5) == 0 and _pages.mapping_resident(view, 5, 5)  # empty range
    finally:
        view.release()


def test_populate_write_faults_in_whole_pages_and_keeps_the_bytes():
    import mmap

    from engine.io import _pages

    page = mmap.PAGESIZE
    mm = mmap.mmap(-1, 8 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(mm)
    try:
        view[page + 3] = 7
        assert not _pages.mapping_resident(view, 3 * page, 7 * page)  # fresh pages are not mapped yet
        # bytes 100 .. 7 pages + 100: whole pages 1..6 are faulted in; the partial ones at the
        # ends may belong to a neighbour and are left alone
        assert reader.populate_write(view[100 : 7 * page + 100]) == 0
        assert _pages.mapping_resident(view, page, 7 * page)
        assert view[page + 3] == 7 and bytes(view[2 * page : 3 * page]) == bytes(page)
        assert reader.populate_write(view[5:5]) == 0 and reader.populate_write(view[10:20]) == 0
    finally:
        view.release()
        mm.close()


def test_populate_ranges_faults_in_its_share_of_steps_in_order_and_stops_when_told():
    import array
    import mmap

    from engine.io import _pages

    page = mmap.PAGESIZE
    mm = mmap.mmap(-1, 16 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(mm)
    try:
        view[5 * page + 1] = 9
        # steps of views; neighbours in memory are merged into one call, partial pages left alone
        steps = [[view[0:page], view[page:2 * page]], [view[4 * page:6 * page]], [view[8 * page + 1:10 * page]],
                 [view[12 * page:14 * page]]]
        stop = array.array("i", [0])
        assert _pages.populate_ranges(steps, 1, 2, stop) == 0  # steps 1 and 3 only
        assert _pages.mapping_resident(view, 4 * page, 6 * page) and _pages.mapping_resident(view, 12 * page, 14 * page)
        assert not _pages.mapping_resident(view, 0, page) and not _pages.mapping_resident(view, 8 * page, 10 * page)
        assert view[5 * page + 1] == 9 and bytes(view[4 * page : 5 * page]) == bytes(page)
        assert _pages.populate_ranges(steps, 0, 2, stop) == 0
        assert _pages.mapping_resident(view, 0, 2 * page) and _pages.mapping_resident(view, 9 * page, 10 * page)
        assert not _pages.mapping_resident(view, 8 * page, 9 * page)  # a partial page: a neighbour's
        stop[0] = 1  # a stopped call faults nothing in
        assert _pages.populate_ranges([[view[15 * page:16 * page]]], 0, 1, stop) == 0
        assert not _pages.mapping_resident(view, 15 * page, 16 * page)
        assert _pages.populate_ranges([], 0, 1, stop) == 0 and _pages.populate_ranges(steps, 9, 1, stop) == 0
        with pytest.raises(ValueError):
            _pages.populate_ranges(steps, 0, 0, stop)
        del steps
    finally:
        view.release()
        mm.close()


def test_fault_ahead_faults_a_destination_in_and_stops_on_close(monkeypatch):
    import mmap

    from engine.io import _pages

    page = mmap.PAGESIZE
    size = 3 * reader.FAULT_STEP_BYTES
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(mm)
    try:
        views = [view[i : i + (1 << 20)] for i in range(0, size, 1 << 20)]
        with reader.FaultAhead(views, threads=2) as ahead:
            assert ahead.threads == 2
            ahead.wait()  # close() would stop them between runs
        assert _pages.mapping_resident(view, 0, size)
        assert bytes(view[:page]) == bytes(page)
        with reader.FaultAhead(views[:1], threads=8) as ahead:
            assert ahead.threads == 1  # no more threads than steps
        with reader.FaultAhead([], threads=4) as ahead:
            assert ahead.threads == 0
        del views
    finally:
        view.release()
        mm.close()
    monkeypatch.setenv("ENGINE_FAULT_AHEAD", "3")
    assert reader.fault_threads() == 3
    monkeypatch.setenv("ENGINE_FAULT_AHEAD", "0")
    assert reader.fault_threads() == 0
    monkeypatch.setenv("ENGINE_FAULT_AHEAD", "many")
    with pytest.raises(ValueError, match="ENGINE_FAULT_AHEAD"):
        reader.fault_threads()
    monkeypatch.delenv("ENGINE_FAULT_AHEAD")
    monkeypatch.setattr(reader.os, "cpu_count", lambda: 2)
    assert reader.fault_threads() == 0  # two cores: the receivers need both
    monkeypatch.setattr(reader.os, "cpu_count", lambda: 16)
    assert reader.fault_threads() == 4


def test_spans_gather_runs_through_a_bounce_of_any_size(data_file):
    fd, data, path = data_file
    src = np.array([0, 40, 90, 95, 300, 5000, 5030, 20_000], np.int64)  # uneven gaps, one overlap
    want = b"".join(data[1234 + o : 1234 + o + 7].tobytes() for o in src)
    for cap in (0, 6, 7, 50, 100, 1 << 16):
        dst = bytearray(len(src) * 7)
        reader.pread_spans(fd, memoryview(dst), src, 7, 1234, bytearray(cap), path=path)
        assert bytes(dst) == want, cap
    assert reader.spans_bytes(src, 7, 1 << 16) == 20_007
    # [0, 97) [95, 102) [300, 307) [5000, 5037) [20000, 20007)
    assert reader.spans_bytes(src, 7, 100) == 97 + 7 + 7 + 37 + 7
    assert reader.spans_bytes(src, 7, 0) == 8 * 7


def test_spans_past_the_end_is_a_short_read(data_file):
    fd, _, path = data_file
    with pytest.raises(ReadError) as info:
        reader.pread_spans(fd, memoryview(bytearray(20)), np.array([0, 999_995]), 10, 0, bytearray(1 << 20), path=path)
    assert info.value.reason == "ShortRead" and info.value.offset == 1_000_000 and info.value.size == 5


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("inline_under", [None, 0.0, 60.0])
def test_map_threads_raises_the_first_failure_after_undoing_the_successes(workers, inline_under):
    """The one thread map of the package: results in item order; on failures, the first in
    item order is raised once every started call has ended, after ``undo`` of each success."""
    assert reader.map_threads(lambda x: x * x, range(6), workers, inline_under=inline_under) == [0, 1, 4, 9, 16, 25]
    undone: list[int] = []

    def fn(x):
        if x in (2, 4):
            raise ValueError(x)
        return x

    with pytest.raises(ValueError) as err:
        reader.map_threads(fn, range(6), workers, inline_under=inline_under, undo=undone.append)
    assert err.value.args == (2,)
    # inline calls stop at the first failure; parallel ones all run, and all successes are undone
    parallel = workers > 1 and inline_under != 60.0
    assert sorted(undone) == ([0, 1, 3, 5] if parallel else [0, 1])


# -- network mounts: large reads, never a populate through the network --------------------------


def test_a_file_on_a_fuse_mount_is_read_with_pread_unless_the_mapping_is_pinned(fuse_file, monkeypatch):
    via_fuse, direct, _ = fuse_file
    monkeypatch.delenv("ENGINE_COPY_SOURCE", raising=False)
    fds = [os.open(via_fuse, os.O_RDONLY), os.open(direct, os.O_RDONLY)]
    try:
        assert reader.copy_mapping(fds[0]) is None
        local = reader.copy_mapping(fds[1])
        assert local is not None
        reader.close_mapping(local)
        monkeypatch.setenv("ENGINE_COPY_SOURCE", "mmap")
        pinned = reader.copy_mapping(fds[0])
        assert pinned is not None and len(pinned) == os.path.getsize(direct)
        reader.close_mapping(pinned)
    finally:
        for fd in fds:
            os.close(fd)



def test_streamed_copies_out_of_a_mapping_land_every_byte_at_any_alignment(tmp_path):
    # copies out of a mapping into memory nobody reads soon store past the caches, 16, 32 or 64
    # bytes at a time as the processor allows, after a head that aligns the destination: every
    # length and both misalignments must still land each byte exactly once
    import mmap

    from engine.io import _split

    data = np.random.default_rng(9).integers(0, 256, 3 << 20, dtype=np.uint8)
    path = tmp_path / "s.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m, _split.SplitReader(1, stream=True) as r:
            for n in (1023, 1024, 1025, 4095, 65_537, (1 << 20) + 13, 2 << 20):
                for src_off, dst_off in ((0, 0), (1, 0), (7, 33), (4096 + 63, 1), (100_000, 61)):
                    dst = np.zeros(n + dst_off + 64, np.uint8)
                    view = memoryview(dst)[dst_off : dst_off + n]
                    assert r.copy(fd, m, np.array([src_off], np.int64), [view]) == (0, 0, 0)
                    assert dst[dst_off : dst_off + n].tobytes() == data[src_off : src_off + n].tobytes(), (n, src_off)
                    assert not dst[:dst_off].any() and not dst[dst_off + n :].any(), (n, dst_off)
    finally:
        os.close(fd)
