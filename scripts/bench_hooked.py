"""Hooked device loads (``stats=True``, ``quantize="int8"``) against the plain device load through
the chunk ring: what launching each tensor's kernels costs the ring's chunk rate.  The device is
``tests/emucudart`` with no-op copies, the kernels Numba's simulator with each launch queued and not
run, as a GPU queues it (``scripts/gpu_check.py`` times the device side).

    python scripts/bench_hooked.py --mib 1024 --runs 5
    python scripts/bench_hooked.py --dry-run        # 32 MiB, one run: that the script works
"""

from __future__ import annotations

import os

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before Numba is imported, by the engine or anyone

import sys  # noqa: E402
import tempfile  # noqa: E402

import harness  # noqa: E402
import numpy as np  # noqa: E402
from benchmarks import common  # noqa: E402
from emucudart import EmulatedRingOps, EmulatedSink, Emulator  # noqa: E402

import engine  # noqa: E402
import engine.loading.loader  # noqa: E402
from engine.gpu import rings  # noqa: E402
from engine.gpu.records import load_records  # noqa: E402
from engine.loading import kernel_probe  # noqa: E402
from engine.quantize import Int8  # noqa: E402

#: the kernels run nothing here (their NaN counts are whatever memory held): clamp, never raise
ROWS = {"plain": {}, "stats=True": {"stats": True}, 'quantize="int8"': {"quantize": Int8(on_nonfinite="clamp")}}


class Sink(EmulatedSink):
    """The emulated runtime's sink, with the hooks' device arrays carved from one arena emptied
    before each load, as a framework's caching allocator hands out device memory without a system
    call.  The int64/float64 partial results and counts are zeroed (the kernels that would set them
    up run nothing here); outputs and scratch are not (an allocator does not touch memory)."""

    name = "emulated"

    def __init__(self, ops, arena_bytes: int) -> None:
        super().__init__(ops)
        self.arena = np.empty(arena_bytes, np.uint8)
        self.used = 0

    def reset(self) -> None:
        self.used = 0

    def empty_device(self, shape, dtype):
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self.used + n > len(self.arena):
            raise MemoryError("the bench's device arena is full: raise arena_bytes")
        a = self.arena[self.used : self.used + n].view(dtype).reshape(shape)
        self.used += -(-max(n, 1) // 256) * 256
        if dtype.itemsize == 8:
            a.fill(0)
        return a


def main(argv=None) -> int:
    ap = harness.parser(__doc__, runs=5, dir=None)
    ap.add_argument("--mib", type=int, default=1024, help="file size, MiB")
    ap.add_argument("--dry-run", action="store_true", help="32 MiB, one run")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.mib, a.runs = 32, 1
    from engine.numerics import device

    launches = [0]

    def queued(kernel, config, *args):  # a GPU queues the launch and returns: the host side's cost alone
        device.check_launch(config[0], config[1])
        launches[0] += 1

    device._launch = queued
    kernel_probe._KERNELS[:] = [None]  # the kernels "work": no fallback
    emulator = Emulator()
    emulator.noop(True)
    ops = EmulatedRingOps(emulator)
    sink = Sink(ops, 3 * (a.mib << 20) + (64 << 20))  # int8 outputs and scratch: under 2x the file
    engine.loading.loader.get_sink = lambda framework, dev: sink
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        hidden, inter, layers = 1024, 2816, -(-(a.mib << 20) // (2 * 1024 * (2 * 1024 + 2 * 256 + 3 * 2816)))
        shapes = {"self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (hidden // 4, hidden),
                  "self_attn.v_proj.weight": (hidden // 4, hidden), "self_attn.o_proj.weight": (hidden, hidden),
                  "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
                  "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,)}
        path = harness.checkpoint(0, d, values="weights", entries=[
            (f"model.layers.{i}.{k}", "BF16", s) for i in range(layers) for k, s in shapes.items()])
        nbytes = engine.read_header(path).data_size
        common.warm_cache(path)

        def load(row):
            launches[0] = 0
            sink.reset()
            with load_records() as records:
                seconds = harness.times(lambda: [None for _ in engine.stream(path, framework="np", device="cuda",
                                                                              **ROWS[row])], 1, warmup=0)[0]
            return {"seconds": seconds, "chunks": sum(r.chunks for r in records), "runs": len(records),
                    "reported": sum(r.reported for r in records), "report_s": sum(r.report_s for r in records),
                    "launches": launches[0]}

        got = harness.rounds(ROWS, a.runs, load, warmup=True)  # the warm-up: the ring and the kernels' set-up
        rings.release_rings()
        ops.close()
    report = harness.Report()
    for row, samples in got.items():
        last = samples[-1]
        report.add(f"file -> emulated device, {a.mib} MiB", "engine" + f", {row}" * (row != "plain"),
                   [s["seconds"] for s in samples], nbytes,
                   chunks_per_second=harness.median(s["chunks"] / s["seconds"] for s in samples), ring_runs=last["runs"],
                   reported=last["reported"], report_s=last["report_s"], launches=last["launches"])
    report.ratio("x_plain", report.rows[0]["median_s"])
    report.note("emulated runtime with no-op copies, kernels queued not run (Numba's simulator)")
    return report.finish(a.json, "impl", "median_s", "gbps", "chunks_per_second", "x_plain", "ring_runs", "reported",
                         "report_s", "launches")


if __name__ == "__main__":
    sys.exit(main())
