"""A process group loading one checkpoint from a throttled server: the twin of
``scripts/bench_group.py`` at a small size (48 MB in 4 shards, a Range server on 127.0.0.1
sending 40 MB/s in all), tracked across commits.

* ``GroupLoad.time_load``: ``ranks`` gloo ranks in fresh processes, each loading the URL on its
  own (``alone``) or together with ``process_group=`` (``group``); the slowest rank's time;
* ``track_bytes_asked``: the tensor bytes the server was asked for, as a multiple of the
  checkpoint's (``group``: 1, ``alone``: ``ranks``).
"""

from __future__ import annotations

import os
import sys
import tempfile

from . import common

common.ensure_engine_importable()
sys.path[:0] = [os.path.join(common.REPO_ROOT, "tests"), os.path.join(common.REPO_ROOT, "scripts")]

MB = 48
RATE = 40e6


class GroupLoad:
    params = [["alone", "group"], [2, 4]]
    param_names = ["row", "ranks"]
    number = 1
    repeat = (3, 5, 60.0)
    warmup_time = 0
    timeout = 600

    def setup(self, row, ranks):
        import bench_group
        import harness
        from rangeserver import RangeServer

        import engine

        self.root = tempfile.mkdtemp(prefix="engine-asv-group-")
        directory = harness.checkpoint(0, self.root, entries=bench_group.entries(MB), shards=4, checksums=True)
        self.nbytes = sum(engine.read_header(f).data_size for f in common.checkpoint_files(directory))
        self.server = RangeServer(self.root).start()
        self.server.bulk()
        self.server.rate = RATE
        self.url = self.server.url(os.path.basename(directory) + "/model.safetensors.index.json")

    def teardown(self, row, ranks):
        import shutil

        self.server.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def _run(self, row, ranks):
        import bench_group
        import harness

        self.server.requests.clear()
        harness.ranks(bench_group.rank, ranks, self.url, row == "group")

    def time_load(self, row, ranks):
        self._run(row, ranks)

    def track_bytes_asked(self, row, ranks):
        self._run(row, ranks)
        return self.server.tensor_bytes_asked() / self.nbytes

    track_bytes_asked.unit = "x checkpoint"
