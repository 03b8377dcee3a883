"""Core paths, each measured on the engine and on the reference ``safetensors`` package.

Every suite takes an ``impl`` parameter ("engine" or "reference"), so each engine number
has its twin on the reference in the same run and ``asv compare`` shows both; the
``Speedup`` suite tracks the reference/engine time ratio itself across commits.

Sizes are moderate (a 256 MiB checkpoint, 100,000-tensor headers) so that
``asv run --python=same --quick`` finishes in a few minutes on two cores;
``scripts/bench_core.py`` measures the full-size targets.
"""

import os
import statistics
import time

from . import common

common.ensure_engine_importable()

IMPLS = ["engine", "reference"]
CKPT_BYTES = 256 << 20
MANY = 100_000


def _safe_open(impl):
    if impl == "reference":
        import safetensors

        return safetensors.safe_open
    import engine

    return engine.safe_open


def _load_file(impl):
    if impl == "reference":
        import safetensors.torch

        return safetensors.torch.load_file
    import engine.torch

    return engine.torch.load_file


def _save_file(impl):
    if impl == "reference":
        import safetensors.torch

        return safetensors.torch.save_file
    if impl == "engine-nofsync":
        import engine.writing.writer

        return lambda tensors, path: engine.writing.writer.save_file(tensors, path, fsync=False)
    import engine.torch

    return engine.torch.save_file


def _open_shapes(opener, path):
    """Open, then read every tensor's dtype and shape through the reference's API."""
    with opener(path, framework="pt") as f:
        out = []
        for k in f.keys():
            s = f.get_slice(k)
            out.append((s.get_dtype(), s.get_shape()))
        return out


def _open_keys(opener, path):
    with opener(path, framework="pt") as f:
        return f.keys()


class _IO(common.OneCallPerSample):
    """Every ``setup`` (asv runs it before each sample) first pays imports and lazy
    first-use costs on a one-tensor file (:func:`common.prepare`), so a ``--quick`` run,
    which times a single call, does not time them; torch runs one intra-op thread.
    """


class HeaderParse(_IO):
    """``engine.read_header``: the Cython parser and validator alone (no reference twin)."""

    params = [[300, MANY]]
    param_names = ["n_tensors"]

    def setup_cache(self):
        return {n: common.many_tensors_file(n) for n in self.params[0]}

    def setup(self, files, n):
        import engine
        from engine.base.dtypes import NAMES

        common.prepare("engine")
        self.read_header, self.names = engine.read_header, NAMES
        self.path = files[n]
        common.warm_cache(self.path)

    def time_read_header(self, files, n):
        self.read_header(self.path)

    def time_read_header_bulk(self, files, n):
        """Every name, dtype and shape, from the table's columns."""
        t = self.read_header(self.path).table
        names = self.names
        list(zip(t.names, [names[c] for c in t.codes.tolist()], t.shapes, strict=True))

    def peakmem_read_header(self, files, n):
        self.read_header(self.path)


class OpenShapes(_IO):
    """``safe_open`` + every ``get_slice(k).get_shape()/get_dtype()``; and open + ``keys()``."""

    params = [IMPLS, [300, MANY]]
    param_names = ["impl", "n_tensors"]

    def setup_cache(self):
        return {n: common.many_tensors_file(n) for n in self.params[1]}

    def setup(self, files, impl, n):
        common.prepare(impl)
        self.open = _safe_open(impl)
        self.path = files[n]
        common.warm_cache(self.path)

    def time_open_shapes(self, files, impl, n):
        _open_shapes(self.open, self.path)

    def time_open_keys(self, files, impl, n):
        _open_keys(self.open, self.path)


