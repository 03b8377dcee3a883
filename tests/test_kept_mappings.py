"""engine.io.kept_mappings: a file's populated mapping kept between loads, on request."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from conftest import run_python
from emucudart import EmulatedRingOps, Emulator

import engine
from engine.io import kept_mappings, reader
from engine.io.kept_mappings import KEPT_MAPPINGS
from engine.loading import pipeline
from engine.planning.plan import plan_reads


@pytest.fixture(autouse=True)
def _not_kept_after():
    yield
    engine.keep_mappings(False)
    assert not len(KEPT_MAPPINGS)


def _save(path, seed: int, n: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {f"w{i}": rng.integers(-1000, 1000, size=(256, 1024 + 64 * i), dtype=np.int32) for i in range(n)}
    engine.save_file(tensors, str(path))
    return tensors


def _empty_like(tensors):
    return {k: np.zeros_like(v) for k, v in tensors.items()}


def _load_checked(path, want) -> list[str]:
    """``engine.load_into`` of ``path`` into fresh zeroed arrays shaped as ``want``; every
    array must then equal ``want``'s.  Returns the names filled."""
    dst = _empty_like(want)
    names = engine.load_into(path, dst)
    for k in want:
        assert (dst[k] == want[k]).all(), k
    return names


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_off_by_default_and_a_load_keeps_nothing(tmp_path):
    path = tmp_path / "a.safetensors"
    want = _save(path, 1)
    assert not KEPT_MAPPINGS.on or os.environ.get("ENGINE_KEEP_MAPPINGS") == "1"
    engine.keep_mappings(False)
    _load_checked(path, want)
    assert not len(KEPT_MAPPINGS)


def test_repeated_loads_copy_out_of_one_kept_mapping(tmp_path):
    path = tmp_path / "a.safetensors"
    want = _save(path, 2)
    engine.keep_mappings(True)
    seen = set()
    for _ in range(3):
        assert _load_checked(path, want) == list(want)
        seen.update(id(m) for m in KEPT_MAPPINGS.kept.values())
    assert len(seen) == 1 and len(KEPT_MAPPINGS) == 1
    (m,) = KEPT_MAPPINGS.kept.values()
    assert m.users == 0 and not m.closed  # given back by each load, kept open
    engine.keep_mappings(False)
    assert m.closed


@pytest.mark.parametrize("change", ["rewritten", "replaced", "truncated"])
def test_a_changed_file_is_mapped_again_never_read_stale(tmp_path, change):
    """The kept mapping is valid for the file's inode, size and times it was made with; any
    change makes the next load map the file anew, so it gives the new bytes."""
    path = tmp_path / "a.safetensors"
    _save(path, 3)
    engine.keep_mappings(True)
    engine.load_into(path, _empty_like(engine.load_file(path)))
    (old,) = KEPT_MAPPINGS.kept.values()
    if change == "rewritten":  # in place, same size, same inode
        want = _save(tmp_path / "b.safetensors", 4)
        with open(path, "r+b") as f:
            f.write((tmp_path / "b.safetensors").read_bytes())
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # whatever the clock's grain
    elif change == "replaced":  # a new file renamed over it (a new inode)
        want = _save(tmp_path / "b.safetensors", 5)
        os.replace(tmp_path / "b.safetensors", path)
    else:  # cut short, then shorter tensors written in place
        want = _save(tmp_path / "b.safetensors", 6, n=1)
        with open(path, "r+b") as f:
            f.truncate(0)
            f.write((tmp_path / "b.safetensors").read_bytes())
    _load_checked(path, want)
    assert old.closed  # the stale mapping is dropped, not kept beside the new one
    assert len(KEPT_MAPPINGS) == 1


