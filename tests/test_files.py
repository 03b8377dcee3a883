"""engine._files: opening for reading refuses FIFOs, devices and symlink loops without blocking."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

import engine
import engine.numpy
from engine._files import open_regular
from engine.checkpoint import open_checkpoint, read_checkpoint_info
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
