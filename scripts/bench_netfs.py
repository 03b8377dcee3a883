#!/usr/bin/env python
"""Loads from a network-like mount: a file read through a real FUSE file system (bindfs over
a tmpfs folder, so that the daemon, not a disk, is what each read crosses), cold in the FUSE
mount's page cache for every sample.

Rows, each the median of ``--runs`` fresh processes (torch imported, destination tensors
allocated and touched before the timing), interleaved:

* ``floor``: native code, nothing of the engine's, as ``scripts/bench_host.py`` prices a load:
  ``asv_benchmarks/benchmarks/host.py`` ``Floor(path, "pread")``, one thread per core, each
  ``pread``-ing its contiguous share in 16 MiB requests into pre-faulted memory.  Through a
  FUSE mount the shares are far-apart streams on one descriptor, which the kernel's read-ahead
  takes for random reads, so this is a floor and not the mount's limit;
* ``one stream``: one thread reading the file front to back with 8 MiB ``preadv`` calls (what a
  ``cat`` of the file costs through the mount);
* ``load_into``: ``engine.load_into`` as it chooses its source (``pread`` on a network or
  FUSE mount);
* ``load_into mapped``: the same with ``ENGINE_COPY_SOURCE=mmap``, the source it took on such
  a mount before (a populated mapping: the file faulted in through the mount);
* ``get_tensor loop``: ``engine.safe_open(f, "pt")``, ``get_tensor`` of every name in sorted
  order and a copy into the destination (the loop of sglang's and vLLM's weight iterators);
* ``reference``: the same loop with the reference ``safetensors``.

Needs root (or FUSE rights), bindfs and /dev/fuse.  Prints GB/s and ratios to the floor and
to the reference.

    python scripts/bench_netfs.py                 # 1 GiB of F32, 5 runs
    python scripts/bench_netfs.py --gib 2 --runs 7
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

CHILD = r"""
import os, sys, time
import torch
path, row = sys.argv[1], sys.argv[2]
import engine
if row == "floor":
    sys.path.insert(0, "asv_benchmarks")
    from benchmarks import host
    floor = host.Floor(path, "pread")  # its destination is allocated and touched here, untimed
h = engine.read_header(path)
dest = {k: torch.empty(i.shape, dtype=torch.float32) for k, i in h.items()}
for t in dest.values():
    t.fill_(0)
fd = os.open(path, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold in the FUSE mount's page cache
os.close(fd)
t0 = time.perf_counter()
if row == "floor":
    floor.run()
elif row == "one stream":
    fd = os.open(path, os.O_RDONLY)
    buf = bytearray(8 << 20)
    while os.readv(fd, [buf]):
        pass
    os.close(fd)
elif row.startswith("load_into"):
    engine.load_into(path, dest)
else:
    lib = engine if row == "get_tensor loop" else __import__("safetensors")
    with lib.safe_open(path, framework="pt") as f:
        for k in sorted(f.keys()):
            dest[k].copy_(f.get_tensor(k))
print(time.perf_counter() - t0)
"""

ROWS = ("floor", "one stream", "load_into", "load_into mapped", "get_tensor loop", "reference")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="file size in GiB of F32 tensors of 32 MiB")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    if shutil.which("bindfs") is None or not os.path.exists("/dev/fuse"):
        sys.exit("needs bindfs (apt-get install bindfs) and /dev/fuse")
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(REPO, "engine")], check=True)
    base = tempfile.mkdtemp(prefix="engine-netfs-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    src, mnt = os.path.join(base, "src"), tempfile.mkdtemp(prefix="engine-netfs-mnt-")
    os.makedirs(src)
    try:
        import numpy as np

        sys.path.insert(0, REPO)
        import engine.numpy

        n = max(1, round(a.gib * 32))
        rng = np.random.default_rng(0)
        engine.numpy.save_file({f"layers.{i}.weight": rng.standard_normal((2048, 4096), dtype=np.float32)
                                for i in range(n)}, os.path.join(src, "m.safetensors"))
        size = os.path.getsize(os.path.join(src, "m.safetensors"))
        subprocess.run(["bindfs", src, mnt], check=True)
        try:
            path = os.path.join(mnt, "m.safetensors")
            times: dict[str, list[float]] = {r: [] for r in ROWS}
            for run in range(a.runs + 1):  # the first round warms up, untimed
                for row in ROWS:
                    env = dict(os.environ)
                    env.pop("ENGINE_COPY_SOURCE", None)
                    if row == "load_into mapped":
                        env["ENGINE_COPY_SOURCE"] = "mmap"
                    out = subprocess.run([sys.executable, "-c", CHILD, path, row], capture_output=True, text=True,
                                         cwd=REPO, env=env)
                    if out.returncode:
                        sys.exit(f"{row}: {out.stderr.strip()[-400:]}")
                    if run:
                        times[row].append(float(out.stdout.split()[-1]))
        finally:
            subprocess.run(["fusermount", "-u", mnt], check=False)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(mnt, ignore_errors=True)
    med = {r: statistics.median(v) for r, v in times.items()}
    print(f"{size / 1e9:.2f} GB through bindfs (FUSE) over tmpfs, cold in the mount's page cache, "
          f"median of {a.runs} fresh processes")
    print("| row | ms | GB/s | x floor | x reference | samples (ms) |")
    print("|---|---|---|---|---|---|")
    for r in ROWS:
        print(f"| {r} | {med[r] * 1e3:.0f} | {size / med[r] / 1e9:.2f} | {med['floor'] / med[r]:.2f} | "
              f"{med['reference'] / med[r]:.2f} | {' '.join(f'{t * 1e3:.0f}' for t in times[r])} |")


if __name__ == "__main__":
    main()
