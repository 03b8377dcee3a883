"""engine.base._atomic: stale temporaries of dead writers go, a live writer's never do."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.base import _atomic

pytestmark = pytest.mark.skipif(os.name == "nt", reason="process ids are probed with signal 0 on POSIX")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _temp(directory, base: str, pid: int, *, is_dir: bool = False) -> str:
    path = os.path.join(directory, f".{base}.{pid}.{os.urandom(6).hex()}.tmp")
    if is_dir:
        os.mkdir(path)
        with open(os.path.join(path, "shard"), "wb") as f:
            f.write(b"partial")
    else:
        with open(path, "wb") as f:
            f.write(b"partial")
    return path


def test_dead_writers_temporaries_are_removed(tmp_path):
    dead = _dead_pid()
    f = _temp(tmp_path, "m.safetensors", dead)
    d = _temp(tmp_path, "m.safetensors", dead, is_dir=True)
    assert sorted(_atomic.remove_stale(str(tmp_path), "m.safetensors")) == sorted([f, d])
    assert os.listdir(tmp_path) == []


def test_live_writers_and_foreign_files_are_kept(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        kept = [
            _temp(tmp_path, "m.safetensors", live.pid),  # its writer still runs
            _temp(tmp_path, "m.safetensors", os.getpid()),  # a writer of this process
            _temp(tmp_path, "other.safetensors", _dead_pid()),  # another destination's
        ]
        foreign = [".m.safetensors.abc.tmp", ".m.safetensors.12.xyz.tmp", "m.safetensors", "notes.tmp"]
        for name in foreign:
            (tmp_path / name).write_bytes(b"x")
        assert _atomic.remove_stale(str(tmp_path), "m.safetensors") == []
        assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(p) for p in kept] + foreign)
    finally:
        live.kill()
        live.wait()


def test_a_locked_temporary_is_kept_even_when_its_pid_looks_dead(tmp_path):
    # a writer on another machine (a shared file system) has a pid that means nothing here;
    # its lock still protects its file
    path = _temp(tmp_path, "m.safetensors", _dead_pid())
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _atomic.lock(fd)
        assert _atomic.remove_stale(str(tmp_path), "m.safetensors") == []
        assert os.path.exists(path)
    finally:
        os.close(fd)
    assert _atomic.remove_stale(str(tmp_path), "m.safetensors") == [path]


def test_a_symlink_named_like_a_temporary_is_not_followed(tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    link = tmp_path / f".m.safetensors.{_dead_pid()}.{os.urandom(6).hex()}.tmp"
    os.symlink(target, link)
    assert _atomic.remove_stale(str(tmp_path), "m.safetensors") == []
    assert target.read_bytes() == b"keep"


def test_atomic_file_commit_and_discard(tmp_path):
    dest = str(tmp_path / "f.bin")
    a = _atomic.AtomicFile(dest, 0o640)
    os.write(a.fd, b"hello")
    assert not os.path.exists(dest)
    a.commit()
    assert open(dest, "rb").read() == b"hello"
    assert os.stat(dest).st_mode & 0o777 == 0o640
    b = _atomic.AtomicFile(dest, 0o600)
    os.write(b.fd, b"other")
    b.discard()
    b.discard()
    assert open(dest, "rb").read() == b"hello" and os.listdir(tmp_path) == ["f.bin"]


def test_unnamed_file_naming_falls_back_to_copying(tmp_path, monkeypatch):
    if _atomic._linker(str(tmp_path)) is None:
        pytest.skip("this platform or file system cannot name an O_TMPFILE file")
    dest = str(tmp_path / "f.bin")
    a = _atomic.AtomicFile(dest, 0o644)
    assert a.temp is None
    os.write(a.fd, b"payload" * 1000)

    def refuse(fd, path):
        raise OSError(18, "Invalid cross-device link")

    a._link = refuse  # the probe said yes, the real link says no: the bytes are copied out
    a.commit()
    assert open(dest, "rb").read() == b"payload" * 1000 and os.listdir(tmp_path) == ["f.bin"]
