"""engine.gpu.device_ring and its native ring (engine.gpu._ring) against the emulated CUDA runtime
(tests/emucudart): the same entry points a real libcudart has, copies that run later on a
stream thread and read their source only then, events, page-locking, injected failures.

What a GPU does that the emulator cannot (DMA speed, a real driver) is measured by
``scripts/gpu_check.py`` on a GPU host; everything about order, recycling, errors and clean-up
is tested here."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from emucudart import EmulatedRingOps, Emulator

from engine.errors import DeviceError, ReadError
from engine.gpu import chunk_plan, device_ring, rings
from engine.gpu.geometry import MAX_RING_BYTES, Geometry, default_geometry, default_threads, stores
from engine.gpu.records import load_records
from engine.loading import pipeline
from engine.planning.plan import Piece, Request, plan_reads

_MIB = 1 << 20


@pytest.fixture(scope="module")
def emu():
    return Emulator()


@pytest.fixture
def ops(emu):
    emu.reset()
    ops = EmulatedRingOps(emu)
    yield ops
    rings.release_rings()  # a ring kept after a load uses the stream about to go
    ops.close()
    emu.reset()


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """A 6 MiB file: 64 header bytes, then 60 tensors of random sizes (some empty)."""
    rng = np.random.default_rng(11)
    sizes = rng.integers(0, 300_000, 60)
    sizes[[3, 17]] = 0
    ends = np.cumsum(sizes)
    begins = ends - sizes
    data = rng.integers(0, 256, 64 + int(ends[-1]) + 100, dtype=np.uint8)
    path = tmp_path_factory.mktemp("ring") / "f.bin"
    path.write_bytes(data.tobytes())
    return str(path), begins, ends, data


def _clean(emu) -> None:
    rings.release_rings()  # rings linger briefly after a load: closed now
    st = emu.stats()
    assert st["registered"] == 0, st  # every chunk unlocked
    assert st["events"] == 0, st      # every event destroyed
    assert st["pageable"] == 0, st    # every copy from page-locked chunks
    assert st["wrong_device"] == 0, st
    assert st["streams"] == 0, st     # every ring's own stream destroyed with it
    # every retain of a primary context released, none released twice (a release too many
    # would take the framework's own reference away)
    assert emu.bad_releases() == 0 and emu.primary_refs(0) == emu.primary_refs(1) == 0


_SMALL = Geometry(64 * 1024, 4, 2)


def _load(layout, ops, rows=None, geometry=_SMALL, chunk=1 << 20, **kw):
    path, begins, ends, data = layout
    rows = list(range(len(begins))) if rows is None else rows
    dst = {r: np.zeros(int(ends[r] - begins[r]), np.uint8) for r in rows}
    done: list[int] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        src = pipeline.Source(fd, path, plan_reads(begins, ends, rows, 64, chunk))
        tracker = pipeline._Tracker.of([src], done.append)
        stats = device_ring.load([src], pipeline.Destination(device_targets=dst, device_ops=ops), tracker,
                                 kw.pop("cancel", threading.Event()), geometry)
    finally:
        os.close(fd)
    return dst, done, stats


def _check(layout, dst) -> None:
    _, begins, ends, data = layout
    for r, got in dst.items():
        assert got.tobytes() == data[64 + begins[r] : 64 + ends[r]].tobytes(), r


@pytest.mark.parametrize("geometry", [
    Geometry(4096, 1, 1),          # one chunk: every fill waits for the last copy
    Geometry(64 * 1024, 3, 4),     # more threads than chunks
    Geometry(256 * 1024, 16, 2),
    Geometry(2 * _MIB, 8, 3),
    Geometry(32 * _MIB, 2, 2),     # chunks larger than the file
])
@pytest.mark.parametrize("source", ["pread", "mmap", "auto"])
def test_every_byte_lands_and_every_tensor_completes_once(layout, ops, emu, geometry, source, monkeypatch):
    monkeypatch.setenv("ENGINE_COPY_SOURCE", source)
    emu.delay(0.0002)  # copies run late: a chunk reused too early would land wrong bytes
    dst, done, stats = _load(layout, ops, geometry=geometry)
    _check(layout, dst)
    # once each, and only tensors with bytes (as the pipeline reports them)
    assert sorted(done) == sorted(r for r, a in dst.items() if len(a)) and len(done) == len(set(done))
    _clean(emu)
    assert stats["slots"] == geometry.chunks and stats["chunk_bytes"] == geometry.chunk_bytes
    assert stats["threads"] == (0 if stats["chunks"] == 1 else min(geometry.threads, stats["chunks"]))
    took = np.array([stats["pread_bytes"], stats["mmap_bytes"]])
    if source == "pread":
        assert took[1] == 0
    if source == "mmap":
        assert took[0] == 0
    if source == "auto":  # every thread tries the mapping, whatever the chunk size, then keeps to the faster
        assert took[1] > 0
    assert took.sum() == sum(len(a) for a in dst.values())


def test_a_selection_with_gaps_packs_chunks_and_lands(layout, ops, emu):
    rows = list(range(0, 60, 3))
    emu.delay(0.0001)
    dst, done, _ = _load(layout, ops, rows=rows, geometry=Geometry(128 * 1024, 4, 2))
    _check(layout, dst)
    assert sorted(done) == sorted(r for r in rows if len(dst[r]))
    _clean(emu)


def test_several_files_in_one_ring(layout, ops, emu, tmp_path):
    path, begins, ends, data = layout
    other = np.random.default_rng(3).integers(0, 256, len(data), dtype=np.uint8)
    path2 = tmp_path / "g.bin"
    path2.write_bytes(other.tobytes())
    rows = [r for r in range(60) if ends[r] > begins[r]]
    dst = {base + r: np.zeros(int(ends[r] - begins[r]), np.uint8) for base in (0, 100) for r in rows}
    fds = [os.open(path, os.O_RDONLY), os.open(path2, os.O_RDONLY)]
    done: list[int] = []
    try:
        srcs = [pipeline.Source(fds[0], path, plan_reads(begins, ends, rows, 64, 1 << 20)),
                pipeline.Source(fds[1], str(path2), plan_reads(begins, ends, rows, 64, 1 << 20), 100)]
        device_ring.load(srcs, pipeline.Destination(device_targets=dst, device_ops=ops),
                         pipeline._Tracker.of(srcs, done.append), threading.Event(),
                         Geometry(256 * 1024, 6, 2))
    finally:
        for fd in fds:
            os.close(fd)
    for r in rows:
        assert dst[r].tobytes() == data[64 + begins[r] : 64 + ends[r]].tobytes()
        assert dst[100 + r].tobytes() == other[64 + begins[r] : 64 + ends[r]].tobytes()
    assert sorted(done) == sorted(dst)
    _clean(emu)


def test_the_pipeline_takes_the_ring_for_plain_device_loads(layout, ops, emu):
    path, begins, ends, data = layout
    dst = {r: np.zeros(int(ends[r] - begins[r]), np.uint8) for r in range(60)}
    fd = os.open(path, os.O_RDONLY)
    try:
        n = pipeline.run(fd, plan_reads(begins, ends, range(60), 64, 1 << 20),
                         pipeline.Destination(device_targets=dst, device_ops=ops), path=path, threads=2)
    finally:
        os.close(fd)
    assert n == int(ends[-1])
    _check(layout, dst)
    assert emu.stats()["copies"] > 0
    _clean(emu)


# -- failures ------------------------------------------------------------------------------------


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_failed_copy_is_a_device_error_and_everything_is_released(layout, ops, emu, asynchronous):
    emu.delay(0.0001)
    emu.fail_copy(5, 700, asynchronous)  # cudaErrorIllegalAddress, at issue or as a device fault
    with pytest.raises(DeviceError) as info:
        _load(layout, ops)
    assert "illegal memory access" in str(info.value) and "700" in str(info.value)
    assert layout[0] in str(info.value)
    _clean(emu)


def test_a_copy_thread_that_cannot_set_its_device_fails_the_load_with_that_error(layout, ops, emu):
    """The ring's copy threads set its device before their first call; a refusal is the load's
    DeviceError with the runtime's own code, not a later call's complaint about no context."""
    emu.fail_set_device(101)  # cudaErrorInvalidDevice
    try:
        with pytest.raises(DeviceError, match="101"):
            _load(layout, ops)
    finally:
        emu.fail_set_device(0)
    _clean(emu)


def test_a_failed_event_record_is_a_device_error(layout, ops, emu):
    emu.fail_event_record_after(3)
    with pytest.raises(DeviceError, match="CUDA error 700"):
        _load(layout, ops)
    _clean(emu)


@pytest.mark.parametrize("source", ["pread", "mmap", "auto"])
def test_a_file_truncated_under_the_load_is_a_read_error_naming_it(layout, ops, emu, tmp_path, monkeypatch, source):
    monkeypatch.setenv("ENGINE_COPY_SOURCE", source)
    path, begins, ends, data = layout
    short = tmp_path / "short.bin"
    cut = 64 + int(ends[-1]) // 2
    short.write_bytes(data[:cut].tobytes())  # the header promises more than the file holds
    with pytest.raises(ReadError) as info:
        _load((str(short), begins, ends, data), ops)
    assert info.value.path == str(short) and info.value.reason == "ShortRead"
    assert info.value.offset >= cut - 2 * _MIB
    _clean(emu)


def test_cancel_stops_the_load_and_waits_for_issued_copies(layout, ops, emu):
    cancel = threading.Event()
    emu.delay(0.002)
    path, begins, ends, data = layout
    dst = {r: np.zeros(int(ends[r] - begins[r]), np.uint8) for r in range(60)}
    fd = os.open(path, os.O_RDONLY)
    landed: list[int] = []

    def on_complete(row):
        landed.append(row)
        cancel.set()

    try:
        src = pipeline.Source(fd, path, plan_reads(begins, ends, range(60), 64, 1 << 20))
        device_ring.load([src], pipeline.Destination(device_targets=dst, device_ops=ops),
                         pipeline._Tracker.of([src], on_complete), cancel, Geometry(16 * 1024, 4, 2))
    finally:
        os.close(fd)
    assert cancel.is_set() and len(landed) < 58
    _clean(emu)
    for r in landed:  # what was reported landed is complete
        assert dst[r].tobytes() == data[64 + begins[r] : 64 + ends[r]].tobytes()


def test_an_exception_in_the_progress_report_propagates_after_the_copies(layout, ops, emu):
    emu.delay(0.002)
    path, begins, ends, _ = layout
    dst = {r: np.zeros(int(ends[r] - begins[r]), np.uint8) for r in range(60)}
    fd = os.open(path, os.O_RDONLY)

    def on_complete(row):
        raise KeyboardInterrupt  # what Ctrl-C raises in the poll

    try:
        src = pipeline.Source(fd, path, plan_reads(begins, ends, range(60), 64, 1 << 20))
        with pytest.raises(KeyboardInterrupt):
            device_ring.load([src], pipeline.Destination(device_targets=dst, device_ops=ops),
                             pipeline._Tracker.of([src], on_complete), threading.Event(),
                             Geometry(16 * 1024, 4, 2))
    finally:
        os.close(fd)
    _clean(emu)


def test_refused_page_locking_still_loads_every_byte(layout, ops, emu):
    emu.fail_register(2)  # cudaErrorMemoryAllocation
    dst, done, stats = _load(layout, ops)
    _check(layout, dst)
    assert stats["pageable"] and emu.stats()["pageable"] > 0 and emu.stats()["registered"] == 0


def test_a_missing_runtime_is_a_device_error(layout, ops, emu, monkeypatch):
    monkeypatch.setattr(ops, "runtime_path", lambda: "/nonexistent/libcudart.so")
    with pytest.raises(DeviceError, match="libcudart"):
        _load(layout, ops)


# -- memory: bounded, nothing left mapped ----------------------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("unmap", ["chunk", "end"])
def test_no_file_stays_mapped_and_mapped_pages_are_released(ops, emu, tmp_path, monkeypatch, unmap):
    monkeypatch.setenv("ENGINE_COPY_SOURCE", "mmap")
    monkeypatch.setenv("ENGINE_RING_UNMAP", unmap)
    path = tmp_path / "big.bin"
    n = 64 * _MIB
    data = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    dst = {0: np.zeros(n, np.uint8)}
    dst[0][:] = 1  # its pages resident before the load
    fd = os.open(path, os.O_RDONLY)
    peak = [0]
    before = _status("RssFile")

    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _status("RssFile") - before)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    emu.delay(0.002)  # a load long enough to be sampled
    sampler.start()
    try:
        src = pipeline.Source(fd, str(path), [Request(0, n, (Piece(0, 0, 0, n),))])
        device_ring.load([src], pipeline.Destination(device_targets=dst, device_ops=ops),
                         pipeline._Tracker.of([src], None), threading.Event(), Geometry(2 * _MIB, 4, 2))
    finally:
        stop.set()
        sampler.join()
        os.close(fd)
    assert dst[0].tobytes() == data.tobytes()
    device_ring.flush_unmaps()  # "end": the mapping is dropped after the load, on a thread of its own
    with open("/proc/self/maps") as f:
        assert str(path) not in f.read()
    assert _status("RssFile") - before < 16 * _MIB
    if unmap == "chunk":
        assert peak[0] < 16 * _MIB  # the file's pages were unmapped chunk by chunk, not held
    else:
        assert peak[0] > n // 2  # held mapped for the whole load (the page cache's pages, not new memory)


def test_a_ring_lingers_briefly_for_the_next_load_then_unlocks_everything(layout, ops, emu, monkeypatch):
    import time

    monkeypatch.setattr(rings, "LINGER_SECONDS", 0.3)
    _load(layout, ops)
    first = emu.stats()["registrations"]
    assert rings.locked_bytes() > 0
    dst, _, _ = _load(layout, ops)  # a loop of loads (get_tensor per key) sets the ring up once
    _check(layout, dst)
    assert emu.stats()["registrations"] == first
    deadline = time.monotonic() + 10
    while emu.stats()["registered"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert emu.stats()["registered"] == 0 and emu.stats()["events"] == 0
    assert rings.locked_bytes() == 0


def test_kept_rings_are_reused_and_released(layout, ops, emu):
    rings.keep_rings(True)
    try:
        _load(layout, ops)
        first = emu.stats()["registrations"]
        assert emu.stats()["registered"] > 0  # kept locked for the next load
        dst, _, _ = _load(layout, ops)
        _check(layout, dst)
        assert emu.stats()["registrations"] == first  # nothing locked again
    finally:
        rings.keep_rings(False)
    assert emu.stats()["registered"] == 0  # turning keeping off closes the kept ring
    _clean(emu)


# -- the plan --------------------------------------------------------------------------------------


def _plan(pieces, chunk):
    p = chunk_plan.Pieces([], {}, None)
    p.file = np.array([f for f, _, _, _ in pieces], np.int32)
    p.off = np.array([o for _, o, _, _ in pieces], np.int64)
    p.len = np.array([n for _, _, n, _ in pieces], np.int64)
    p.dst = np.array([d for _, _, _, d in pieces], np.uint64)
    return chunk_plan.plan(p, chunk)


def test_plan_cuts_on_aligned_blocks_and_merges_contiguous_pieces():
    # two tensors back to back in the file and on the device: one segment per block
    c_file, c_seg, s_pos, s_off, s_len, s_dst = _plan([(0, 100, 5000, 1000), (0, 5100, 7000, 6000)], 4096)
    assert list(s_off) == [100, 4096, 8192] and list(s_len) == [3996, 4096, 12100 - 8192]
    assert list(c_seg) == [0, 1, 2, 3] and list(s_pos) == [0, 0, 0]
    assert list(s_dst) == [1000, 1000 + 3996, 1000 + 8092]


def test_plan_packs_gaps_and_keeps_files_apart():
    pieces = [(0, 0, 100, 0), (0, 1000, 100, 5000), (1, 200, 50, 9000)]
    c_file, c_seg, s_pos, s_off, s_len, s_dst = _plan(pieces, 4096)
    assert list(c_file) == [0, 1] and list(c_seg) == [0, 2, 3]
    assert list(s_pos) == [0, 100, 0] and list(s_off) == [0, 1000, 200]


def test_ring_checks_its_arguments(emu):
    from engine.gpu import _cudart, _ring

    rt = _cudart.Runtime(emu.path)
    with pytest.raises(ValueError):
        _ring.ChunkRing(rt, 0, 0, 1000, 2, 1)
    with pytest.raises(OSError, match="cannot open"):
        _cudart.Runtime("/nonexistent/libcudart.so")
    stream = emu.new_stream()
    try:
        with _ring.ChunkRing(rt, 0, stream, 4096, 2, 1) as ring:
            z32, z64 = np.zeros(1, np.int32), np.zeros(2, np.int64)
            with pytest.raises(ValueError, match="does not fit"):
                ring.run(z32, z64, np.array([4000], np.int64), np.zeros(1, np.int64), np.array([200], np.int64),
                         np.zeros(1, np.uint64), np.array([0], np.int32), np.zeros(1, np.uint64),
                         np.zeros(1, np.int64), np.zeros(1, np.uint8))
    finally:
        emu.destroy_stream(stream)


def test_geometry_from_the_environment(monkeypatch):
    monkeypatch.setenv("ENGINE_RING", "2,36,12")
    assert default_geometry() == Geometry(2 * _MIB, 36, 12)
    monkeypatch.setenv("ENGINE_RING", "2,0,12")
    with pytest.raises(ValueError):
        default_geometry()
    monkeypatch.delenv("ENGINE_RING")
    g = default_geometry(16)
    assert g.threads == 12 and g.pinned_bytes <= MAX_RING_BYTES
    assert default_threads(2) == 2


@pytest.mark.parametrize("stores", ["stream", "cached"])
def test_either_kind_of_store_lands_every_byte(layout, ops, emu, stores, monkeypatch):
    monkeypatch.setenv("ENGINE_RING_STORES", stores)
    monkeypatch.setenv("ENGINE_COPY_SOURCE", "mmap")  # the stores apply to copies out of a mapping
    dst, _, _ = _load(layout, ops)
    _check(layout, dst)
    _clean(emu)


def test_stores_are_checked(monkeypatch):
    monkeypatch.setenv("ENGINE_RING_STORES", "fast")
    with pytest.raises(ValueError, match="ENGINE_RING_STORES"):
        stores()


# -- progress: a tensor is reported only once every copy into it has completed ---------------------


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    """24 tensors of 64 KiB after a 64 KiB header: with 64 KiB chunks, one tensor per chunk."""
    n, size = 24, 64 * 1024
    data = np.random.default_rng(5).integers(0, 256, size * (n + 1), dtype=np.uint8)
    path = tmp_path_factory.mktemp("aligned") / "a.bin"
    path.write_bytes(data.tobytes())
    begins = np.arange(n, dtype=np.int64) * size
    return str(path), begins, begins + size, data, size


@pytest.mark.parametrize("chunks,threads", [(2, 1), (3, 2), (4, 2), (32, 2)])
def test_no_tensor_is_reported_before_its_bytes_have_landed(aligned, ops, emu, chunks, threads, monkeypatch):
    """Copies much slower than the ring's poll: the bytes of each tensor are compared at the
    moment it is reported, not at the end (a report ahead of the last copy into a tensor would
    hand a consumer on another stream bytes still in flight)."""
    monkeypatch.setenv("ENGINE_COPY_SOURCE", "pread")
    path, begins, ends, data, size = aligned
    emu.delay(0.03)
    dst = {r: np.zeros(size, np.uint8) for r in range(len(begins))}
    early: list[int] = []
    order: list[int] = []
    times: list[float] = []

    def on_complete(row):
        order.append(row)
        times.append(time.monotonic())
        if dst[row].tobytes() != data[size + begins[row] : size + ends[row]].tobytes():
            early.append(row)

    fd = os.open(path, os.O_RDONLY)
    try:
        src = pipeline.Source(fd, path, plan_reads(begins, ends, range(len(begins)), size, 1 << 20))
        device_ring.load([src], pipeline.Destination(device_targets=dst, device_ops=ops),
                         pipeline._Tracker.of([src], on_complete), threading.Event(),
                         Geometry(size, chunks, threads))
    finally:
        os.close(fd)
    end = time.monotonic()
    assert sorted(order) == list(range(len(begins)))
    assert early == [], f"{len(early)} of {len(begins)} tensors reported before their bytes landed"
    # the ring never has more chunks in flight than it has slots (one copy per chunk here)
    assert emu.stats()["max_queued"] <= chunks
    # progress came while the load went on (24 copies of 30 ms), not all at its end; with more
    # slots than chunks every chunk is issued at once, and the reports come while the ring
    # waits for its stream
    assert min(times) < end - 0.2
    _clean(emu)


# -- warm start, the record of a load, the per-key loop ---------------------------------------------


def test_a_ring_is_page_locked_in_a_few_calls_and_can_be_prepared_ahead(layout, ops, emu):
    g = Geometry(64 * 1024, 32, 2)
    took = device_ring.prepare(ops, g)
    assert took[1] == 6  # slot 0, then blocks of 1, 2, 4, 8, 16 slots
    assert emu.stats()["registrations"] == 6 and rings.locked_bytes() == 32 * 64 * 1024
    assert device_ring.prepare(ops, g) == (0.0, 0)  # already set up: nothing more
    with load_records() as records:
        dst, _, stats = _load(layout, ops, geometry=g)
    _check(layout, dst)
    assert emu.stats()["registrations"] == 6  # the load found its ring ready
    assert len(records) == 1 and records[0].as_dict() == stats
    assert not records[0].cold and records[0].lock_calls == 0 and records[0].lock_s == 0
    _clean(emu)


def test_a_cold_load_records_its_page_locking_and_what_it_did(layout, ops, emu, monkeypatch):
    monkeypatch.setenv("ENGINE_COPY_SOURCE", "pread")
    g = Geometry(64 * 1024, 8, 2)
    with load_records() as records:
        dst, _, stats = _load(layout, ops, geometry=g)
    _check(layout, dst)
    r = records[0]
    assert r.cold and r.lock_calls == 4 and r.lock_s > 0  # slots 0, 1, 2-3, 4-7
    assert r.bytes == sum(len(a) for a in dst.values()) == r.pread_bytes and r.mmap_bytes == 0
    assert r.chunks > 8 and r.threads == 2 and r.slots == 8 and r.chunk_bytes == 64 * 1024
    assert r.seconds > 0 and r.fill_s > 0 and r.source == "pread" and r.unmap == "end" and not r.pageable
    _clean(emu)


def test_a_load_started_while_its_ring_is_prepared_waits_for_that_ring(layout, ops, emu, monkeypatch):
    g = Geometry(64 * 1024, 4, 2)
    key = device_ring._ring_key(ops, g)
    assert rings.KEPT.pending(key)  # as prepare() marks it before setting the ring up
    out: list = []
    t = threading.Thread(target=lambda: out.append(_load(layout, ops, geometry=g)))
    t.start()
    time.sleep(0.1)
    assert t.is_alive() and emu.stats()["registrations"] == 0  # waiting, not setting up its own
    ring = rings.new_ring(ops, g)
    ring.lock_all()
    rings.KEPT.give(key, ring, linger=False)
    t.join(10)
    _check(layout, out[0][0])
    assert emu.stats()["registrations"] == 3  # the prepared ring's blocks, no second ring
    assert out[0][2]["cold"] and out[0][2]["setup_s"] >= 0.05  # it waited (0.1 s) for the set-up
    _clean(emu)


def test_small_loads_wake_no_more_threads_than_they_have_chunks(layout, ops, emu):
    path, begins, ends, data = layout
    g = Geometry(2 * _MIB, 4, 4)
    with load_records() as records:
        _load(layout, ops, rows=[5], geometry=g)        # one chunk: the calling thread fills it
        _load(layout, ops, rows=[0, 59], geometry=g)    # two chunks: two threads
        dst, _, _ = _load(layout, ops, geometry=g)
    assert [r.chunks for r in records[:2]] == [1, 2] and [r.threads for r in records] == [0, 2, 4]
    _check(layout, dst)
    _clean(emu)


def test_a_loop_of_loads_starts_no_thread_per_load(layout, ops, emu):
    g = Geometry(64 * 1024, 4, 2)
    _load(layout, ops, rows=[1], geometry=g)
    threads = threading.active_count()
    for r in range(2, 40):
        if layout[2][r] > layout[1][r]:
            dst, done, _ = _load(layout, ops, rows=[r], geometry=g)
            _check(layout, dst)
            assert done == [r]
    assert threading.active_count() <= threads  # the ring lingers on one reaper thread, no timer per load
    _clean(emu)


def test_a_held_mapping_is_copied_from_and_left_mapped(layout, ops, emu, monkeypatch):
    import mmap

    monkeypatch.setenv("ENGINE_COPY_SOURCE", "mmap")
    path, begins, ends, data = layout
    fd = os.open(path, os.O_RDONLY)
    held = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    try:
        rows = [r for r in range(60) if ends[r] > begins[r]]
        for r in rows[:5]:
            dst = {r: np.zeros(int(ends[r] - begins[r]), np.uint8)}
            src = pipeline.Source(fd, path, plan_reads(begins, ends, [r], 64, 1 << 20), mapping=held)
            with load_records() as records:
                device_ring.load([src], pipeline.Destination(device_targets=dst, device_ops=ops),
                                 pipeline._Tracker.of([src], None), threading.Event(), _SMALL)
            _check(layout, dst)
            assert records[0].mmap_bytes == len(dst[r])
        assert not held.closed and held[:16] == data[:16].tobytes()  # still the caller's, still mapped
    finally:
        held.close()
        os.close(fd)
    _clean(emu)


def test_unmap_mode_is_checked(monkeypatch):
    assert device_ring.unmap_mode() == "end"
    monkeypatch.setenv("ENGINE_RING_UNMAP", "never")
    with pytest.raises(ValueError, match="ENGINE_RING_UNMAP"):
        device_ring.unmap_mode()


@pytest.mark.parametrize("unmap", ["end", "chunk"])
@pytest.mark.parametrize("source", ["mmap", "auto"])
def test_either_unmap_mode_lands_every_byte(layout, ops, emu, unmap, source, monkeypatch):
    monkeypatch.setenv("ENGINE_RING_UNMAP", unmap)
    monkeypatch.setenv("ENGINE_COPY_SOURCE", source)
    emu.delay(0.0002)
    dst, done, stats = _load(layout, ops, geometry=Geometry(256 * 1024, 4, 2))
    _check(layout, dst)
    assert stats["unmap"] == unmap and stats["mmap_bytes"] > 0
    _clean(emu)


def test_a_get_tensor_loop_on_a_device_maps_the_file_once_and_reports_right_bytes(ops, emu, tmp_path, monkeypatch):
    """accelerate's loop (``safe_open(f, device=...)``, ``get_tensor`` per key) through the
    engine's handle down to the ring: right bytes per key, one mapping for the handle's life,
    no thread started per key, and the mapping gone with the handle."""
    from emucudart import EmulatedSink

    import engine

    monkeypatch.setenv("ENGINE_COPY_SOURCE", "mmap")
    rng = np.random.default_rng(9)
    tensors = {f"t{i}": rng.standard_normal((i % 7 + 1, 300)).astype(np.float32) for i in range(40)}
    path = str(tmp_path / "m.safetensors")
    engine.save_file(tensors, path)
    h = engine.safe_open(path, framework="np")
    h._sink_obj = EmulatedSink(ops)
    with load_records() as records:
        h.get_tensor("t0")
        threads = threading.active_count()
        for name, want in tensors.items():
            np.testing.assert_array_equal(h.get_tensor(name), want)
    assert threading.active_count() <= threads
    assert len(records) == 41 and all(r.threads == 0 and r.mmap_bytes == r.bytes for r in records)
    with open("/proc/self/maps") as f:
        assert f.read().count(path) == 1  # the handle's one read-only mapping
    h.close()
    with open("/proc/self/maps") as f:
        assert path not in f.read()
    _clean(emu)


# -- what a real driver holds per thread and per device (the emulator as strict as one) ------------


def _into(layout, ops, dst, geometry=_SMALL):
    """:func:`_load` into the caller's own targets ``dst`` (row -> array)."""
    path, begins, ends, _ = layout
    fd = os.open(path, os.O_RDONLY)
    try:
        src = pipeline.Source(fd, path, plan_reads(begins, ends, sorted(dst), 64, 1 << 20))
        tracker = pipeline._Tracker.of([src], lambda row: None)
        device_ring.load([src], pipeline.Destination(device_targets=dst, device_ops=ops), tracker,
                         threading.Event(), geometry)
    finally:
        os.close(fd)


