"""Whole checkpoints from a server: twins of ``scripts/bench_remote.py`` at the asv suites'
moderate size (a 256 MB BF16 checkpoint in 4 shards, served by nginx on 127.0.0.1 from a warm
page cache; nginx is started by the benchmark and skipped where it is not installed).

* ``RemoteLoad.time_load``: the line rate (one ``curl -o /dev/null`` per shard at once),
  ``engine.load_into`` from the index URL over HTTP and as S3 (path-style anonymous GETs of
  the same nginx), the owned ``engine.torch.load_file`` over HTTP, and download-then-load with
  the reference;
* ``track_x_line``: each row's rate as a ratio to the line rate measured in the same setup.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import urllib.request

from . import common

common.ensure_engine_importable()
sys.path[:0] = [os.path.join(common.REPO_ROOT, "tests"), os.path.join(common.REPO_ROOT, "scripts")]

CKPT_BYTES = 256_000_000
SHARDS = 4
ROWS = ["line-rate", "load_into-http", "load_into-s3", "load_file-http", "download-reference"]


class RemoteLoad:
    params = [ROWS]
    param_names = ["row"]
    number = 1
    repeat = (5, 20, 20.0)
    timeout = 600

    def setup_cache(self):
        return common.sharded_copy(common.checkpoint_file(CKPT_BYTES), SHARDS)

    def setup(self, directory, row):
        from servers import nginx_binary

        if nginx_binary() is None:
            raise NotImplementedError("nginx is not installed")
        import harness
        import torch

        import engine

        self.served = contextlib.ExitStack()
        self.nginx, index, s3_index, self.env = self.served.enter_context(harness.served(directory))
        self.files = common.checkpoint_files(directory)
        self.urls = [self.nginx.url("ckpt/" + os.path.basename(f)) for f in self.files]
        headers = [engine.read_header(f) for f in self.files]
        self.dst = {k: torch.empty(h[k].shape, dtype=torch.bfloat16).fill_(1) for h in headers for k in h.keys()}
        self.scratch = tempfile.mkdtemp(prefix="engine-asv-dl-", dir=common.cache_dir())
        self.run = {
            "line-rate": self._curl,
            "load_into-http": lambda: engine.load_into(index, self.dst),
            "load_into-s3": lambda: self._with_env(
                lambda: engine.load_into(s3_index, self.dst)),
            "load_file-http": lambda: self._load_file(index),
            "download-reference": self._download_reference,
        }[row]
        self.run()  # first touch of the destination and the connections

    def teardown(self, directory, row):
        self.served.close()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _curl(self) -> None:
        import harness

        harness.curl(self.urls)

    def _with_env(self, fn) -> None:
        old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            fn()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _load_file(self, url: str) -> None:
        import engine.torch

        engine.torch.load_file(url)

    def _download_reference(self) -> None:
        import safetensors.torch

        out = {}
        for i, url in enumerate(self.urls):
            local = os.path.join(self.scratch, f"shard{i}.safetensors")
            with urllib.request.urlopen(url) as r, open(local, "wb") as f:
                shutil.copyfileobj(r, f, 16 << 20)
            out.update(safetensors.torch.load_file(local))
        common.touch_all(out)

    def time_load(self, directory, row):
        self.run()

    def track_x_line(self, directory, row):
        return common.best_time(self._curl) / common.best_time(self.run)

    track_x_line.unit = "x line rate"
