"""Hooked device loads (``stats=True``, ``quantize="int8"``) against the plain device load,
through the chunk ring on the emulated CUDA runtime with no-op copies: what launching each
landed tensor's kernels costs the ring's chunk rate (the line: hooked >= 0.9x plain).

The device is ``tests/emucudart`` (the runtime's entry points on the CPU) with
``Emulator.noop``: copies move no bytes, so the ring's own rate is what is timed.  The kernels
are Numba's under its simulator (``NUMBA_ENABLE_CUDASIM=1``, set here) with each launch
queued and not run, as a GPU queues it: every step of the host side of a hooked load (the
ring's reports, the accumulators and outputs made, the launches' arguments, one gather per
batch) runs, the device's arithmetic does not (``scripts/gpu_check.py`` times that on a GPU).

Every load is ``engine.stream(path, device=...)`` over a Llama-shaped file (2-D weights,
BF16, 1-D norms), the rows interleaved run by run; the median of ``--runs`` per row, GB/s
and chunks per second from the ring's records (``engine.load_records``).

    python scripts/bench_hooked.py --mib 1024 --runs 5
    python scripts/bench_hooked.py --dry-run        # 32 MiB, one run: that the script works

With no-op copies the ring's copy threads fill chunks as fast as the cores allow, so on a host
with few cores the hooked rows' Python (the launches, the hand-out) takes cores from them,
which a GPU host's spare cores do not: ``ENGINE_RING=4,32,1`` (one copy thread, every row
alike) leaves a core free on a 2-core machine.
"""

from __future__ import annotations

import os

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before Numba is imported, by the engine or anyone

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checkout_path  # noqa: E402

ROOT = checkout_path.use_checkout()
sys.path.insert(1, os.path.join(ROOT, "tests"))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from emucudart import EmulatedRingOps, EmulatedSink, Emulator  # noqa: E402

import engine  # noqa: E402
import engine.loading.loader  # noqa: E402
import engine.numpy  # noqa: E402
from engine.gpu import rings  # noqa: E402
from engine.gpu.records import load_records  # noqa: E402
from engine.loading import kernel_probe  # noqa: E402
from engine.quantize import Int8  # noqa: E402

#: the kernels run nothing here (their NaN counts are whatever memory held): clamp, never raise
ROWS = {"plain": {}, "stats=True": {"stats": True}, 'quantize="int8"': {"quantize": Int8(on_nonfinite="clamp")}}


class Sink(EmulatedSink):
    """The emulated runtime's sink, with the hooks' device arrays (numpy) carved from one
    arena emptied before each load, as a framework's caching allocator hands out device
    memory without a system call (``numpy.empty`` of megabytes maps and unmaps memory each
    time, which a device allocator does not).  The partial results and counts (int64,
    float64) are zeroed, as the kernels that would set them up run nothing here; outputs and
    scratch (int8, uint8, float32 scales) are not (an allocator does not touch memory)."""

    name = "emulated"

    def __init__(self, ops, arena_bytes: int) -> None:
        super().__init__(ops)
        self.arena = np.empty(arena_bytes, np.uint8)  # never touched but for the zeroed arrays
        self.used = 0

    def reset(self) -> None:
        """Before a load: the last load's arrays are gone (the loop keeps none)."""
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


def make_file(path: str, mib: int) -> int:
    """Llama-shaped layers of BF16 until ``mib`` MiB: q/k/v/o and three MLP matrices, norms."""
    rng = np.random.default_rng(0)
    hidden, inter = 1024, 2816
    sd, total, i = {}, 0, 0
    while total < mib << 20:
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (hidden, hidden)), ("self_attn.k_proj", (hidden // 4, hidden)),
                            ("self_attn.v_proj", (hidden // 4, hidden)), ("self_attn.o_proj", (hidden, hidden)),
                            ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                            ("mlp.down_proj", (hidden, inter))):
            sd[p + name + ".weight"] = rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)
        sd[p + "input_layernorm.weight"] = np.ones(hidden, ml_dtypes.bfloat16)
        total = sum(x.nbytes for x in sd.values())
        i += 1
    engine.numpy.save_file(sd, path)
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="file size, MiB")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="32 MiB, one run")
    ap.add_argument("--dir", default=None, help="where to make the file (default a temporary folder)")
    args = ap.parse_args()
    if args.dry_run:
        args.mib, args.runs = 32, 1
    from engine.numerics import device

    launches = [0]

    def queued(kernel, config, *a):  # a GPU queues the launch and returns: the host side's cost alone
        device.check_launch(config[0], config[1])
        launches[0] += 1

    device._launch = queued
    kernel_probe._KERNELS[:] = [None]  # the kernels "work": no fallback
    emulator = Emulator()
    emulator.noop(True)
    ops = EmulatedRingOps(emulator)
    sink = Sink(ops, 3 * (args.mib << 20) + (64 << 20))  # int8 outputs and scratch: under 2x the file
    engine.loading.loader.get_sink = lambda framework, dev: sink
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "model.safetensors")
        nbytes = make_file(path, args.mib)
        with open(path, "rb") as f:  # the page cache warm
            while f.read(64 << 20):
                pass
        seconds: dict[str, list[float]] = {r: [] for r in ROWS}
        chunks: dict[str, list[float]] = {r: [] for r in ROWS}
        records_of: dict[str, list] = {}
        for _ in range(args.runs + 1):  # the first round warms the ring and the kernels' set-up: not counted
            for row, kw in ROWS.items():
                launches[0] = 0
                sink.reset()
                with load_records() as records:
                    t0 = time.perf_counter()
                    for _item in engine.stream(path, framework="np", device="cuda", **kw):
                        pass
                    dt = time.perf_counter() - t0
                records_of[row] = list(records)
                seconds[row].append(dt)
                chunks[row].append(sum(r.chunks for r in records) / dt)
                records_of[row + " launches"] = [launches[0]]
        rings.release_rings()
        ops.close()
    base = statistics.median(seconds["plain"][1:])
    print(f"{nbytes / 2**20:.0f} MiB, {args.runs} run(s), emulated runtime with no-op copies, "
          f"kernels queued not run (Numba's simulator)")
    print(f"{'row':18} {'GB/s':>7} {'chunks/s':>9} {'vs plain':>9} {'ring runs':>9} {'reported':>8} "
          f"{'report_s':>8} {'launches':>8}")
    for row in ROWS:
        s = statistics.median(seconds[row][1:])
        recs = records_of[row]
        print(f"{row:18} {nbytes / s / 1e9:7.2f} {statistics.median(chunks[row][1:]):9.0f} {base / s:8.2f}x "
              f"{len(recs):9d} {sum(r.reported for r in recs):8d} {sum(r.report_s for r in recs):8.3f} "
              f"{records_of[row + ' launches'][0]:8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
