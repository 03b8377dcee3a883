"""The host copy engine against this machine's own limit: twins of ``scripts/bench_host.py``
at the asv suites' moderate size (a 256 MiB BF16 checkpoint, warm page cache).

* ``HostCopy.time_copy``: the limit (a native parallel ``memcpy`` of the same bytes out of a
  fully mapped read-only mapping into pre-faulted memory), the engine's device copy path into
  a device whose copies move nothing (``dma=none``: page cache -> page-locked chunk) or are a
  CPU ``memcpy`` (``dma=memcpy``), and ``engine.load_into`` into pre-faulted torch tensors
  with each copy source (``ENGINE_COPY_SOURCE``), and with the file's mapping kept between
  calls (``load_into-kept``: ``engine.keep_mappings(True)``); the native floors (``pread``, and a fresh
  mapping populated and copied then unmapped: what a load that holds no mapping pays);
* ``track_x_limit``: each row's rate as a ratio to the limit measured in the same setup.
"""

from __future__ import annotations

import os

from . import common, host

common.ensure_engine_importable()

CKPT_BYTES = 256 << 20
ROWS = ["limit", "floor-pread", "floor-mapped", "copy-path-dma-none", "copy-path-dma-memcpy", "load_into-auto",
        "load_into-mmap", "load_into-pread", "load_into-kept"]


def _runner(row: str, path: str):
    if row == "limit":
        lim = host.Limit(path)
        return lim.run, lim.close
    if row.startswith("floor-"):
        floor = host.Floor(path, row.partition("-")[2])
        return floor.run, floor.close
    if row.startswith("copy-path"):
        load = host.RingLoad(path, dma=row.rpartition("-")[2])
        return load.run, load.close
    import torch

    import engine

    source = row.partition("-")[2]
    kept = source == "kept"
    if kept:
        source = "auto"
    h = engine.read_header(path)
    dst = {k: torch.empty(h[k].shape, dtype=torch.bfloat16).fill_(1) for k in h.keys()}

    def run():
        os.environ["ENGINE_COPY_SOURCE"] = source
        engine.keep_mappings(kept)
        try:
            engine.load_into(path, dst)
        finally:
            os.environ.pop("ENGINE_COPY_SOURCE", None)

    return run, lambda: engine.keep_mappings(False)


class HostCopy:
    params = [ROWS]
    param_names = ["row"]
    number = 1
    repeat = (5, 20, 20.0)
    timeout = 600

    def setup_cache(self):
        return common.checkpoint_file(CKPT_BYTES)

    def setup(self, path, row):
        common.warm_cache(path)
        self.run, self.close = _runner(row, path)
        self.run()  # first touch of the destination and of the page tables

    def teardown(self, path, row):
        self.close()

    def time_copy(self, path, row):
        self.run()

    def track_x_limit(self, path, row):
        lim = host.Limit(path)
        try:
            lim.run()
            return common.best_time(lim.run) / common.best_time(self.run)
        finally:
            lim.close()

    track_x_limit.unit = "x limit"
