"""engine.format.checksums: per-tensor CRC-32C written on save and verified while loading.

The digests are checked against a plain-Python CRC-32C written here from the definition
(the reflected Castagnoli polynomial), and one flipped bit in any tensor must be caught by
every entry point: lazy handles (mmap and pread), owned loads, ``stream``, ``load_into``,
sharded directories, the device ring (against the emulated runtime), remote loads over
HTTP and path-style S3 (nginx) and their ``cache_dir`` copies."""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
import engine.numpy
from engine.errors import ChecksumError
from engine.format import checksums
from engine.format.header import read_header

sys.path.insert(0, os.path.dirname(__file__))


# -- an independent CRC-32C ----------------------------------------------------------------------


@functools.cache
def _table() -> list[int]:
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        out.append(c)
    return out


def crc32c_py(data: bytes, crc: int = 0) -> int:
    t = _table()
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def test_the_standard_check_value():
    assert checksums.crc32c(b"123456789") == 0xE3069283 == crc32c_py(b"123456789")
    assert checksums.crc32c(b"") == 0


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 4095, 4096 * 3 - 1, 4096 * 3, 4096 * 3 + 17, 50_001])
@pytest.mark.parametrize("shift", [0, 3])
def test_hardware_and_table_agree_with_the_definition(n, shift):
    data = np.random.default_rng(n).integers(0, 256, n + shift, dtype=np.uint8).tobytes()[shift:]
    want = crc32c_py(data)
    assert checksums.crc32c(data) == want
    assert checksums.crc32c(data, hardware=False) == want


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_combine_joins_two_digests(a, b):
    assert checksums.combine(crc32c_py(a), crc32c_py(b), len(b)) == crc32c_py(a + b)
    assert checksums.crc32c(b, checksums.crc32c(a)) == crc32c_py(a + b)


def test_combine_rows_joins_segments_per_group():
    rng = np.random.default_rng(1)
    parts = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in rng.integers(0, 5000, 12)]
    groups = np.array([0, 1, 0, 2, 1, 1, 0, 2, 2, 0, 1, 0], np.int64)
    out = np.zeros(3, np.uint32)
    checksums.combine_rows(np.array([crc32c_py(p) for p in parts], np.uint32),
                           np.array([len(p) for p in parts], np.int64), groups, out)
    for g in range(3):
        assert out[g] == crc32c_py(b"".join(p for p, k in zip(parts, groups, strict=True) if k == g))


# -- writing them ----------------------------------------------------------------------------------


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {f"layers.{i}.weight": rng.standard_normal((i % 5 + 1, 700 * (i + 1))).astype(np.float32)
           for i in range(12)}
    out["embed"] = rng.standard_normal((1500, 1100)).astype(np.float32)  # several 2 MiB lines, 6.6 MB
    out["bias"] = rng.integers(-100, 100, 333, dtype=np.int8)
    out["empty"] = np.zeros((0, 3), np.float32)
    out["ids"] = np.arange(77, dtype=np.int64)
    return out


@functools.lru_cache(maxsize=64)
def _crc32c_py_of(data: bytes) -> int:
    """:func:`crc32c_py` of one tensor's bytes, remembered by those bytes: the definition runs at
    a few MB/s, and the same tensors come back in many tests (the saved file in every flipped-bit
    case, each flipped copy once per entry point, the killed rewrite's data)."""
    return crc32c_py(data)


def digests_py(path) -> dict[str, int]:
    h = read_header(path)
    raw = open(path, "rb").read()
    return {n: _crc32c_py_of(raw[h.data_start + h[n].data_offsets[0] : h.data_start + h[n].data_offsets[1]])
            for n in h.keys()}


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "m.safetensors")
    t = tensors()
    engine.save_file(t, path, metadata={"format": "np"}, checksums=True)
    return path, t


def test_save_file_records_each_tensors_crc32c(saved):
    path, t = saved
    h = read_header(path)
    assert h.metadata["format"] == "np" and h.metadata[checksums.KEY].startswith("2:")
    want = checksums.expected(h)
    got = digests_py(path)
    for r, name in enumerate(h.table.names):
        assert int(want[r]) == got[name], name
    assert checksums.file_digests(path) == got
    assert engine.save(t, metadata={"format": "np"}, checksums=True) == open(path, "rb").read()


