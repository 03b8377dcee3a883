"""The per-key loop's cost: ``safe_open(f, device=...)`` then ``get_tensor(k)`` for every key, in
microseconds per key: on the emulated CUDA runtime (``tests/emucudart``) through the engine's chunk
ring, on the CPU (engine and reference), and the ring's native run alone.  Each sample is a fresh
process walking every key twice: ``first`` (ring set up, file mapped) and ``steady``.

    python scripts/bench_per_key.py --tensors 512 --kib 64 --runs 5
"""

from __future__ import annotations

import os
import sys
import tempfile

import harness
from benchmarks import common

VARIANTS = {"engine-emulated": ("device (emulated runtime), get_tensor per key", "engine"),
            "engine-np": ("CPU numpy, get_tensor per key", "engine"),
            "engine-pread": ("CPU numpy, get_tensor per key", "engine, backend=pread"),
            "reference-np": ("CPU numpy, get_tensor per key", "reference"),
            "reference-pt": ("CPU torch, get_tensor per key", "reference"),
            "ring-alone": ("ChunkRing.run of one tensor's chunk (emulated)", "engine")}


def _ring_alone(path: str):
    """An object whose ``get_tensor`` is the native run of a one-chunk load: what a key costs below
    ``device_ring.load``."""
    import mmap

    import numpy as np
    from emucudart import EmulatedRingOps, Emulator

    import engine
    from engine.gpu import rings
    from engine.gpu.geometry import default_geometry

    ring = rings.new_ring(EmulatedRingOps(Emulator()), default_geometry())
    h = engine.read_header(path)
    t = h.table
    n = int(t.ends[0] - t.begins[0])
    fd = os.open(path, os.O_RDONLY)
    src = np.frombuffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ), np.uint8)
    dst = np.zeros(n, np.uint8)
    plan = (np.zeros(1, np.int32), np.array([0, 1], np.int64), np.zeros(1, np.int64),
            np.array([h.data_start + int(t.begins[0])], np.int64), np.array([n], np.int64),
            np.array([dst.ctypes.data], np.uint64), np.array([fd], np.int32),
            np.array([src.ctypes.data], np.uint64), np.array([len(src)], np.int64), np.ones(1, np.uint8))

    class Run:
        def keys(self):
            return range(len(t.names))

        def get_tensor(self, k):
            ring.run(*plan)

    return Run()


def sample(path: str, variant: str) -> list[float]:
    """Microseconds per key of two walks over every key, in this fresh process."""
    if variant == "ring-alone":
        h = _ring_alone(path)
    elif variant.startswith("engine"):
        import engine

        h = engine.safe_open(path, framework="np", backend="pread" if variant == "engine-pread" else "mmap")
        if variant == "engine-emulated":
            from emucudart import EmulatedRingOps, EmulatedSink, Emulator

            h._sink_obj = EmulatedSink(EmulatedRingOps(Emulator()))
    else:
        import safetensors

        h = safetensors.safe_open(path, framework="np" if variant == "reference-np" else "pt")
    keys = list(h.keys())

    def walk():
        for k in keys:
            h.get_tensor(k)

    return [t / len(keys) for t in harness.times(walk, 2, warmup=0)]


def main(argv=None) -> int:
    ap = harness.parser(__doc__, runs=5, dir=None)
    ap.add_argument("--tensors", type=int, default=512)
    ap.add_argument("--kib", type=int, default=64, help="KiB per tensor")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.dir) as folder:
        path = harness.checkpoint(0, folder, entries=[(f"layer.{i}.weight", "F32", (a.kib * 256,))
                                                      for i in range(a.tensors)])
        common.warm_cache(path)
        got = harness.rounds(VARIANTS, a.runs, lambda v: harness.call(sample, path, v), warmup=True)
    report = harness.Report()
    for variant, samples in got.items():
        case, impl = VARIANTS[variant]
        report.add(case, impl, [s[1] for s in samples], a.kib << 10, first_walk_s=harness.median(s[0] for s in samples))
    report.ratio("x_reference_torch", report.seconds("CPU torch, get_tensor per key", "reference"))
    report.note(f"{a.tensors} tensors of {a.kib} KiB; median seconds per key of the steady (second) walk")
    return report.finish(a.json, "case", "impl", "median_s", "first_walk_s", "x_reference_torch")


if __name__ == "__main__":
    sys.exit(main())
