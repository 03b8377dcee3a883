"""Remote loads to a device through the chunk ring (engine.gpu.device_ring with a remote file's
connections as the chunks' fillers), against nginx (HTTP and path-style S3) and
tests/rangeserver.py (dropped connections, truncated bodies, a server that ignores Range), on
the emulated CUDA runtime (tests/emucudart: copies run later on a stream thread and read
their source only then, so a chunk reused or reported early would show as wrong bytes)."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import warnings

import numpy as np
import pytest

import engine
import engine.loading.fill
import engine.loading.loader
from engine.errors import RangeIgnoredWarning, ReadError
from engine.gpu import chunk_plan, device_ring, rings
from engine.gpu.geometry import Geometry, _default_geometry
from engine.gpu.records import load_records
from engine.loading import pipeline
from engine.net.retry import Retry

sys.path.insert(0, os.path.dirname(__file__))
from emucudart import EmulatedRingOps, EmulatedSink, Emulator  # noqa: E402
from rangeserver import serving  # noqa: E402
from servers import nginx_serving  # noqa: E402

FAST = Retry(attempts=4, base=0.001, cap=0.01)
INDEX = "model.safetensors.index.json"
#: 64 KiB chunks, 4 of them: a checkpoint of a few MiB cycles every slot many times
SMALL = 64 * 1024


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Random bytes in tensors of awkward sizes (none a multiple of the chunk), in 3 shards."""
    root = tmp_path_factory.mktemp("remote-ring")
    rng = np.random.default_rng(47)
    sd = {f"layers.{i}.w": rng.integers(0, 256, int(n), dtype=np.uint8)
          for i, n in enumerate(rng.integers(1, 300_000, 30))}
    sd["empty"] = np.zeros(0, np.uint8)
    engine.save_sharded({k: v for k, v in sd.items()}, root / "sharded", max_shard_size=1_500_000, fsync=False)
    assert len(list((root / "sharded").glob("*.safetensors"))) >= 3
    shutil.copytree(root / "sharded", root / "bucket" / "ckpt")
    return root, sd


@pytest.fixture(scope="module")
def nginx(checkpoint):
    with nginx_serving(checkpoint[0]) as server:
        yield server


@pytest.fixture(scope="module")
def flaky(checkpoint):
    with serving(str(checkpoint[0])) as server:
        yield server


@pytest.fixture
def rangeserver(flaky):
    yield flaky.bulk()
    flaky.bulk()


@pytest.fixture(scope="module")
def emu():
    return Emulator()


@pytest.fixture
def device(emu, monkeypatch):
    """Loads to ``device="emulated"`` land in the emulated runtime's memory through the ring
    (the one device path)."""
    emu.reset()
    ops = EmulatedRingOps(emu)
    sink = EmulatedSink(ops)
    monkeypatch.setattr(engine.loading.loader, "get_sink", lambda framework, device: sink)
    monkeypatch.setenv("ENGINE_RING", "0.0625,4,2")  # 64 KiB chunks, 4 slots
    _default_geometry.cache_clear()
    yield ops
    _default_geometry.cache_clear()
    rings.release_rings()
    ops.close()
    emu.reset()


def _released(emu) -> None:
    rings.release_rings()
    st = emu.stats()
    assert st["registered"] == 0, st  # nothing stays page-locked
    assert st["events"] == 0, st
    assert st["pageable"] == 0, st  # every copy came out of page-locked chunks
    assert rings.locked_bytes() == 0
    assert not [t for t in threading.enumerate() if t.name == "engine-remote-ring"]


def _stream_checked(url, sd, **kw):
    """``engine.stream`` to the emulated device, each tensor's bytes compared when it is
    handed out (a report ahead of its last copy would show here, with slow copies)."""
    got, early = {}, []
    for name, arr in engine.stream(url, device="emulated", framework="np", **kw):
        if np.asarray(arr).view(np.uint8).tobytes() != sd[name].tobytes():
            early.append(name)
        got[name] = np.array(arr, copy=True)
    return got, early