@pytest.fixture
def two_gpus(emu):
    emu.reset()
    emu.devices(2)
    yield emu
    rings.release_rings()
    emu.devices(1)
    emu.reset()


def test_a_load_leaves_no_not_ready_error_on_the_callers_thread(layout, ops, emu):
    """The issuing thread queries events whose copies are still running (every poll, and
    right after the last copy is issued): "not ready", which the runtime records as the
    thread's last error, must not be left for the caller's next ``cudaGetLastError`` (torch
    checks every kernel launch with it)."""
    emu.delay(0.002)
    dst, _, _ = _load(layout, ops)
    _check(layout, dst)
    assert emu.last_error() == 0


def test_setting_up_a_ring_and_loading_leave_the_callers_device_and_context(layout, two_gpus):
    emu = two_gpus
    ops = EmulatedRingOps(emu, device=1)
    try:
        emu.set_device(0)
        ctx = emu.current_context()
        device_ring.prepare(ops, _SMALL)  # the ring made and page-locked on this thread
        assert (emu.current_device(), emu.current_context()) == (0, ctx)
        dst, _, _ = _load(layout, ops)
        _check(layout, dst)
        assert (emu.current_device(), emu.current_context()) == (0, ctx)
        assert emu.stats()["wrong_device"] == 0
    finally:
        rings.release_rings()
        ops.close()