def test_the_reference_loads_a_checksummed_file_unchanged(saved):
    ref = pytest.importorskip("safetensors.numpy", reason="the reference safetensors is a test extra")
    path, t = saved
    got = ref.load_file(path)
    assert sorted(got) == sorted(t) and all(np.array_equal(got[k], t[k]) for k in t)
    from safetensors import safe_open

    with safe_open(path, framework="np") as f:
        assert f.metadata()[checksums.KEY] == read_header(path).metadata[checksums.KEY]


def test_add_checksums_rewrites_with_the_same_data(tmp_path):
    path = str(tmp_path / "plain.safetensors")
    t = tensors(3)
    engine.save_file(t, path, metadata={"a": "b"})
    before = read_header(path)
    data = open(path, "rb").read()[before.data_start :]
    assert checksums.add_checksums(path) == len(t)
    after = read_header(path)
    assert open(path, "rb").read()[after.data_start :] == data
    assert after.metadata["a"] == "b"
    assert dict(zip(after.table.names, checksums.expected(after).tolist(), strict=True)) == digests_py(path)
    assert all(np.array_equal(v, t[k]) for k, v in engine.numpy.load_file(path).items())
    checksums.add_checksums(path)  # again: recomputed, the same
    assert read_header(path).metadata == after.metadata


