"""File to device: the engine's entry points loading a checkpoint to a CUDA device, tracked by
commit; every benchmark skips itself (``NotImplementedError`` in ``setup``, asv's way) where
torch sees no CUDA device.

A 1 GiB BF16 checkpoint in 4 shards with an index (warm page cache), loaded to ``cuda:0``:

* ``DeviceLoad.time_load``: ``engine.torch.load_file`` per shard and of the directory,
  ``engine.stream`` over the shards, ``engine.load_into`` of the directory into tensors made
  before the clock, and the reference's ``load_file(f, device=...)`` per shard beside them;
  each timed to ``torch.cuda.synchronize()``, the process's ring set up by an untimed load
  first (scripts/gpu_check.py times a process's first load);
* ``DeviceLoad.track_x_reference``: each row's rate as a ratio to the reference's;
* ``PerKey.time_loop``: the loop of accelerate's ``load_state_dict``, ``safe_open(f,
  device=...)`` then ``get_tensor(k)`` for every key, engine and reference;
* ``PerKey.track_us_per_key``: that loop's microseconds per key.
"""

from __future__ import annotations

import functools
import os

from . import common

common.ensure_engine_importable()

CKPT_BYTES = 1 << 30
SHARDS = 4
DEVICE = "cuda:0"
ROWS = ["load_file-per-shard", "load_file-directory", "stream", "load_into-directory", "reference-per-shard"]


def _no_cuda() -> str | None:
    """Why there is no CUDA device to load to here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "no CUDA device"


def _cuda() -> None:
    """The device, its context up; ``NotImplementedError`` (asv: skipped) without one."""
    why = _no_cuda()
    if why:
        raise NotImplementedError(why)
    import torch

    torch.empty(1, device=DEVICE)
    torch.cuda.synchronize()


def _checkpoint() -> str | None:
    """The sharded checkpoint, made once; none on a host without a device (its benchmarks skip)."""
    if _no_cuda():
        return None
    return common.sharded_copy(common.checkpoint_file(CKPT_BYTES), SHARDS)


def _keys(path: str) -> list[str]:
    import engine

    return list(engine.read_header(os.fspath(path)).keys())


def _loader(row: str, directory: str):
    import torch

    import engine
    import engine.torch

    files = common.checkpoint_files(directory)
    if row == "load_file-per-shard":
        return lambda: [engine.torch.load_file(f, device=DEVICE) for f in files]
    if row == "load_file-directory":
        return lambda: engine.torch.load_file(directory, device=DEVICE)
    if row == "stream":
        return lambda: dict(engine.stream(files, framework="pt", device=DEVICE))
    if row == "load_into-directory":
        dst = {}
        for f in files:
            for name, info in engine.read_header(f).items():
                dst[name] = torch.empty(info.shape, dtype=torch.bfloat16, device=DEVICE)
        return lambda: engine.load_into(directory, dst, strict=True)
    if row == "reference-per-shard":
        from safetensors.torch import load_file

        return lambda: [load_file(f, device=DEVICE) for f in files]
    raise ValueError(row)


def _timed(load):
    import torch

    def run():
        out = load()
        torch.cuda.synchronize()
        return out

    return run


class _OnDevice(common.OneCallPerSample):
    """The suites' shared set-up: one checkpoint for both (asv keys ``setup_cache`` by its
    definition), the device up and the checkpoint in the page cache before each sample."""

    def setup_cache(self):
        return _checkpoint()

    def _ready(self, directory) -> None:
        _cuda()
        common.warm_cache(directory)


class DeviceLoad(_OnDevice):
    params = [ROWS]
    param_names = ["row"]

    def setup(self, directory, row):
        self._ready(directory)
        self.run = _timed(_loader(row, directory))
        self.run()  # the ring, the runtime and the allocator's pool set up before the samples

    def teardown(self, directory, row):
        self.run = None

    def time_load(self, directory, row):
        self.run()

    def track_x_reference(self, directory, row):
        ref = _timed(_loader("reference-per-shard", directory))
        ref()
        return common.best_time(ref, 3) / common.best_time(self.run, 3)

    track_x_reference.unit = "x reference"


class PerKey(_OnDevice):
    """accelerate's per-key loop (``safe_open(f, device)`` + ``get_tensor`` per key)."""

    params = [["engine", "reference"]]
    param_names = ["impl"]

    def setup(self, directory, impl):
        self._ready(directory)
        if impl == "engine":
            from engine import safe_open
        else:
            from safetensors import safe_open
        files = common.checkpoint_files(directory)
        self.keys = sum(len(_keys(f)) for f in files)
        self.run = _timed(functools.partial(common.per_key_load, safe_open, files, DEVICE))
        self.run()

    def time_loop(self, directory, impl):
        self.run()

    def track_us_per_key(self, directory, impl):
        return common.best_time(self.run, 3) / self.keys * 1e6

    track_us_per_key.unit = "us per key"
