"""Loads into memory a model already owns, and loads from a cold page cache.

Twins of ``scripts/bench_reader.py --only fresh`` at the asv suites' moderate size (a
256 MiB BF16 checkpoint), engine and reference ``safetensors`` in the same run:

* ``LoadInto``: ``engine.load_into`` against the reference's ``load_file`` + ``copy_``, into
  the same pre-faulted tensors, warm and cold page cache;
* ``ColdLoad``: ``load_file`` with the file evicted (``POSIX_FADV_DONTNEED``) before every
  sample; ``"mmap"`` then reads a byte of every page (a mapped load reads nothing until
  touched), ``"pread"`` copies everything into owned memory.
"""


from . import common

common.ensure_engine_importable()

IMPLS = ["engine", "reference"]
CKPT_BYTES = 256 << 20


def _touch_pages(tensors) -> None:
    import torch

    for t in tensors.values():
        t.reshape(-1).view(torch.uint8)[::4096].sum()


class LoadInto(common.OneCallPerSample):
    params = [IMPLS, ["warm", "cold"]]
    param_names = ["impl", "cache"]

    def setup_cache(self):
        return common.checkpoint_file(CKPT_BYTES)

    def setup(self, path, impl, cache):
        import torch

        common.prepare(impl)
        import engine

        header = engine.read_header(path)
        self.dst = {k: torch.empty(header[k].shape, dtype=torch.bfloat16) for k in header.keys()}
        for t in self.dst.values():
            t.zero_()  # pre-faulted, as a model's parameters are
        if impl == "engine":
            self.load = lambda: engine.load_into(path, self.dst)
        else:
            import safetensors.torch

            def load():
                for k, t in safetensors.torch.load_file(path).items():
                    self.dst[k].copy_(t)

            self.load = load
        if cache == "cold":
            common.evict_cache(path)
        else:
            common.warm_cache(path)

    def time_load_into(self, path, impl, cache):
        self.load()


class ColdLoad(common.OneCallPerSample):
    params = [IMPLS, ["mmap", "pread"]]
    param_names = ["impl", "backend"]

    def setup_cache(self):
        return common.checkpoint_file(CKPT_BYTES)

    def setup(self, path, impl, backend):
        common.prepare(impl)
        if impl == "engine":
            import engine.torch

            self.load_file = engine.torch.load_file
        else:
            import safetensors.torch

            self.load_file = safetensors.torch.load_file
        common.evict_cache(path)

    def time_load_file(self, path, impl, backend):
        got = self.load_file(path, backend=backend)
        if backend == "mmap":
            _touch_pages(got)