def test_add_checksums_streams_in_bounded_memory(tmp_path, monkeypatch):
    path = str(tmp_path / "big.safetensors")
    engine.save_file({"x": np.ones(48 << 20, np.uint8), "y": np.zeros(3, np.float32)}, path)
    monkeypatch.setattr(checksums, "STEP_BYTES", 1 << 20)
    tracemalloc.start()
    try:
        checksums.add_checksums(path, fsync=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # a few steps of 1 MiB, never the 48 MiB file
    assert checksums.file_digests(path)["x"] == checksums.crc32c(np.ones(48 << 20, np.uint8))


def test_a_killed_add_checksums_leaves_the_old_file(tmp_path):
    import killsave

    path = tmp_path / "m.safetensors"
    t = {f"t{i}": np.full(1 << 20, i, np.float32) for i in range(8)}
    engine.save_file(t, path)
    original = path.read_bytes()
    code = f"""
        from engine.format import checksums
        checksums.STEP_BYTES = 1 << 16  # slow enough to be killed in the middle
        print("ready", flush=True)
        checksums.add_checksums({str(path)!r})
    """
    rng = np.random.default_rng(5)
    landed = 0
    for _ in range(6):
        path.write_bytes(original)
        landed += killsave.kill_during(code, 0.3, rng)
        now = path.read_bytes()
        if now != original:  # the rewrite finished before the kill: the whole new file
            assert checksums.file_digests(str(path)) == digests_py(str(path))
            h = read_header(str(path))
            assert now[h.data_start :] == original[read_header_bytes_start(original) :]
        # an unnamed new file dies with its writer; only a kill between naming the finished
        # file and renaming it over the old one can leave that (complete) file
        others = [e for e in os.listdir(tmp_path) if e != "m.safetensors"]
        assert len(others) <= 1, others
        for e in others:
            os.remove(tmp_path / e)
    assert landed, "no kill landed during a rewrite"


def read_header_bytes_start(raw: bytes) -> int:
    return 8 + int.from_bytes(raw[:8], "little")


@pytest.mark.parametrize("value, why", [
    ("3:00000000", "does not start"),
    ("1:0000", "hex digits where"),
    ("2:" + "0" * 8 * 16, "hex digits where"),  # the header's own CRC missing
    ("1:" + "zz" * 4 * 16, "not hex"),
    ("1:" + "0" * 8 * 15 + " " * 8, "white space"),
])
def test_a_malformed_entry_is_refused_by_name(tmp_path, value, why):
    path = str(tmp_path / "bad.safetensors")
    t = tensors()
    assert len(t) == 16
    engine.save_file(t, path, metadata={checksums.KEY: value})
    for load in (engine.numpy.load_file, functools.partial(engine.numpy.load_file, backend="pread"),
                 lambda p: dict(engine.stream(p, framework="np"))):
        with pytest.raises(ChecksumError, match=why) as e:
            load(path)
        assert e.value.reason == "InvalidChecksums" and e.value.path == path
    assert len(engine.numpy.load_file(path, verify_checksums=False)) == 16


def _damaged_name(path: str, out: str) -> str:
    """``path`` with one byte of its first tensor's name flipped in the header (the JSON still
    parses): the name changes, nothing else."""
    raw = bytearray(open(path, "rb").read())
    name = read_header(path).names[0]
    at = raw.index(f'"{name}"'.encode()) + 1
    raw[at] ^= 0x01  # a letter or digit to another printable character
    with open(out, "wb") as f:
        f.write(raw)
    return read_header(out).names[0]


def test_a_header_damaged_in_a_way_that_still_parses_is_caught(saved, tmp_path):
    """A tensor's name changed by one flipped byte (or a dtype, a shape, an offset, the
    metadata): every load refuses the file by the header's own CRC before handing anything
    out; without verification it loads as it reads."""
    path, t = saved
    bad = str(tmp_path / "renamed.safetensors")
    renamed = _damaged_name(path, bad)
    assert renamed not in t
    loads = (engine.numpy.load_file, functools.partial(engine.numpy.load_file, backend="pread"),
             lambda p: dict(engine.stream(p, framework="np")),
             lambda p: engine.safe_open(p, framework="np").get_tensor(renamed))
    for load in loads:
        with pytest.raises(ChecksumError, match="the header's CRC-32C") as e:
            load(bad)
        assert e.value.reason == "HeaderChecksumMismatch" and e.value.path == bad
    assert renamed in engine.numpy.load_file(bad, verify_checksums=False)


def test_files_of_the_first_format_still_load_and_are_checked(saved, tmp_path):
    """``"1:"`` entries (the tensors' digits alone, no header CRC) load, their tensors checked."""
    path, t = saved
    h = read_header(path)
    value = h.metadata[checksums.KEY]
    old = str(tmp_path / "v1.safetensors")
    engine.save_file(t, old, metadata={"format": "np", checksums.KEY: "1:" + value[2 + 8 :]})
    got = engine.numpy.load_file(old)
    assert all(np.array_equal(got[n], t[n]) for n in t)
    raw = bytearray(open(old, "rb").read())
    raw[read_header_bytes_start(bytes(raw)) + 3] ^= 0x10
    open(old, "wb").write(raw)
    with pytest.raises(ChecksumError) as e:
        engine.numpy.load_file(old)
    assert e.value.reason == "ChecksumMismatch"


def test_the_framework_modules_write_checksums_too(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    import engine.torch

    t = tensors()
    engine.numpy.save_file(t, str(tmp_path / "n.safetensors"), checksums=True)
    assert engine.numpy.save(t, checksums=True) == engine.save(t, checksums=True)
    pt = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in t.items() if v.dtype != np.bool_}
    engine.torch.save_file(pt, str(tmp_path / "t.safetensors"), checksums=True)
    assert engine.torch.save(pt, checksums=True) == open(tmp_path / "t.safetensors", "rb").read()
    for f in ("n", "t"):
        assert read_header(str(tmp_path / f"{f}.safetensors")).metadata[checksums.KEY].startswith("2:")
    got = engine.torch.load_file(str(tmp_path / "t.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in pt.items())


def test_save_file_refuses_a_checksum_key_it_would_write(tmp_path):
    with pytest.raises(engine.SerializationError, match=checksums.KEY):
        engine.save_file({"a": np.zeros(2)}, str(tmp_path / "x.safetensors"), metadata={checksums.KEY: "1:"},
                         checksums=True)


# -- one flipped bit, every entry point ------------------------------------------------------------


def flip(path: str, name: str, where: float = 0.5, bit: int = 3) -> str:
    """A copy of ``path`` with one bit of tensor ``name`` flipped; returns its path."""
    h = read_header(path)
    lo, hi = h[name].data_offsets
    raw = bytearray(open(path, "rb").read())
    raw[h.data_start + lo + int((hi - lo - 1) * where)] ^= 1 << bit
    out = os.path.join(os.path.dirname(path), "flipped-" + os.path.basename(path))
    open(out, "wb").write(raw)
    return out


def _owned(path, **kw):
    return engine.numpy.load_file(path, backend="pread", **kw)


def _mapped(path, **kw):
    return engine.numpy.load_file(path, backend="mmap", **kw)


def _torch(path, **kw):
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    import engine.torch

    return {k: v.numpy() for k, v in engine.torch.load_file(path, backend="pread", **kw).items()
            if v.dtype != torch.bfloat16}


def _streamed(path, **kw):
    return dict(engine.stream(path, framework="np", chunk_bytes=1 << 20, **kw))


def _stats_stream(path, **kw):
    pytest.importorskip("numba", reason="statistics on the way need numba (an optional extra)")
    return {n: x for n, x, _ in engine.stream(path, framework="np", stats=True, **kw)}


def _into(path, **kw):
    t = tensors()
    dst = {k: np.zeros_like(v) for k, v in t.items()}
    engine.load_into(path, dst, **kw)
    return dst


ENTRY_POINTS = {"owned": _owned, "mapped": _mapped, "torch": _torch, "stream": _streamed,
                "stream-stats": _stats_stream, "load_into": _into}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("name, where", [("embed", 0.0), ("embed", 0.61), ("embed", 1.0), ("layers.0.weight", 0.5),
                                         ("bias", 0.2), ("ids", 1.0)])
def test_one_flipped_bit_is_caught_naming_the_tensor(saved, entry, name, where):
    path, t = saved
    load = ENTRY_POINTS[entry]
    assert all(np.array_equal(v, t[k]) for k, v in load(path).items())
    bad = flip(path, name, where)
    with pytest.raises(ChecksumError) as e:
        load(bad)
    err = e.value
    assert err.tensors == (name,) and err.path == bad and err.reason == "ChecksumMismatch"
    assert err.expected == digests_py(path)[name] and err.computed == digests_py(bad)[name]
    assert name in str(err) and f"{err.expected:08x}" in str(err) and f"{err.computed:08x}" in str(err)
    got = load(bad, verify_checksums=False)  # the check skipped: the flipped bytes load
    assert not np.array_equal(got[name], t[name])


def test_stream_never_yields_the_failed_tensor(saved):
    path, t = saved
    bad = flip(path, "layers.5.weight")
    seen = []
    with pytest.raises(ChecksumError):
        for name, x in engine.stream(bad, framework="np", chunk_bytes=1 << 16, threads=1):
            seen.append(name)
            assert np.array_equal(x, t[name])
    assert "layers.5.weight" not in seen


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_lazy_handle_fails_the_bad_tensor_and_loads_the_others(saved, backend):
    path, t = saved
    bad = flip(path, "layers.3.weight")
    with engine.safe_open(bad, framework="np", backend=backend) as f:
        for name in f.keys():
            if name == "layers.3.weight":
                with pytest.raises(ChecksumError, match="layers.3.weight"):
                    f.get_tensor(name)
            else:
                assert np.array_equal(f.get_tensor(name), t[name])
        with pytest.raises(ChecksumError):
            f.get_tensors()
    with engine.safe_open(bad, framework="np", backend=backend, verify_checksums=False) as f:
        assert len(f.get_tensors()) == len(t)
    with checksums.verification(False), engine.safe_open(bad, framework="np", backend=backend) as f:
        assert len(f.get_tensors()) == len(t)


def test_a_sharded_directory_is_checked_shard_by_shard(tmp_path):
    t = tensors(7)
    d = tmp_path / "ckpt"
    engine.save_sharded(t, d, max_shard_size=300_000, fsync=False, checksums=True)
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(shards) >= 3
    assert all(np.array_equal(v, t[k]) for k, v in engine.numpy.load_file(str(d), backend="pread").items())
    victim = "layers.9.weight"
    shard = next(s for s in shards if victim in read_header(str(d / s)))
    bad = flip(str(d / shard), victim)
    os.replace(bad, d / shard)
    for load in (lambda: engine.numpy.load_file(str(d), backend="pread"),
                 lambda: engine.numpy.load_file(str(d)),
                 lambda: dict(engine.stream(str(d), framework="np")),
                 lambda: engine.load_into(str(d), {k: np.zeros_like(v) for k, v in t.items()})):
        with pytest.raises(ChecksumError, match=victim):
            load()
    with engine.safe_open(str(d), framework="np") as f:
        assert np.array_equal(f.get_tensor("embed"), t["embed"])
        with pytest.raises(ChecksumError):
            f.get_tensor(victim)


def test_files_without_checksums_do_no_checksum_work(tmp_path, monkeypatch):
    import engine.loading.pipeline

    path = str(tmp_path / "plain.safetensors")
    engine.save_file(tensors(), path)
    seen = []

    real = engine.loading.pipeline.split_reader

    def spy(threads, **kw):
        inner = real(threads, **kw)
        copy = inner.copy

        class Wrapped:
            def copy(self, *a, **k):
                seen.append(k.get("digests"))
                return copy(*a, **k)

            def close(self):
                inner.close()

        return Wrapped()

    monkeypatch.setattr(engine.loading.pipeline, "split_reader", spy)
    monkeypatch.setattr(checksums, "expected", lambda *a, **k: pytest.fail("parsed checksums of a plain file"))
    engine.numpy.load_file(path, backend="pread")
    assert seen and all(d is None for d in seen)
    engine.save_file(tensors(), path, checksums=True)
    monkeypatch.undo()
    monkeypatch.setattr(engine.loading.pipeline, "split_reader", spy)
    seen.clear()
    engine.numpy.load_file(path, backend="pread")
    assert seen and all(d is not None for d in seen)


# -- the device ring, against the emulated runtime --------------------------------------------------


@pytest.fixture
def ring_ops():
    from emucudart import EmulatedRingOps, Emulator

    from engine.gpu import rings

    emu = Emulator()
    ops = EmulatedRingOps(emu)
    yield ops
    rings.release_rings()
    ops.close()


@pytest.mark.parametrize("ring", ["1,4,2", "2,3,3"])
@pytest.mark.parametrize("name, where", [("embed", 0.0), ("embed", 0.47), ("embed", 1.0), ("layers.11.weight", 0.3),
                                         ("ids", 0.5)])
def test_the_ring_catches_a_flipped_bit(saved, ring_ops, monkeypatch, ring, name, where):
    from emucudart import EmulatedSink

    from engine.gpu.records import load_records

    monkeypatch.setenv("ENGINE_RING", ring)
    path, t = saved
    with load_records() as records, engine.safe_open(path, framework="np") as f:
        f._sink_obj = EmulatedSink(ring_ops)
        got = f.get_tensors()
        assert all(np.array_equal(got[k], t[k]) for k in t)
    assert records and records[-1].chunks > 1  # the ring ran, in several chunks
    bad = flip(path, name, where)
    with engine.safe_open(bad, framework="np") as f:
        f._sink_obj = EmulatedSink(ring_ops)
        with pytest.raises(ChecksumError) as e:
            f.get_tensors()
        assert e.value.tensors == (name,)
        for k in t:
            if k == name:
                with pytest.raises(ChecksumError):
                    f.get_tensor(k)
            else:
                assert np.array_equal(f.get_tensor(k), t[k])
    with engine.safe_open(bad, framework="np", verify_checksums=False) as f:
        f._sink_obj = EmulatedSink(ring_ops)
        assert len(f.get_tensors()) == len(t)


# -- remote loads: nginx over HTTP and path-style S3, and cache_dir copies ----------------------------


@pytest.fixture
def served(tmp_path, monkeypatch):
    from servers import Nginx, nginx_or_skip

    nginx_or_skip()
    root = tmp_path / "www"
    (root / "one").mkdir(parents=True)
    t = tensors(11)
    good = str(root / "one" / "model.safetensors")
    engine.save_file(t, good, checksums=True)
    (root / "bad").mkdir()
    shutil.copy(flip(good, "embed", 0.8), root / "bad" / "model.safetensors")
    os.remove(os.path.join(os.path.dirname(good), "flipped-model.safetensors"))
    os.symlink(root, root / "bucket")  # path-style S3: s3://bucket/<key> is /bucket/<key>
    with Nginx(str(root)) as server:
        yield server, t


def _s3_env(monkeypatch, server):
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.base)
    monkeypatch.setenv("AWS_NO_SIGN_REQUEST", "1")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull + "-none")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull + "-none")


