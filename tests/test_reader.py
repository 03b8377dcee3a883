"""``pread_into``: the one read primitive. Short reads, end of file, I/O errors."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from engine import reader
from engine.errors import ReadError


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


def test_pread_runs_releases_the_gil(data_file):
    """The spinner gives the GIL back after every tick (sleep(0)) and, with a 100 s switch
    interval, the main thread never hands it over on its own: so the counter can only move
    while the main thread has released the GIL, i.e. inside the native loop."""
    import sys
    import threading
    import time

    fd, _, path = data_file
    src = np.zeros(20_000, dtype=np.int64)  # 20k reads of the same 4 KiB: a long native loop
    out = bytearray(len(src) * 4096)
    ticks = [0]
    started, stop = threading.Event(), threading.Event()

    def spin():
        started.set()
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0)

    old = sys.getswitchinterval()
    sys.setswitchinterval(100)
    t = threading.Thread(target=spin)
    try:
        t.start()
        started.wait()
        before = ticks[0]
        reader.pread_runs(fd, memoryview(out), src, 4096, 0, path=path)
        during = ticks[0] - before
    finally:
        stop.set()
        sys.setswitchinterval(old)
        t.join()
    assert during > 100


def test_short_read_names_the_files_real_size(tmp_path):
    from engine.reader import pread_into, pread_runs

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
