"""engine.base._files: opening for reading refuses FIFOs, devices and symlink loops without blocking;
the file system of a file (network and FUSE mounts, tried on a real bindfs mount)."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

import engine
import engine.numpy
from engine.base import _files
from engine.base._files import open_regular
from engine.checkpoints.checkpoint import open_checkpoint, read_checkpoint_info
from engine.errors import ReadError, SafetensorError

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")


def _returns_in_time(fn, seconds: float = 10.0, fifo=None):
    """Run ``fn`` on a thread; fail (and unblock it) if it has not returned in time."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        if fifo is not None:  # a writer end releases a reader stuck in open()
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        t.join(5)
        pytest.fail(f"{fn} blocked for {seconds} s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _tensor_parallel(path):
    from engine.distributed import ShardingPlan, load_tensor_parallel

    return load_tensor_parallel(path, ShardingPlan(), rank=0, world_size=1)


@pytest.mark.parametrize(
    "opener",
    [
        lambda p: engine.safe_open(p, "numpy"),
        lambda p: engine.safe_open(p, "numpy", backend="pread"),
        lambda p: engine.read_header(p),
        lambda p: open_checkpoint(p),
        lambda p: read_checkpoint_info(p),
        lambda p: engine.numpy.load_file(p),
        lambda p: engine.load_into(p, {}),
        lambda p: list(engine.stream(p, framework="np")),
        lambda p: _tensor_parallel(p),
    ],
    ids=["safe_open-mmap", "safe_open-pread", "read_header", "open_checkpoint", "read_checkpoint_info", "load_file",
         "load_into", "stream", "load_tensor_parallel"],
)
def test_fifo_is_refused_without_blocking(tmp_path, opener):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ReadError) as e:
        _returns_in_time(lambda: opener(str(fifo)), fifo=fifo)
    assert e.value.reason == "NotRegularFile"
    assert e.value.path == str(fifo) and "FIFO" in str(e.value)
    assert isinstance(e.value, OSError) and e.value.errno == errno.EINVAL


def test_fifo_in_a_checkpoint_directory_and_as_index(tmp_path):
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(ReadError) as e:
        _returns_in_time(lambda: open_checkpoint(tmp_path), fifo=tmp_path / "model.safetensors")
    assert e.value.reason == "NotRegularFile"
    index = tmp_path / "sub" / "model.safetensors.index.json"
    index.parent.mkdir()
    os.mkfifo(index)
    for opener in (open_checkpoint, read_checkpoint_info):
        with pytest.raises(ReadError) as e:
            _returns_in_time(lambda opener=opener: opener(index), fifo=index)
        assert e.value.reason == "NotRegularFile" and e.value.path == str(index)


def test_character_device_is_refused():
    if not os.path.exists("/dev/zero"):
        pytest.skip("needs /dev/zero (a character device)")
    with pytest.raises(ReadError) as e:
        open_regular("/dev/zero")
    assert e.value.reason == "NotRegularFile" and "character device" in str(e.value)


def test_symlink_loop_is_an_engine_error_and_an_oserror(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    os.symlink(b, a)
    os.symlink(a, b)
    for opener in (engine.read_header, lambda p: engine.safe_open(p, "numpy"), open_checkpoint):
        with pytest.raises(SafetensorError) as e:
            opener(str(a))
        assert isinstance(e.value, OSError) and e.value.errno == errno.ELOOP
        assert e.value.reason == "SymlinkLoop" and e.value.path == str(a)


def test_regular_files_open_and_other_errors_pass_through(tmp_path):
    path = tmp_path / "x.safetensors"
    engine.numpy.save_file({"x": np.arange(3, dtype=np.int8)}, path)
    fd = open_regular(str(path))
    try:
        assert os.get_blocking(fd)  # reads after the check block as usual
        assert os.pread(fd, 8, 0) == os.pread(fd, 8, 0)
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        open_regular(str(tmp_path / "missing.safetensors"))


# -- which file system holds a file -------------------------------------------------------------
_MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
36 22 0:39 / /mnt/models rw,nosuid,nodev,relatime shared:7 master:2 - fuse.gcsfuse bucket rw,user_id=0
40 22 0:52 / /mnt/nfs rw,relatime - nfs4 server:/export rw,vers=4.2,rsize=1048576
41 22 0:53 / /mnt/with\\040space rw - fuse /src rw,user_id=0,group_id=0
a line that is not a mount
43 22 x:y / /bad rw - ext4 /dev/x rw
44 22 0:60 / /no-separator rw ext4
"""


def test_mount_types_are_read_from_mountinfo_lines_and_bad_lines_are_skipped():
    assert _files.parse_mount_types(_MOUNTINFO) == {
        (8, 1): "ext4", (0, 39): "fuse.gcsfuse", (0, 52): "nfs4", (0, 53): "fuse"}


@pytest.mark.parametrize("kind, network", [
    ("nfs4", True), ("nfs", True), ("lustre", True), ("fuse", True), ("fuse.gcsfuse", True), ("fuse.s3fs", True),
    ("cifs", True), ("9p", True), ("ext4", False), ("xfs", False), ("tmpfs", False), ("overlay", False), ("", False),
])
def test_network_mounts_are_told_by_their_type(tmp_path, monkeypatch, kind, network):
    monkeypatch.setattr(_files, "mount_type", lambda fd: kind)
    (tmp_path / "f").write_bytes(b"x")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert _files.on_network_mount(fd) is network
    finally:
        os.close(fd)


def test_a_local_disk_is_known_without_reading_mountinfo(tmp_path, monkeypatch):
    import types

    (tmp_path / "f").write_bytes(b"x")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        # a file on a block device (major 8, as /dev/sda1), whatever disk this machine has
        monkeypatch.setattr(os, "fstat", lambda _fd: types.SimpleNamespace(st_dev=os.makedev(8, 1)))
        opened = []
        real_open = open
        monkeypatch.setattr("builtins.open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
        assert _files.mount_type(fd) == "" and not _files.on_network_mount(fd)
        assert opened == []
        # and a device of major 0 is looked up there
        monkeypatch.setattr(os, "fstat", lambda _fd: types.SimpleNamespace(st_dev=os.makedev(0, 987654)))
        assert _files.mount_type(fd) == ""
        assert opened == ["/proc/self/mountinfo"]
    finally:
        monkeypatch.undo()
        os.close(fd)


def test_a_fuse_mount_is_a_network_mount_and_its_source_is_not(fuse_file):
    via_fuse, direct, _ = fuse_file
    fds = [os.open(via_fuse, os.O_RDONLY), os.open(direct, os.O_RDONLY)]
    try:
        assert _files.mount_type(fds[0]).startswith("fuse")
        assert _files.on_network_mount(fds[0])
        assert not _files.on_network_mount(fds[1])
    finally:
        for fd in fds:
            os.close(fd)


def test_every_load_from_a_fuse_mount_gives_the_files_bytes(fuse_file):
    import torch

    import engine.torch

    via_fuse, _, tensors = fuse_file
    got = engine.numpy.load_file(via_fuse)
    assert got.keys() == tensors.keys()
    for name, want in tensors.items():
        assert np.array_equal(got[name], want)
    dest = {name: torch.zeros(want.shape) for name, want in tensors.items()}
    engine.load_into(via_fuse, dest)
    with engine.safe_open(via_fuse, "pt") as f:
        for name, want in tensors.items():
            assert np.array_equal(dest[name].numpy(), want)
            assert np.array_equal(f.get_tensor(name).numpy(), want)
    assert np.array_equal(engine.torch.load_file(via_fuse, backend="pread")["w3"].numpy(), tensors["w3"])