class FirstOpen:
    """What a short-lived tool pays: ``import`` + the first ``safe_open(..., "np")`` + every
    dtype and shape of a 291-tensor file, timed in a fresh interpreter (asv's ``timeraw``).

    The engine reads headers without numpy; the reference imports it at ``safe_open``.
    ``first_tensor`` adds one ``get_tensor`` (of an F32 file), so both sides import numpy.
    ``first_open_pt`` and ``first_tensor_pt``: the same with ``framework="pt"`` in a process
    that has imported torch (untimed).  ``scripts/bench_core.py --only first_open first_tensor
    first_open_pt first_tensor_pt`` is the same measurement.
    """

    params = [IMPLS]
    param_names = ["impl"]
    number = 1
    repeat = (5, 15, 30.0)
    warmup_time = 0
    timeout = 300

    def setup(self, impl):
        self.bf16 = common.small_model_file(32)
        self.f32 = common.small_model_file(32, dtype="F32")
        for path in (self.bf16, self.f32):
            common.warm_cache(path)

    def timeraw_first_open(self, impl):
        return common.first_open_code(impl, self.bf16)

    def timeraw_first_tensor(self, impl):
        return common.first_open_code(impl, self.f32, first_tensor=True)

    # a process that has torch already (transformers, vLLM, accelerate): torch imported in
    # asv's untimed setup, then the same calls with framework="pt"
    def timeraw_first_open_pt(self, impl):
        return common.first_open_code(impl, self.bf16, framework="pt"), common.TORCH_SETUP

    def timeraw_first_tensor_pt(self, impl):
        return common.first_open_code(impl, self.bf16, first_tensor=True, framework="pt"), common.TORCH_SETUP


class Starts:
    """What a short-lived process pays before its work: ``import engine`` beside ``import
    safetensors``, and the command line's ``engine inspect`` of a 291-tensor file beside the
    reference's nearest (a script printing every name, dtype and shape: it has no command
    line), each in a fresh interpreter (asv's ``timeraw``).  ``scripts/import_costs.py --starts``
    times the same as whole processes, beside ``python -c pass`` and ``engine --help``.
    """

    params = [IMPLS]
    param_names = ["impl"]
    number = 1
    repeat = (5, 15, 30.0)
    warmup_time = 0
    timeout = 300

    def setup(self, impl):
        self.path = common.small_model_file(32)
        common.warm_cache(self.path)

    def timeraw_import(self, impl):
        return "import engine\n" if impl == "engine" else "import safetensors\n"

    def timeraw_inspect(self, impl):
        if impl == "engine":
            return ("import contextlib, io\n"
                    "from engine.commands.cli import main\n"
                    "with contextlib.redirect_stdout(io.StringIO()):\n"
                    f"    assert main(['inspect', {self.path!r}]) == 0\n")
        return ("import contextlib, io, safetensors\n"
                "with contextlib.redirect_stdout(io.StringIO()):\n"
                f"    with safetensors.safe_open({self.path!r}, framework='np') as f:\n"
                "        for k in f.keys():\n"
                "            s = f.get_slice(k)\n"
                "            print(k, s.get_dtype(), s.get_shape())\n")


class LoadManyTensors(_IO):
    """``load_file`` of 100,000 tiny tensors as torch tensors (per-tensor overhead)."""

    params = [IMPLS]
    param_names = ["impl"]

    def setup_cache(self):
        return common.many_tensors_file(MANY)

    def setup(self, path, impl):
        common.prepare(impl)
        self.load = _load_file(impl)
        common.warm_cache(path)

    def time_load_file(self, path, impl):
        self.load(path)

    def peakmem_load_file(self, path, impl):
        self.load(path)


class LoadCheckpoint(_IO):
    """A BF16 checkpoint, warm page cache: ``load_file`` alone, and then reading every byte.

    With ``"mmap"`` the load is lazy and the read loop pays the page faults; with
    ``"pread"`` the load copies everything into owned memory.
    """

    params = [IMPLS, ["mmap", "pread"]]
    param_names = ["impl", "backend"]

    def setup_cache(self):
        return common.checkpoint_file(CKPT_BYTES)

    def setup(self, path, impl, backend):
        common.prepare(impl)
        self.load = _load_file(impl)
        common.warm_cache(path)

    def time_load_file(self, path, impl, backend):
        self.load(path, backend=backend)

    def time_load_and_read(self, path, impl, backend):
        common.touch_all(self.load(path, backend=backend))

    def peakmem_load_and_read(self, path, impl, backend):
        common.touch_all(self.load(path, backend=backend))


