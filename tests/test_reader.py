"""The positional reader: coalescing, chunking, threads, short reads and I/O errors."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import reader
from engine.errors import ReadError


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    data = np.random.default_rng(0).integers(0, 256, 3_000_000, dtype=np.uint8)
    path = tmp_path_factory.mktemp("reader") / "blob"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    yield fd, data, str(path)
    os.close(fd)


@settings(max_examples=60, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 3_000_000), min_size=0, max_size=40, unique=True),
    chunk=st.sampled_from([1, 7, 4096, 100_000, 16 << 20]),
    threads=st.sampled_from([1, 2, 4]),
)
def test_requests_fill_destinations_exactly(data_file, cuts, chunk, threads):
    fd, data, path = data_file
    bounds = [0, *sorted(cuts), 3_000_000]
    if chunk < 4096:  # tiny chunks are slow: read only a prefix
        bounds = [b for b in bounds if b <= 20_000] + [20_000]
        bounds = sorted(set(bounds))
    bufs = [np.full(b - a, 0xAA, np.uint8) for a, b in zip(bounds[:-1], bounds[1:])]
    n = reader.read_requests(
        fd, [(a, memoryview(buf)) for a, buf in zip(bounds[:-1], bufs)], path=path, threads=threads, chunk_bytes=chunk
    )
    assert n == bounds[-1]
    assert np.array_equal(np.concatenate(bufs) if bufs else data[:0], data[: bounds[-1]])


def test_groups_respect_chunk_and_iov_limits():
    views = [(i * 10, memoryview(bytearray(10))) for i in range(3000)]  # contiguous
    groups = list(reader._groups(views, 1 << 20))
    assert all(len(g[1]) <= reader._IOV_MAX for g in groups)
    assert sum(g[2] for g in groups) == 30_000
    big = [(0, memoryview(bytearray(10_000)))]
    assert [g[2] for g in reader._groups(big, 3000)] == [3000, 3000, 3000, 1000]
    gap = [(0, memoryview(bytearray(10))), (11, memoryview(bytearray(10)))]
    assert [g[0] for g in reader._groups(gap, 1 << 20)] == [0, 11]


def test_short_reads_are_continued(data_file, monkeypatch):
    fd, data, path = data_file
    real = os.preadv

    def dribble(fd_, buffers, offset):  # the kernel may return fewer bytes than asked
        first = buffers[0]
        return real(fd_, [first[: max(1, min(len(first), 777))]], offset)

    monkeypatch.setattr(os, "preadv", dribble)
    out = np.empty(50_000, np.uint8)
    reader.read_requests(fd, [(123, memoryview(out))], path=path, threads=1)
    assert np.array_equal(out, data[123:50_123])


def test_end_of_file_is_a_read_error(data_file):
    fd, _, path = data_file
    with pytest.raises(ReadError) as info:
        reader.read_requests(fd, [(2_999_990, memoryview(bytearray(100)))], path=path)
    err = info.value
    assert err.reason == "ShortRead" and err.offset == 3_000_000 and err.size == 90
    assert path in str(err)


def test_io_error_is_a_read_error_with_cause(data_file, monkeypatch):
    fd, _, path = data_file

    def failing(*_):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(ReadError) as info:
        reader.read_requests(fd, [(0, memoryview(bytearray(10)))], path=path)
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.offset == 0 and info.value.size == 10 and "Input/output" in str(info.value)


def test_worker_error_reaches_caller_and_no_thread_leaks(data_file, monkeypatch):
    fd, _, path = data_file
    real = os.preadv
    calls = []

    def flaky(fd_, buffers, offset):
        calls.append(offset)
        if offset >= 1_000_000:
            raise OSError(errno.EIO, "boom")
        return real(fd_, buffers, offset)

    monkeypatch.setattr(os, "preadv", flaky)
    monkeypatch.setattr(reader, "_PARALLEL_MIN_BYTES", 0)
    before = threading.active_count()
    out = bytearray(3_000_000)
    with pytest.raises(ReadError, match="boom"):
        reader.read_requests(fd, [(0, memoryview(out))], path=path, threads=4, chunk_bytes=100_000)
    assert threading.active_count() == before
