"""The per-key loop's cost: ``safe_open(f, device=...)`` then ``get_tensor(k)`` for every key,
as accelerate's ``load_state_dict`` and many servers walk a checkpoint, in microseconds per key.

On this machine the device is the emulated CUDA runtime (``tests/emucudart``: the same entry
points as ``libcudart``, copies run on a stream thread), driven through the engine's own handle,
loaders and chunk ring, beside CPU loops that need no device: the engine's and the reference's
``get_tensor`` (numpy views of the mapping, and torch CPU tensors for the reference).  On a GPU
host ``scripts/gpu_check.py`` times the same loop on the real device against the reference.

Each sample is a fresh process that walks every key twice: ``first`` is the process's first
walk (it sets the ring up and maps the file), ``steady`` the second.  Medians over ``--runs``.

    python -m compileall -q engine && python scripts/bench_per_key.py --tensors 512 --kib 64 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

VARIANTS = {
    "engine device (emulated runtime), get_tensor per key": "engine-emulated",
    "engine CPU numpy, get_tensor per key": "engine-np",
    "engine CPU numpy backend=pread, get_tensor per key": "engine-pread",
    "reference CPU numpy, get_tensor per key": "reference-np",
    "reference CPU torch, get_tensor per key": "reference-pt",
    "ring alone: ChunkRing.run of one tensor's chunk (emulated)": "ring-alone",
}

_CHILD = r"""
import json, os, sys, time
sys.path[:0] = [{root!r}, os.path.join({root!r}, "tests")]
path, variant = {path!r}, {variant!r}
if variant == "ring-alone":
    # the native run of a one-chunk load, no Python around it: what a key costs below device_ring.load
    import mmap
    import numpy as np
    import engine
    from emucudart import EmulatedRingOps, Emulator
    from engine.gpu import rings
    from engine.gpu.geometry import default_geometry
    ops = EmulatedRingOps(Emulator())
    ring = rings.new_ring(ops, default_geometry())
    h = engine.read_header(path)
    t = h.table
    n = int(t.ends[0] - t.begins[0])
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    src = np.frombuffer(m, np.uint8)
    dst = np.zeros(n, np.uint8)
    plan = (np.zeros(1, np.int32), np.array([0, 1], np.int64), np.zeros(1, np.int64),
            np.array([h.data_start + int(t.begins[0])], np.int64), np.array([n], np.int64),
            np.array([dst.ctypes.data], np.uint64), np.array([fd], np.int32),
            np.array([src.ctypes.data], np.uint64), np.array([len(src)], np.int64), np.ones(1, np.uint8))
    keys = range(len(t.names))

    class _Run:
        def get_tensor(self, k):
            ring.run(*plan)

    h = _Run()
elif variant.startswith("engine"):
    import engine
    if variant == "engine-emulated":
        from emucudart import EmulatedRingOps, EmulatedSink, Emulator
        ops = EmulatedRingOps(Emulator())
    h = engine.safe_open(path, framework="np", backend="pread" if variant == "engine-pread" else "mmap")
    if variant == "engine-emulated":
        h._sink_obj = EmulatedSink(ops)
else:
    import safetensors
    h = safetensors.safe_open(path, framework="np" if variant == "reference-np" else "pt")
keys = list(keys) if variant == "ring-alone" else list(h.keys())
out = []
for _ in range(2):
    t0 = time.perf_counter()
    for k in keys:
        h.get_tensor(k)
    out.append((time.perf_counter() - t0) / len(keys) * 1e6)
print(json.dumps(out))
"""


def make(path: str, tensors: int, kib: int) -> None:
    import numpy as np

    import engine

    rng = np.random.default_rng(0)
    n = kib * 1024 // 4
    engine.save_file({f"layer.{i}.weight": rng.standard_normal(n).astype(np.float32) for i in range(tensors)}, path)


def sample(path: str, variant: str) -> tuple[float, float]:
    code = _CHILD.format(root=ROOT, path=path, variant=variant)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    first, steady = json.loads(out.stdout.strip().splitlines()[-1])
    return first, steady


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=512, help="tensors in the generated file")
    ap.add_argument("--kib", type=int, default=64, help="KiB per tensor")
    ap.add_argument("--runs", type=int, default=5, help="fresh-process samples per variant")
    ap.add_argument("--dir", default=None, help="where to write the file (default a temporary folder)")
    args = ap.parse_args()
    folder = args.dir or tempfile.mkdtemp()
    path = os.path.join(folder, "per_key.safetensors")
    make(path, args.tensors, args.kib)
    with open(path, "rb") as f:  # warm: the page cache holds the file
        while f.read(1 << 24):
            pass
    for variant in VARIANTS.values():
        sample(path, variant)  # warm-up: imports, the emulator's build
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS.values()}
    t0 = time.perf_counter()
    for _ in range(args.runs):  # rounds interleaved: drift hits every variant alike
        for variant in VARIANTS.values():
            results[variant].append(sample(path, variant))
    print(f"{args.tensors} tensors of {args.kib} KiB, {args.runs} fresh processes each "
          f"({time.perf_counter() - t0:.0f} s); microseconds per key, medians")
    print(f"{'loop':<58} {'first walk':>11} {'steady':>9}")
    med = {}
    for label, variant in VARIANTS.items():
        first = statistics.median(x for x, _ in results[variant])
        steady = statistics.median(y for _, y in results[variant])
        med[variant] = steady
        print(f"{label:<58} {first:>9.1f} us {steady:>6.1f} us")
    ref = med["reference-pt"]
    print(f"engine device loop / reference CPU torch loop (steady, time per key): "
          f"{med['engine-emulated'] / ref:.2f}x")
    if not args.dir:
        os.remove(path)


if __name__ == "__main__":
    main()