def test_no_context_is_made_on_a_gpu_nobody_asked_for(layout, two_gpus, monkeypatch):
    """A rank on GPU 1 loads from a thread with no device of its own (as ``engine.stream``'s
    worker), and its ring is closed later by the reaper: no context appears on GPU 0 (in a
    torchrun job, a few hundred MiB of GPU 0 per rank; in exclusive-process mode, a failure)."""
    emu = two_gpus
    monkeypatch.setattr(rings, "LINGER_SECONDS", 0.05)
    ops = EmulatedRingOps(emu, device=1)
    try:
        emu.set_device(1)  # the rank's own device, as torch.cuda.set_device(local_rank)
        out: dict = {}

        def worker() -> None:
            out["dst"] = _load(layout, ops)[0]
            # the thread as it was: no context current, its runtime device untouched (0)
            out["after"] = (emu.current_context(), emu.current_device())

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        _check(layout, out["dst"])
        assert out["after"] == (None, 0)
        deadline = time.monotonic() + 10
        while (emu.stats()["events"] or emu.stats()["registered"]) and time.monotonic() < deadline:
            time.sleep(0.01)  # the reaper closes the ring
        assert emu.stats()["events"] == 0 and emu.stats()["registered"] == 0
        assert emu.contexts(1) == 1
        assert emu.contexts(0) == 0, "a context was made on GPU 0"
        assert emu.current_device() == 1
    finally:
        rings.release_rings()
        ops.close()