@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_a_remote_load_to_a_device_goes_through_the_ring(checkpoint, nginx, device, emu, monkeypatch, scheme):
    _, sd = checkpoint
    if scheme == "s3":
        monkeypatch.setenv("AWS_ENDPOINT_URL", nginx.base)
        monkeypatch.setenv("AWS_NO_SIGN_REQUEST", "1")
        monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull + "-none")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull + "-none")
        url = f"s3://bucket/ckpt/{INDEX}"
    else:
        url = nginx.url("sharded/")
    emu.delay(0.002)  # copies slower than the fills: reports and slot reuse must wait for them
    with warnings.catch_warnings(), load_records() as records:
        warnings.simplefilter("error", RangeIgnoredWarning)
        got, early = _stream_checked(url, sd, connections=3)
    assert early == []
    assert sorted(got) == sorted(sd)
    assert all(got[k].tobytes() == sd[k].tobytes() for k in sd)
    total = sum(v.nbytes for v in sd.values())
    assert [r.source for r in records] == ["network"]
    assert records[0].network_bytes == records[0].bytes == total
    assert records[0].pread_bytes == records[0].mmap_bytes == 0 and records[0].threads == 3
    assert records[0].chunks > 4  # every slot was reused
    assert emu.stats()["bytes"] == total  # each byte crossed to the device once
    _released(emu)


class EmulatedArray:
    """A tensor of a framework the engine does not know, in the emulated device's memory."""

    def __init__(self, nbytes):
        self.data = np.zeros(nbytes, np.uint8)


def test_load_into_device_tensors_from_a_url_through_the_ring(checkpoint, nginx, device, emu, monkeypatch):
    """Destinations that are not one block (a model's parameters): many pieces per chunk, one
    GET per run of the file, landing in each tensor."""
    from engine.base import dtypes
    from engine.sinks._targets import FillTarget

    _, sd = checkpoint
    ops = device

    class EmulatedTarget(FillTarget):
        device = ("emulated", 0)

        def __init__(self, arr):
            super().__init__(arr, dtypes.BY_NAME["U8"].code, (len(arr.data),), True, "emulated")

        def device_bytes(self):
            return self.tensor.data

        def device_ops(self):
            return ops

    real = engine.loading.fill.fill_target
    monkeypatch.setattr(engine.loading.fill, "fill_target",
                        lambda x: EmulatedTarget(x) if isinstance(x, EmulatedArray) else real(x))
    dst = {k: EmulatedArray(v.nbytes) for k, v in sd.items()}
    with load_records() as records:
        filled = engine.load_into(nginx.url(f"sharded/{INDEX}"), dst, strict=True, connections=2)
    assert sorted(filled) == sorted(sd)
    assert all(dst[k].data.tobytes() == sd[k].tobytes() for k in sd)
    assert [r.source for r in records] == ["network"]
    assert records[0].network_bytes == sum(v.nbytes for v in sd.values())
    _released(emu)


def test_a_selection_with_gaps_receives_only_what_it_needs(checkpoint, nginx, device, emu):
    """Every other tensor: the chunks hold runs of the file with gaps between them (small gaps
    received and dropped within one GET, as read_runs does)."""
    _, sd = checkpoint
    names = sorted(sd)[::2]
    with load_records() as records:
        got, early = _stream_checked(nginx.url(f"sharded/{INDEX}"), sd, connections=2, names=names)
    assert early == [] and sorted(got) == names
    assert all(got[k].tobytes() == sd[k].tobytes() for k in got)
    assert records[0].network_bytes == sum(sd[k].nbytes for k in names)
    _released(emu)


def test_a_connection_dropped_mid_chunk_is_retried(checkpoint, rangeserver, device, emu):
    _, sd = checkpoint
    rangeserver.faults = {3: "reset", 7: "short", 11: "503"}
    got, early = _stream_checked(rangeserver.url("sharded/"), sd, connections=3, retry=FAST, timeout=5.0)
    assert early == [] and sorted(got) == sorted(sd)
    assert all(got[k].tobytes() == sd[k].tobytes() for k in sd)
    # the dropped answers sent part of their bodies before they broke
    assert {n for n, _, _ in rangeserver.sent} >= {3, 7}
    assert all(0 < sent for n, _, sent in rangeserver.sent if n in (3, 7))
    _released(emu)