@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_remote_loads_catch_a_flipped_bit(served, monkeypatch, scheme):
    server, t = served
    if scheme == "s3":
        _s3_env(monkeypatch, server)

    def url(where: str) -> str:
        return server.url(where) if scheme == "http" else f"s3://bucket/{where}"

    got = engine.numpy.load_file(url("one/model.safetensors"), chunk_bytes=1 << 20)
    assert all(np.array_equal(got[k], t[k]) for k in t)
    with pytest.raises(ChecksumError, match="embed"):
        engine.numpy.load_file(url("bad/model.safetensors"), chunk_bytes=1 << 20)
    seen = []
    with pytest.raises(ChecksumError, match="embed"):
        for name, _ in engine.stream(url("bad/model.safetensors"), framework="np", chunk_bytes=1 << 16):
            seen.append(name)
    assert "embed" not in seen
    with pytest.raises(ChecksumError, match="embed"):
        engine.load_into(url("bad/model.safetensors"), {k: np.zeros_like(v) for k, v in t.items()})
    assert len(engine.numpy.load_file(url("bad/model.safetensors"), verify_checksums=False)) == len(t)


def test_cache_dir_copies_are_checked_when_written_and_when_read(served, tmp_path):
    server, t = served
    cache = str(tmp_path / "cache")
    got = engine.numpy.load_file(server.url("one/model.safetensors"), cache_dir=cache)
    again = engine.numpy.load_file(server.url("one/model.safetensors"), cache_dir=cache)  # from the copy
    assert all(np.array_equal(got[k], t[k]) and np.array_equal(again[k], t[k]) for k in t)
    with pytest.raises(ChecksumError, match="embed"):
        engine.numpy.load_file(server.url("bad/model.safetensors"), cache_dir=cache)
    # a copy made while skipping the check holds the bad bytes: the next load from it checks them
    engine.numpy.load_file(server.url("bad/model.safetensors"), cache_dir=cache, verify_checksums=False)
    with pytest.raises(ChecksumError, match="embed"):
        engine.numpy.load_file(server.url("bad/model.safetensors"), cache_dir=cache)
    with engine.safe_open(server.url("bad/model.safetensors"), framework="np", cache_dir=cache) as f:
        assert np.array_equal(f.get_tensor("bias"), t["bias"])
        with pytest.raises(ChecksumError):
            f.get_tensor("embed")