@pytest.mark.parametrize("consumer", ["default stream", "a stream of its own"])
def test_copies_wait_for_the_work_queued_on_the_consumers_stream(layout, emu, consumer):
    """A kernel still queued on the consumer's stream when the load starts (a ``zero_()`` of a
    ``load_into`` target, the last user of a block the caching allocator hands out again)
    writes the targets before the ring's copies do, not after: the file's bytes are what stay."""
    emu.reset()
    stream = 0 if consumer == "default stream" else emu.new_stream(0)
    ops = None
    try:
        _, begins, ends, _ = layout
        dst = {r: np.zeros(int(ends[r] - begins[r]), np.uint8) for r in range(len(begins))}
        emu.set_device(0)
        for i, target in enumerate(dst.values()):  # the first is slow: the rest queue behind it
            emu.launch_fill(stream, target, 0xA5, 0.3 if i == 0 else 0.0)
        ops = EmulatedRingOps(emu, consumer=stream)  # made for the load, as a framework's are
        _into(layout, ops, dst)
        assert emu.synchronize(stream) == 0  # the consumer waits for its own stream, as it would
        _check(layout, dst)
    finally:
        rings.release_rings()
        if ops is not None:
            ops.close()
        if stream:
            emu.destroy_stream(stream, 0)
    _clean(emu)


