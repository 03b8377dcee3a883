"""Host memory a load holds beyond its outputs: the twin of ``scripts/bench_memory.py`` at a
small size (128 MiB of 4 MiB tensors), tracked across commits.

* ``LoadMemory.track_x_model``: the peak host memory beyond the outputs (a group's ranks
  summed) over the checkpoint's bytes, for ``load_into`` and a stream that keeps nothing, one
  process or ``ranks`` gloo ranks with ``process_group=`` (``memory_limit`` of 16 MiB a rank on
  the ``limited`` rows).
"""

from __future__ import annotations

import os
import sys
import tempfile

from . import common

common.ensure_engine_importable()
sys.path[:0] = [os.path.join(common.REPO_ROOT, "tests"), os.path.join(common.REPO_ROOT, "scripts")]

MIB = 1 << 20


class LoadMemory:
    params = [["into", "stream"], [1, 4], ["default", "limited"]]
    param_names = ["mode", "ranks", "plan"]
    number = 1
    repeat = (1, 3, 60.0)
    warmup_time = 0
    timeout = 600

    def setup(self, mode, ranks, plan):
        import numpy as np

        import engine

        if ranks == 1 and plan == "limited":
            raise NotImplementedError  # the limit bounds group rounds; one process stages no rounds
        self.root = tempfile.mkdtemp(prefix="engine-asv-memory-")
        self.path = os.path.join(self.root, "model.safetensors")
        rng = np.random.default_rng(0)
        engine.save_file({f"w{i}": rng.standard_normal((1024, 1024), dtype=np.float32) for i in range(32)}, self.path)
        self.nbytes = 128 * MIB

    def teardown(self, mode, ranks, plan):
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)

    def track_x_model(self, mode, ranks, plan):
        import bench_memory
        import harness

        opts = {"memory_limit": 16 * MIB} if plan == "limited" else {}
        got = harness.ranks(bench_memory.sample, ranks, mode, self.path, opts)
        return sum(g["extra"] for g in got) / self.nbytes

    track_x_model.unit = "x checkpoint"