def test_a_server_that_ignores_range_streams_each_file_into_the_ring(checkpoint, rangeserver, device, emu):
    _, sd = checkpoint
    rangeserver.modes["*"] = "ignore-range"
    with pytest.warns(RangeIgnoredWarning), load_records() as records:
        got, early = _stream_checked(rangeserver.url("sharded/"), sd, connections=3, retry=FAST)
    assert early == [] and sorted(got) == sorted(sd)
    assert all(got[k].tobytes() == sd[k].tobytes() for k in sd)
    assert records[0].source == "network"
    # one whole-file answer per shard serves every chunk of it (plus the header's, handed over)
    shards = len(list((checkpoint[0] / "sharded").glob("*.safetensors")))
    data = [r for r in rangeserver.requests if r["path"].endswith(".safetensors")]
    assert len(data) <= 3 * shards
    _released(emu)


def test_a_truncated_body_is_a_read_error_naming_the_file_and_range(checkpoint, rangeserver, device, emu):
    _, sd = checkpoint
    rangeserver.faults = lambda n, path, first, last: "short" if n >= 2 else None
    with pytest.raises(ReadError) as err:
        dict(engine.stream(rangeserver.url("sharded/"), device="emulated", framework="np", connections=2,
                           retry=Retry(attempts=2, base=0.001, cap=0.01)))
    assert err.value.reason == "ShortRead"
    assert "/sharded/model-" in str(err.value) and "bytes " in str(err.value) and "truncated" in str(err.value)
    assert err.value.offset is not None
    _released(emu)


def test_a_permanent_failure_is_the_error_even_while_others_retry(checkpoint, rangeserver, device, emu):
    _, sd = checkpoint
    rangeserver.faults = lambda n, path, first, last: "403" if n == 3 else "503"
    slow = Retry(attempts=4, base=5.0, cap=5.0)  # waits the load must not sit through
    with pytest.raises(ReadError) as err:
        dict(engine.stream(rangeserver.url("sharded/"), device="emulated", framework="np", connections=3,
                           retry=slow))
    assert err.value.reason == "AccessDenied"
    assert rangeserver.data_gets < 6  # the others stopped at their first backoff
    _released(emu)


def test_a_cancel_stops_the_connections_and_releases_the_ring(checkpoint, rangeserver, device, emu):
    """A consumer that stops after the first tensor: the load is cancelled while requests are
    in flight (each answer waits 50 ms), and returns having released it all."""
    _, sd = checkpoint
    rangeserver.modes["*"] = "delay:0.05"
    it = engine.stream(rangeserver.url("sharded/"), device="emulated", framework="np", connections=2, retry=FAST)
    got = [name for name, _ in zip(it, range(3), strict=False)]
    it.close()  # stops the load and waits for it
    assert len(got) == 3
    total = sum(v.nbytes for v in sd.values())
    assert rangeserver.data_gets < total // SMALL  # not every chunk was asked for
    _released(emu)


def test_cache_dir_writes_the_copies_from_the_ring_and_a_second_load_reads_them(checkpoint, nginx, device, emu,
                                                                                 tmp_path):
    _, sd = checkpoint
    cache = tmp_path / "cache"
    with load_records() as first:
        got, early = _stream_checked(nginx.url("sharded/"), sd, cache_dir=str(cache))
    assert early == [] and all(got[k].tobytes() == sd[k].tobytes() for k in sd)
    assert [r.source for r in first] == ["network"]
    with load_records() as second:
        got, early = _stream_checked(nginx.url("sharded/"), sd, cache_dir=str(cache))
    assert early == [] and all(got[k].tobytes() == sd[k].tobytes() for k in sd)
    assert [r.source for r in second] != ["network"] and second[0].network_bytes == 0
    _released(emu)


def test_a_ring_load_takes_local_or_remote_files_not_both(device):
    src = pipeline.Source(-1, "x", [], ranges=lambda off, views: None)
    local = pipeline.Source(0, "y", [])
    with pytest.raises(ValueError, match="not both"):
        device_ring.load([src, local], pipeline.Destination(device_targets={}, device_ops=device),
                         pipeline._Tracker({}, None), threading.Event(), Geometry(SMALL, 4, 1))