def test_copies_follow_the_callers_per_thread_stream_when_another_thread_runs_the_ring(layout, emu):
    """With per-thread default streams (handle 2 means "the calling thread's"), the fence is
    recorded on the caller's thread when the load is set up, not by the thread that runs the
    ring (``engine.stream``'s worker): the copies still follow the caller's queued work."""
    emu.reset()
    ops = None
    try:
        _, begins, ends, _ = layout
        dst = {r: np.zeros(int(ends[r] - begins[r]), np.uint8) for r in range(len(begins))}
        emu.set_device(0)
        for i, target in enumerate(dst.values()):
            emu.launch_fill(2, target, 0x5A, 0.3 if i == 0 else 0.0)
        ops = EmulatedRingOps(emu, consumer=2)
        worker = threading.Thread(target=_into, args=(layout, ops, dst))
        worker.start()
        worker.join()
        assert emu.synchronize(2) == 0
        _check(layout, dst)
    finally:
        rings.release_rings()
        if ops is not None:
            ops.close()
    _clean(emu)


def test_a_forked_child_forgets_inherited_rings_without_touching_them(layout, ops, emu, tmp_path):
    """A child forked while rings are kept (a DataLoader worker, multiprocessing's fork) has
    none of their threads: releasing them at its exit must not wait for those threads (or
    call the parent's driver), and host loads work there as anywhere."""
    import engine.numpy

    rings.keep_rings(True)
    try:
        dst, _, _ = _load(layout, ops)
        _check(layout, dst)
        assert emu.stats()["registered"] > 0  # kept: its threads wait for the next load
        saved = tmp_path / "small.safetensors"
        engine.numpy.save_file({"w": np.arange(10, dtype=np.float32)}, str(saved))
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                rings.release_rings()  # what exit does (atexit)
                got = engine.numpy.load_file(str(saved))["w"]
                code = 0 if np.array_equal(got, np.arange(10, dtype=np.float32)) else 2
            finally:
                os._exit(code)
        deadline = time.monotonic() + 20
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.02)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung releasing the rings it inherited")
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        dst, _, _ = _load(layout, ops)  # the parent's ring still serves it
        _check(layout, dst)
    finally:
        rings.keep_rings(False)
    _clean(emu)