# -- finite weights on request ------------------------------------------------------------------------


@pytest.fixture
def nonfinite(tmp_path):
    pytest.importorskip("numba", reason="check_finite counts with the statistics kernels (Numba, an extra)")
    import ml_dtypes

    rng = np.random.default_rng(2)
    bad = rng.standard_normal((300, 40)).astype(np.float32)
    bad[7, 3], bad[100, 0], bad[299, 39] = np.nan, np.inf, -np.inf
    half = rng.standard_normal(5000).astype(ml_dtypes.bfloat16)
    half[4321] = np.nan
    t = {"good": rng.standard_normal((64, 64)).astype(np.float32), "bad": bad, "half": half,
         "ints": np.arange(100, dtype=np.int32)}
    path = str(tmp_path / "nf.safetensors")
    engine.save_file(t, path, checksums=True)
    return path, t


def test_check_finite_names_the_tensor_and_counts(nonfinite):
    path, t = nonfinite
    with pytest.raises(engine.NonFiniteError) as e:
        engine.numpy.load_file(path, check_finite=True)
    err = e.value
    assert err.tensors[0] in ("bad", "half") and err.path == path
    if err.tensors == ("bad",):
        assert (err.nan_count, err.posinf_count, err.neginf_count) == (1, 1, 1) and "3 non-finite" in str(err)
    else:
        assert (err.nan_count, err.posinf_count, err.neginf_count) == (1, 0, 0)
    seen = []
    with pytest.raises(engine.NonFiniteError):
        for name, _ in engine.stream(path, framework="np", check_finite=True, names=["good", "ints", "half"]):
            seen.append(name)
    assert "half" not in seen
    got = engine.numpy.load_file(path)  # without the check: loads as written
    assert np.isnan(got["bad"][7, 3])


def test_check_finite_passes_finite_tensors_and_ignores_integers(nonfinite):
    path, t = nonfinite
    got = dict(engine.stream(path, framework="np", check_finite=True, names=["good", "ints"]))
    assert sorted(got) == ["good", "ints"] and np.array_equal(got["good"], t["good"])
    with_stats = list(engine.stream(path, framework="np", check_finite=True, stats=True, names=["good"]))
    assert len(with_stats[0]) == 3 and with_stats[0][2].nan_count == 0
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    etorch = importlib.import_module("engine.torch")
    with pytest.raises(engine.NonFiniteError):
        etorch.load_file(path, check_finite=True)
    assert etorch.load_file(path)["half"].dtype == torch.bfloat16
