"""Tensor-parallel loading: one rank's shards of a LLaMA-shaped checkpoint, in process.

``scripts/bench_tp.py`` starts every rank at once in fresh processes and times the
slowest, which is what a server waits for; this suite tracks one rank (rank 1 of 4,
warm page cache) across commits, each engine mode beside the reference's
``safe_open`` + ``get_slice(name)[index]``.  ``engine-view`` (``backend="mmap",
copy=False``) hands out what the reference hands out: views for shards that are one
range of the file, copies of column blocks; ``engine`` and ``engine-mmap`` own every byte.
``layout``: one file, or the same tensors as a sharded checkpoint of 4 files and an index.
"""

from . import common

common.ensure_engine_importable()

WORLD, RANK = 4, 1
CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
              num_key_value_heads=2, vocab_size=8192)


class TensorParallelRank(common.OneCallPerSample):
    """One rank's ``load_tensor_parallel`` (direct mode) against the reference's slices."""

    params = [["engine", "engine-mmap", "engine-view", "reference"], ["file", "sharded"]]
    param_names = ["impl", "layout"]

    def setup_cache(self):
        path = common.llama_file(CONFIG)
        return {"file": path, "sharded": common.sharded_copy(path, 4)}

    def setup(self, paths, impl, layout):
        from engine.distributed import llama_plan, load_tensor_parallel

        path = paths[layout]
        common.prepare(impl)
        plan = llama_plan(CONFIG, world_size=WORLD)
        options = {"engine": {}, "engine-mmap": {"backend": "mmap"},
                   "engine-view": {"backend": "mmap", "copy": False}}.get(impl)
        if options is None:
            self.load = lambda: common.reference_shards(path, plan, RANK, WORLD)
        else:
            self.load = lambda: load_tensor_parallel(path, plan, rank=RANK, world_size=WORLD, **options)
        common.warm_cache(path)
        self.load()  # first-use costs (mappings, thread start-up paths) outside the samples

    def time_rank(self, paths, impl, layout):
        self.load()