def test_registration_takes_page_aligned_ranges_and_costs_time(layout, ops, emu):
    """The ring page-locks its chunks in aligned blocks (the emulated runtime refuses any
    other range, and charges for each MiB), once per ring: a prepared ring's load pays none."""
    emu.register_cost(0.002)
    t0 = time.perf_counter()
    device_ring.prepare(ops, Geometry(1 << 20, 8, 2))
    assert time.perf_counter() - t0 >= 8 * 0.002
    with load_records() as records:
        dst, _, _ = _load(layout, ops, geometry=Geometry(1 << 20, 8, 2))
    _check(layout, dst)
    assert records[-1].lock_calls == 0 and not records[-1].pageable
    assert emu.stats()["registrations"] == 4  # slot 0, then blocks of 1, 2 and 4 chunks


@pytest.mark.parametrize("busy", ["copying", "page-locking"])
def test_an_exit_with_device_work_in_flight_ends_it_before_the_runtime_is_torn_down(tmp_path, busy):
    """The interpreter exits while a daemon thread's load is copying (slow copies, its issuing
    thread never taking the GIL to poll) or a ring is being page-locked ahead of a load (slow
    registrations): the engine's exit hook cancels the run natively, waits for it and for the
    set-up, and closes the rings, so that no thread calls the runtime during its teardown (the
    emulator ends the process with status 86 when one does)."""
    import subprocess
    import sys
    from pathlib import Path

    import engine.numpy

    path = tmp_path / "big.safetensors"
    engine.numpy.save_file({f"w{i}": np.full(1 << 20, i, np.uint8) for i in range(16)}, path)
    work = {
        "copying": f"""
emu.delay(0.004)
device_ring.POLL_SECONDS = 1000.0
def work():
    started.set()
    for _ in engine.stream({str(path)!r}, framework="np", device="cuda"):
        pass
""",
        "page-locking": """
emu.register_cost(0.1)
def work():
    started.set()
    device_ring.prepare(sink.ops)
""",
    }[busy]
    code = f"""
import sys, threading, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
import engine, engine.loading.loader
from engine.gpu import device_ring
from emucudart import EmulatedRingOps, EmulatedSink, Emulator
emu = Emulator()
emu.reset()
sink = EmulatedSink(EmulatedRingOps(emu))
engine.loading.loader.get_sink = lambda framework, device: sink
started = threading.Event()
{work}
threading.Thread(target=work, daemon=True).start()
started.wait(30)
time.sleep(0.3)
print("exiting", flush=True)
"""
    ring = "0.0625,4,2" if busy == "copying" else "1,16,2"
    env = dict(os.environ, ENGINE_RING=ring, EMUCUDART_TEARDOWN_MS="1000")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["exiting"], out.stderr[-2000:]
    assert out.returncode == 0, out.stderr[-2000:]