def test_the_ring_is_set_up_while_the_headers_are_fetched(checkpoint, nginx, device, emu, monkeypatch):
    """A remote load to a device prepares (page-locks) its ring before the headers' requests,
    so the load itself locks nothing."""
    _, sd = checkpoint
    calls = []
    real = device_ring.prepare
    monkeypatch.setattr(device_ring, "prepare", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    with load_records() as records:
        got = dict(engine.stream(nginx.url(f"sharded/{INDEX}"), device="emulated", framework="pt"))
    assert sorted(got) == sorted(sd)
    assert all(np.asarray(got[k]).tobytes() == sd[k].tobytes() for k in sd)
    assert calls == [Geometry(SMALL, 4, 2)]
    assert records[0].lock_calls == 0 and emu.stats()["registrations"] > 0
    _released(emu)


def test_a_failed_copy_stops_the_connections_and_is_a_device_error(checkpoint, nginx, device, emu):
    from engine.errors import DeviceError

    emu.fail_copy(5, asynchronous=True)  # a fault on the device while the connections fill
    with pytest.raises(DeviceError):
        dict(engine.stream(nginx.url(f"sharded/{INDEX}"), device="emulated", framework="np", connections=3))
    _released(emu)


def test_a_filler_that_cannot_set_the_rings_device_fails_the_load_with_that_error(checkpoint, nginx, device, emu):
    """Each connection's filler sets the ring's device before it asks a slot's event; a
    refusal is the load's DeviceError with the runtime's code, and no connection is left."""
    from engine.errors import DeviceError

    emu.fail_set_device(101)  # cudaErrorInvalidDevice
    try:
        with pytest.raises(DeviceError, match="101"):
            dict(engine.stream(nginx.url(f"sharded/{INDEX}"), device="emulated", framework="np", connections=3))
    finally:
        emu.fail_set_device(0)
    _released(emu)


def test_the_rings_external_fill_api_checks_its_use(emu):
    """take() outside a run has nothing to give, filled() names a chunk of the run; a start()
    that starts no filler, or raises, stops the run rather than leaving it waiting."""
    from engine.gpu import _cudart, _ring

    emu.reset()
    ops = EmulatedRingOps(emu)
    stream, _ = ops.ring_stream()
    ring = _ring.ChunkRing(_cudart.Runtime(emu.path), 0, stream, SMALL, 4, 1)
    try:
        assert ring.take() == (-1, 0)
        with pytest.raises(ValueError, match="not being filled"):
            ring.filled(0)
        dst = np.zeros(3 * SMALL, np.uint8)
        c_file, c_seg, s_pos, s_off, s_len, s_dst = chunk_plan.plan(
            type("P", (), {"file": np.zeros(1, np.int32), "off": np.zeros(1, np.int64),
                           "len": np.array([dst.nbytes], np.int64),
                           "dst": np.array([dst.ctypes.data], np.uint64)})(), SMALL)
        plan = (c_file, c_seg, s_pos, s_off, s_len, s_dst, np.full(1, -1, np.int32), np.zeros(1, np.uint64),
                np.zeros(1, np.int64), np.zeros(1, np.uint8))
        with pytest.raises(ValueError, match="start"):
            ring.run(*plan, fillers=2)
        assert ring.run(*plan, fillers=2, start=lambda: 0)[0] == 3

        def broken():
            raise RuntimeError("no threads")

        with pytest.raises(RuntimeError, match="no threads"):
            ring.run(*plan, fillers=2, start=broken)
        # and a run whose one filler fills every chunk, several at a time (no more than half
        # the ring's: it holds them while it waits for the next one's slot), lands them
        src = np.random.default_rng(3).integers(0, 256, dst.nbytes, dtype=np.uint8)
        taken = []

        def fill():
            mem = ring.memory()
            while True:
                k, n = ring.take(3)
                if k < 0:
                    break
                taken.append(n)
                for c in range(k, k + n):
                    pos = (c % ring.chunks) * SMALL
                    mem[pos : pos + SMALL] = src[c * SMALL : (c + 1) * SMALL].tobytes()
                ring.filled(k, n)
            ring.leave()

        t = threading.Thread(target=fill)
        assert ring.run(*plan, fillers=1, start=lambda: t.start() or 1)[0] == 0
        t.join()
        assert dst.tobytes() == src.tobytes() and ring.last_run["net_bytes"] == dst.nbytes
        assert taken == [2, 1]
    finally:
        ring.close()
        ops.close()
    assert emu.stats()["registered"] == 0


def test_an_error_in_the_progress_report_ends_the_connections_waits(device, emu):
    """A tensor's report raising while connections wait between tries (as the remote reader
    does, on the load's cancel): the load ends with that error at once, not after the waits."""
    from engine.planning.plan import plan_reads

    size = SMALL
    data = np.random.default_rng(9).integers(0, 256, 8 * size, dtype=np.uint8)
    cancel = threading.Event()

    def ranges(offset, views):
        if offset >= 2 * size:  # a busy server: wait for the next try, unless the load stops
            cancel.wait(30)
            raise ReadError("busy", reason="ShortRead")
        for v in views:
            v[:] = data[offset : offset + len(v)].tobytes()
            offset += len(v)

    def on_complete(row):
        raise KeyError(f"consumer failed at {row}")

    begins = np.arange(8, dtype=np.int64) * size
    src = pipeline.Source(-1, "http://x/f", plan_reads(begins, begins + size, range(8), 0, 1 << 20),
                          ranges=ranges)
    dst = {r: np.zeros(size, np.uint8) for r in range(8)}
    t0 = time.monotonic()
    with pytest.raises(KeyError, match="consumer failed"):
        device_ring.load([src], pipeline.Destination(device_targets=dst, device_ops=device),
                         pipeline._Tracker.of([src], on_complete), cancel, Geometry(size, 4, 1),
                         connections=3)
    assert time.monotonic() - t0 < 10 and cancel.is_set()
    _released(emu)


def _flip_bit(path, name: str) -> None:
    """Flip one bit in the middle of tensor ``name``'s bytes in file ``path``."""
    import json

    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        begin, end = json.loads(f.read(n))[name]["data_offsets"]
        at = 8 + n + (begin + end) // 2
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x10]))