def test_mappings_of_deleted_files_are_dropped_at_the_next_load(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    want_a, want_b = _save(a, 7), _save(b, 8)
    engine.keep_mappings(True)
    engine.load_into(a, _empty_like(want_a))
    (ma,) = KEPT_MAPPINGS.kept.values()
    os.unlink(a)  # its blocks stay allocated while the mapping holds the file
    _load_checked(b, want_b)
    assert ma.closed and len(KEPT_MAPPINGS) == 1


def test_at_most_max_files_are_kept_least_recently_used_first(tmp_path, monkeypatch):
    monkeypatch.setattr(kept_mappings.KeptMappings, "MAX_FILES", 2)
    paths = [tmp_path / f"{i}.safetensors" for i in range(3)]
    wants = [_save(p, 10 + i, n=1) for i, p in enumerate(paths)]
    engine.keep_mappings(True)
    for p, w in zip(paths[:2], wants[:2], strict=True):
        engine.load_into(p, _empty_like(w))
    first = KEPT_MAPPINGS.kept[(os.stat(paths[0]).st_dev, os.stat(paths[0]).st_ino)]
    engine.load_into(paths[0], _empty_like(wants[0]))  # used again: now the most recent
    engine.load_into(paths[2], _empty_like(wants[2]))
    kept = {os.stat(p).st_ino for p in (paths[0], paths[2])}
    assert {ino for _, ino in KEPT_MAPPINGS.kept} == kept and not first.closed


def test_a_mapping_in_use_is_closed_by_its_last_user(tmp_path):
    path = tmp_path / "a.safetensors"
    _save(path, 20)
    engine.keep_mappings(True)
    fd = os.open(path, os.O_RDONLY)
    try:
        m = reader.copy_mapping(fd)
        assert reader.kept(m) and m is reader.copy_mapping(fd)  # the same mapping for a second load
        assert m.users == 2
        engine.keep_mappings(False)  # stops keeping it while two loads use it
        assert not m.closed
        reader.close_mapping(m)
        assert not m.closed
        reader.close_mapping(m)
        assert m.closed
        plain = reader.copy_mapping(fd)  # no longer kept: a mapping of this load's own
        assert plain is not None and not reader.kept(plain)
        reader.close_mapping(plain)
    finally:
        os.close(fd)


def test_concurrent_loads_of_one_file_share_its_kept_mapping(tmp_path):
    path = tmp_path / "a.safetensors"
    want = _save(path, 21)
    engine.keep_mappings(True)
    outs = [_empty_like(want) for _ in range(4)]
    errors = []

    def load(dst):
        try:
            for _ in range(5):
                engine.load_into(path, dst)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(o,)) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for dst in outs:
        for k in want:
            assert (dst[k] == want[k]).all()
    assert len(KEPT_MAPPINGS) == 1 and next(iter(KEPT_MAPPINGS.kept.values())).users == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc/self/status")
def test_a_kept_file_stays_mapped_and_a_plain_load_unmaps(tmp_path, monkeypatch):
    """What keeping is: the file's pages stay mapped in the process (RssFile) after the
    load, where a plain load unmaps each piece once copied.  The mapping is pinned as the
    source (under ``auto`` a file cached page by page may be read with ``pread``)."""
    monkeypatch.setenv("ENGINE_COPY_SOURCE", "mmap")
    path = tmp_path / "big.safetensors"
    want = {"w": np.random.default_rng(22).integers(0, 255, size=(48 << 20,), dtype=np.uint8)}
    engine.save_file(want, str(path))
    dst = {"w": np.ones_like(want["w"])}  # pre-faulted: anonymous memory, not in RssFile
    before = _rss_file_kib()
    engine.load_into(path, dst)
    plain = _rss_file_kib() - before
    engine.keep_mappings(True)
    engine.load_into(path, dst)
    kept = _rss_file_kib() - before
    assert (dst["w"] == want["w"]).all()
    assert plain < 8 << 10, f"a plain load left {plain} KiB mapped"
    assert kept > 40 << 10, f"a kept load left only {kept} KiB mapped"
    engine.keep_mappings(False)
    assert _rss_file_kib() - before < 8 << 10


def test_the_device_ring_reads_the_kept_mapping(tmp_path):
    data = os.urandom(5 << 20)
    path = tmp_path / "blob"
    path.write_bytes(data)
    begins, ends = np.array([0, 2 << 20]), np.array([2 << 20, 5 << 20])
    requests = plan_reads(begins, ends, [0, 1], 0, 1 << 20, 64)
    engine.keep_mappings(True)
    fd = os.open(path, os.O_RDONLY)
    emulator = Emulator()
    emulator.reset()
    dev = EmulatedRingOps(emulator)
    try:
        for _ in range(2):
            out = {0: np.zeros(2 << 20, np.uint8), 1: np.zeros(3 << 20, np.uint8)}
            pipeline.run(fd, requests, pipeline.Destination(device_targets=out, device_ops=dev), gpu_path="copy",
                         slot_bytes=1 << 20)
            assert bytes(out[0]) + bytes(out[1]) == data
        assert len(KEPT_MAPPINGS) == 1
    finally:
        os.close(fd)
        emulator.assert_clean()
        dev.close()


def test_network_mounts_are_never_mapped_even_when_kept(fuse_file):
    engine.keep_mappings(True)
    mounted, _, _ = fuse_file
    fd = os.open(mounted, os.O_RDONLY)
    try:
        assert reader.copy_mapping(fd) is None
    finally:
        os.close(fd)
    assert not len(KEPT_MAPPINGS)


def test_pinned_pread_source_maps_nothing(tmp_path, monkeypatch):
    path = tmp_path / "a.safetensors"
    want = _save(path, 23)
    monkeypatch.setenv("ENGINE_COPY_SOURCE", "pread")
    engine.keep_mappings(True)
    _load_checked(path, want)
    assert not len(KEPT_MAPPINGS)


def test_the_environment_turns_it_on_at_start_up():
    out = run_python("from engine.io.kept_mappings import KEPT_MAPPINGS; print(KEPT_MAPPINGS.on)",
                     env=dict(os.environ, ENGINE_KEEP_MAPPINGS="1"))
    assert out.strip() == "True"
    out = run_python("from engine.io.kept_mappings import KEPT_MAPPINGS; print(KEPT_MAPPINGS.on)",
                     env={k: v for k, v in os.environ.items() if k != "ENGINE_KEEP_MAPPINGS"})
    assert out.strip() == "False"