def _mapping_of(address: int, maps: str = "/proc/self/smaps") -> dict | None:
    """The mapping of this process holding ``address``: its range and VmFlags, or None."""
    found = None
    with open(maps) as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                found = {"range": (lo, hi)} if lo <= address < hi else None
                if found is not None and maps.endswith("/maps"):
                    return found
            elif found is not None and line.startswith("VmFlags:"):
                found["flags"] = line.split()[1:]
                return found
    return None


def test_the_rings_chunks_are_not_inherited_by_a_forked_child(ops, emu):
    """The chunks are page-locked and read by the device's DMA: a forked child gets none of
    them (``MADV_DONTFORK``), so that the parent's writes after a fork land in the pages the
    DMA reads, not in copies made for the child, on any kernel or driver."""
    ring = rings.new_ring(ops, _SMALL)
    try:
        view = np.frombuffer(ring.memory(), np.uint8)
        address = view.ctypes.data
        mapping = _mapping_of(address)
        assert mapping is not None and "dc" in mapping["flags"], mapping  # "do not copy on fork"
        assert mapping["range"][1] - address >= ring.chunks * ring.chunk_bytes
        del view
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                code = 0 if _mapping_of(address, "/proc/self/maps") is None else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the child inherited the chunks"
    finally:
        ring.close()
    _clean(emu)