def test_checksums_are_verified_on_the_chunks_the_connections_fill(checkpoint, nginx, device, emu):
    """A checksummed checkpoint loads through the ring's connections, each tensor checked
    against its CRC before it is handed out; one flipped bit fails the load naming the tensor."""
    from engine.errors import ChecksumError

    root, sd = checkpoint
    good, bad = root / "summed", root / "summed-bad"
    if not good.exists():
        engine.save_sharded(sd, good, max_shard_size=1_500_000, fsync=False, checksums=True)
        shutil.copytree(good, bad)
        victim = "layers.7.w"
        index = __import__("json").loads((bad / INDEX).read_text())
        _flip_bit(bad / index["weight_map"][victim], victim)
    with engine.load_records() as records:
        got, early = _stream_checked(nginx.url(f"summed/{INDEX}"), sd)
    assert sorted(got) == sorted(sd) and early == []
    assert sum(r.network_bytes for r in records) > 0
    with pytest.raises(ChecksumError, match="layers.7.w") as caught:
        for name, _ in engine.stream(nginx.url(f"summed-bad/{INDEX}"), device="emulated", framework="np"):
            assert name != "layers.7.w"
    assert caught.value.tensors == ("layers.7.w",) and caught.value.expected != caught.value.computed
    _released(emu)


def test_a_tensor_damaged_on_the_way_to_a_device_is_read_again(checkpoint, rangeserver, device, emu):
    """A byte flipped in one answer (not on the server's disk): the tensor whose checksum fails
    is read again from the server and put on the device; the load hands out the file's bytes."""
    root, sd = checkpoint
    good = root / "summed"
    if not good.exists():
        engine.save_sharded(sd, good, max_shard_size=1_500_000, fsync=False, checksums=True)
    rangeserver.faults = {2: "flip"}
    got, early = _stream_checked(rangeserver.url(f"summed/{INDEX}"), sd)
    assert sorted(got) == sorted(sd) and early == []
    assert rangeserver.flips == 1
    _released(emu)


def test_a_tensor_read_again_after_the_last_copies_goes_through_a_ring_the_load_still_holds(
        checkpoint, rangeserver, device, emu, monkeypatch):
    """Every tensor reported once the ring's run is over (no report while it runs), and a ring
    given back closed at once: a tensor whose checksum fails is still read again and put on
    the device through the ring, which the load holds until its last report."""
    monkeypatch.setattr(device_ring, "POLL_SECONDS", 1000.0)
    monkeypatch.setattr(rings, "LINGER_SECONDS", 0.0)
    root, sd = checkpoint
    good = root / "summed"
    if not good.exists():
        engine.save_sharded(sd, good, max_shard_size=1_500_000, fsync=False, checksums=True)
    rangeserver.faults = {2: "flip"}
    flips = rangeserver.flips  # the server's count, kept across tests
    got, early = _stream_checked(rangeserver.url(f"summed/{INDEX}"), sd)
    assert sorted(got) == sorted(sd) and early == []
    assert rangeserver.flips == flips + 1
    _released(emu)