class SaveCheckpoint(_IO):
    """``save_file`` of a BF16 checkpoint with realistic layer shapes.

    "engine" is the default atomic save (temp file, fsync, rename); "engine-nofsync"
    skips the fsync, as the reference always does.
    """

    params = [["engine", "engine-nofsync", "reference"]]
    param_names = ["impl"]
    repeat = (2, 5, 20.0)

    _tensors = None  # made once per process: setup runs before every sample

    def setup(self, impl):
        common.prepare(impl)
        self.save = _save_file(impl)
        if SaveCheckpoint._tensors is None:
            SaveCheckpoint._tensors = common.checkpoint_tensors(CKPT_BYTES)
        self.tensors = SaveCheckpoint._tensors
        self.out = os.path.join(common.cache_dir(), f"save-{os.getpid()}.safetensors")
        common.drop_file(self.out)  # every sample writes a new file,
        os.sync()  # with no writeback of the previous one pending

    def teardown(self, impl):
        common.drop_file(self.out)

    def time_save_file(self, impl):
        self.save(self.tensors, self.out)

    def peakmem_save_file(self, impl):
        self.save(self.tensors, self.out)

    def track_extra_peak_mib(self, impl):
        """Peak RSS during the save minus RSS before it: the writer's own buffers."""
        rss = common.rss_bytes()
        common.reset_hwm()
        self.save(self.tensors, self.out)
        return (common.hwm_bytes() - rss) / (1 << 20)

    track_extra_peak_mib.unit = "MiB"


class Speedup:
    """Reference time / engine time, measured side by side (median of 3, interleaved)."""

    number = 1
    repeat = 1
    warmup_time = 0
    timeout = 900
    unit = "ratio"
    SAMPLES = 3

    def setup_cache(self):
        return {
            "many": common.many_tensors_file(MANY),
            "ckpt": common.checkpoint_file(CKPT_BYTES),
        }

    @classmethod
    def _ratio(cls, make, before, engine_impl="engine"):
        """``make(impl)`` returns the operation to time; imports and a warm-up call happen
        there, untimed.  ``before()`` runs untimed before every sample."""
        for impl in ("reference", engine_impl):
            common.prepare(impl)
        ops = {"reference": make("reference"), "engine": make(engine_impl)}
        times = {impl: [] for impl in ops}
        for _ in range(cls.SAMPLES):
            for impl, op in ops.items():
                before()
                t0 = time.perf_counter()
                op()
                times[impl].append(time.perf_counter() - t0)
        return statistics.median(times["reference"]) / statistics.median(times["engine"])

    def track_open_shapes_100k(self, files):
        def make(impl):
            opener = _safe_open(impl)
            return lambda: _open_shapes(opener, files["many"])

        return self._ratio(make, lambda: common.warm_cache(files["many"]))

    def track_load_many_100k(self, files):
        def make(impl):
            load = _load_file(impl)
            return lambda: load(files["many"])

        return self._ratio(make, lambda: common.warm_cache(files["many"]))

    def track_lazy_load_and_read(self, files):
        def make(impl):
            load = _load_file(impl)
            return lambda: common.touch_all(load(files["ckpt"]))

        return self._ratio(make, lambda: common.warm_cache(files["ckpt"]))

    def track_pread_load(self, files):
        def make(impl):
            load = _load_file(impl)
            return lambda: load(files["ckpt"], backend="pread")

        return self._ratio(make, lambda: common.warm_cache(files["ckpt"]))

    def _save_ratio(self, engine_impl):
        tensors = common.checkpoint_tensors(CKPT_BYTES)
        out = os.path.join(common.cache_dir(), f"speedup-save-{os.getpid()}.safetensors")

        def make(impl):
            save = _save_file(impl)
            return lambda: save(tensors, out)

        def before():  # a new file each time, no writeback of the previous one pending
            common.drop_file(out)
            os.sync()

        try:
            return self._ratio(make, before, engine_impl=engine_impl)
        finally:
            common.drop_file(out)

    def track_save(self, files):
        return self._save_ratio("engine")

    def track_save_nofsync(self, files):
        return self._save_ratio("engine-nofsync")
