"""Shared fixtures and helpers: write valid and deliberately corrupt safetensors files.

The helpers are plain functions so that any test module can import them
(``from conftest import write_raw, layout``); the fixtures wrap them around ``tmp_path``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import pytest

HeaderLike = Union[Mapping[str, Any], str, bytes]  # noqa: UP007 - a runtime alias

#: Bits per element of each format dtype (kept here so helpers do not depend on the engine).
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
    "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
    "U64": 64,
}  # fmt: skip


def run_python(code: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 300) -> str:
    """Standard output of ``code`` run by a fresh interpreter (what a new process imports is
    what these tests look at); the test fails with the child's output if the child fails."""
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                         timeout=timeout)
    assert out.returncode == 0, f"child failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    return out.stdout


def in_threads(*calls) -> None:
    """Run each call on its own thread, all released together by a barrier; re-raise the
    first exception any of them raised once all have finished (engine.io.reader.run_threads)."""
    import threading

    from engine.io.reader import run_threads

    barrier = threading.Barrier(len(calls))

    def released(call):
        def run() -> None:
            barrier.wait()
            call()

        return run

    run_threads([released(c) for c in calls], name="test")


def encode_header(header: HeaderLike) -> bytes:
    """Header bytes: a mapping is dumped as compact JSON (key order kept); str is UTF-8
    encoded; bytes are taken as they are (for deliberately broken headers)."""
    if isinstance(header, bytes):
        return header
    if isinstance(header, str):
        return header.encode("utf-8")
    return json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def build_file(
    header: HeaderLike,
    data: bytes | int = b"",
    *,
    pad: bool = True,
    length: int | None = None,
) -> bytes:
    """The bytes of a safetensors file.

    Parameters
    ----------
    header : mapping, str or bytes
        See :func:`encode_header`.
    data : bytes or int
        The data region, or its size (filled with a byte pattern).
    pad : bool
        Pad the header with spaces to a multiple of 8, like the reference writer.
    length : int, optional
        The 8-byte length to write instead of the true one (for corrupt files).
    """
    head = encode_header(header)
    if pad:
        head += b" " * (-len(head) % 8)
    if isinstance(data, int):
        data = bytes(i % 251 for i in range(data))
    n = len(head) if length is None else length
    return struct.pack("<Q", n) + head + data


def write_raw(
    path: str | os.PathLike,
    header: HeaderLike,
    data: bytes | int = b"",
    **kw: Any,
) -> Path:
    """Write :func:`build_file` ``(header, data, **kw)`` to ``path``; returns the path."""
    path = Path(path)
    path.write_bytes(build_file(header, data, **kw))
    return path


def nbytes_of(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * DTYPE_BITS[dtype] // 8


def layout(
    tensors: Mapping[str, tuple[str, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], int]:
    """A valid header for ``{name: (dtype, shape)}``, laid out contiguously in the given
    order, and the size of its data region."""
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = nbytes_of(dtype, shape)
        header[name] = entry(dtype, shape, offset, offset + size)
        offset += size
    return header, offset


def entry(dtype: str, shape: Sequence[int], begin: int, end: int) -> dict[str, Any]:
    """One tensor entry of a header."""
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


_counter = itertools.count()


@pytest.fixture
def st_file(tmp_path):
    """Factory: ``st_file(header, data=b"", **kw) -> Path`` writes a (possibly corrupt)
    file with :func:`write_raw` under a fresh name in ``tmp_path``."""

    def make(header: HeaderLike, data: bytes | int = b"", *, name: str | None = None, **kw: Any):
        return write_raw(tmp_path / (name or f"f{next(_counter)}.safetensors"), header, data, **kw)

    return make


@pytest.fixture
def valid_file(st_file):
    """A small valid file with metadata, mixed dtypes, a scalar and a zero-size tensor."""
    header, size = layout(
        {
            "embed.weight": ("BF16", (4, 3)),
            "layer.0.bias": ("F32", (3,)),
            "layer.0.weight": ("F32", (3, 3)),
            "scale": ("F64", ()),
            "empty": ("I8", (0, 5)),
            "mask": ("BOOL", (5,)),
            "packed": ("F4", (2, 4)),
        },
        metadata={"format": "pt", "note": "ünïcode ✓"},
    )
    return st_file(header, size)


def pytest_configure(config):
    # under Numba's CUDA simulator (CI's simulator lane), refuse what a GPU refuses whichever
    # test module runs first; elsewhere Numba is not imported here
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        import simulated_gpu

        simulated_gpu.install()


def pytest_collection_modifyitems(config, items):
    """With NUMBA_DISABLE_JIT=1 (the coverage run of the kernels) leave out the tests marked
    ``jit_only``: they need compiled kernels (large inputs, allocation counts) and run in
    the ordinary pass."""
    import os

    if os.environ.get("NUMBA_DISABLE_JIT", "0") in ("", "0"):
        return
    kept, dropped = [], []
    for item in items:
        (dropped if item.get_closest_marker("jit_only") else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


class SplitCopies:
    """Watches the native split copies of host loads (``engine.loading.pipeline.split_reader``):
    counts the bytes they deliver and calls ``before(call, fd, offsets, targets)`` ahead of
    each one (``call`` counts from 1 over every reader), which may raise or change the file.
    The host loads' one seam at the Python level: the copies themselves run in native code."""

    def __init__(self, monkeypatch, before=None) -> None:
        import threading

        import engine.loading.pipeline

        self.bytes = 0
        self.calls = 0
        self.lock = threading.Lock()
        self.before = before
        real = engine.loading.pipeline.split_reader
        watch = self

        class Reader:
            def __init__(self, threads: int, **kw) -> None:
                self.inner = real(threads, **kw)

            def copy(self, fd, mapping, offsets, targets, *args, **kw):
                with watch.lock:
                    watch.calls += 1
                    call = watch.calls
                if watch.before is not None:
                    watch.before(call, fd, offsets, targets)
                result = self.inner.copy(fd, mapping, offsets, targets, *args, **kw)
                if result[0] == 0:
                    with watch.lock:
                        watch.bytes += sum(memoryview(t).nbytes for t in targets)
                return result

            def close(self) -> None:
                self.inner.close()

        monkeypatch.setattr(engine.loading.pipeline, "split_reader", Reader)


@pytest.fixture
def fuse_file(tmp_path):
    """A small safetensors file, reached through a real FUSE mount (bindfs) and directly."""
    import numpy as np
    from servers import FuseMount

    import engine.numpy

    src = tmp_path / "src"
    src.mkdir()
    tensors = {f"w{i}": np.random.default_rng(i).standard_normal((64 + i, 33)).astype(np.float32) for i in range(5)}
    engine.numpy.save_file(tensors, str(src / "m.safetensors"))
    with FuseMount(str(src), str(tmp_path / "mnt")) as mount:
        yield mount.path("m.safetensors"), str(src / "m.safetensors"), tensors