def test_the_rings_copies_never_wait_behind_other_work_on_a_frameworks_pool_stream(layout, emu):
    """A framework's stream for the ring may be one of its pool's, handed out round-robin to
    others too (torch's ``torch.cuda.Stream()``: ProcessGroupNCCL draws from the same pool): a
    collective queued there whose peer waits for this load must not hold back the load's
    copies or its end.  The ring copies on a stream of its own."""
    emu.reset()
    rings.release_rings()  # no ring kept from another test: this load sets one up
    pool = emu.new_stream(0)

    class PoolOps(EmulatedRingOps):
        def ring_stream(self):  # what the framework hands out: the stream the collective is on
            return pool, None

    ops = PoolOps(emu)
    flag = np.zeros(1, np.int32)
    emu.wait_flag(pool, flag)  # the collective: runs until its peer answers, after this load
    done: list = []
    worker = threading.Thread(target=lambda: done.append(_load(layout, ops)[0]), daemon=True)
    try:
        worker.start()
        worker.join(20)
        finished = not worker.is_alive()
    finally:
        flag[0] = 1  # the peer answers
        worker.join(30)
        assert emu.synchronize(pool) == 0
        rings.release_rings()
        ops.close()
        emu.destroy_stream(pool, 0)
    assert finished, "the load waited behind the collective on a shared stream"
    _check(layout, done[0])
    _clean(emu)
