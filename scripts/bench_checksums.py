"""What verifying per-tensor checksums costs a load, and what adding them costs a file.

One warm BF16 checkpoint (1 GB by default, ``asv_benchmarks`` ``checkpoint_entries``) is
written twice: plain, and with a CRC-32C per tensor (``engine.add_checksums``).  Rows, every
sample a fresh process (rows interleaved, ``--runs`` samples each), each printed as the
median GB/s of the calls after a first untimed one:

* ``owned, verify`` / ``owned, skip``: ``engine.numpy.load_file(backend="pread")`` of the
  checksummed file, with verification (the default) and with ``verify_checksums=False``;
  ``owned, plain file``: the same load of the file without checksums (today's path, no
  checksum work at all).  The ratio verify/skip is the cost of the check;
* ``ring host side, verify`` / ``skip``: the device copy path (the native chunk ring, its
  default geometry) over the emulated runtime whose copies move no bytes
  (``asv_benchmarks`` ``host.BenchDevice(dma="none")``): page cache -> page-locked chunk, the
  CRC taken by the copy threads as they fill each chunk;
* ``add_checksums`` against ``copy``: rewriting the plain file with its checksums against a
  streamed copy of the same file (same step size, read and written) and ``shutil.copyfile``
  (which may use ``copy_file_range``), each into a new file in the same folder (removed
  after each call).

Run: ``python scripts/bench_checksums.py [--size 1GiB] [--runs 7] [--reps 5] [--dir DIR]``
(``--size 64MiB --runs 1 --reps 1`` for a dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout this script is in, not an installed engine
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "asv_benchmarks"))
from benchmarks import common, host  # noqa: E402

ROWS = ["owned, verify", "owned, skip", "owned, plain file", "ring host side, verify", "ring host side, skip",
        "add_checksums", "copy, streamed", "copy, shutil.copyfile"]


def _times(run, reps: int) -> list[float]:
    run()  # untimed: thread start, first touch of the destination
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        out.append(time.perf_counter() - t0)
    return out


def _ring(path: str, verify: bool):
    import numpy as np

    import engine
    from engine.format import checksums
    from engine.loading import pipeline
    from engine.planning.plan import plan_reads

    h = engine.read_header(path)
    t = h.table
    rows = list(t.file_order())
    requests = plan_reads(t.begins, t.ends, rows, h.data_start)
    block = host.prefaulted(h.data_size)
    targets = {r: block[int(t.begins[r]) : int(t.ends[r])] for r in rows if int(t.ends[r]) > int(t.begins[r])}
    fd = os.open(path, os.O_RDONLY)
    checks = checksums.Checks.of(h, path) if verify else None
    assert verify == (checks is not None), "the file must carry checksums"

    def run() -> None:
        dev = host.BenchDevice("none")
        try:
            pipeline.run_sources([pipeline.Source(fd, path, requests, checks=checks)],
                                 pipeline.Destination(device_targets=targets, device_ops=dev),
                                 threads=host.threads(), gpu_path="copy")
        finally:
            dev.close()

    del np
    return run


def child(kind: str, path: str, plain: str, reps: int) -> dict:
    import engine.numpy
    from engine.format import checksums

    nbytes = engine.read_header(path).data_size
    if kind == "owned, verify":
        def run():
            engine.numpy.load_file(path, backend="pread")
    elif kind == "owned, skip":
        def run():
            engine.numpy.load_file(path, backend="pread", verify_checksums=False)
    elif kind == "owned, plain file":
        def run():
            engine.numpy.load_file(plain, backend="pread")
    elif kind.startswith("ring host side"):
        run = _ring(path, kind.endswith("verify"))
    else:
        # each call replaces an existing copy of the plain file, as add_checksums replaces its file:
        # the copies write a new file and rename it over the old one too
        out_path = os.path.join(os.path.dirname(plain), "rewrite.safetensors")
        temp = out_path + ".tmp"

        def run():
            shutil.copyfile(plain, out_path)  # untimed: the file to replace
            t0 = time.perf_counter()
            if kind == "add_checksums":
                checksums.add_checksums(out_path, fsync=False)
            elif kind == "copy, shutil.copyfile":
                shutil.copyfile(plain, temp)
                os.replace(temp, out_path)
            else:
                _streamed_copy(plain, temp, checksums.STEP_BYTES)
                os.replace(temp, out_path)
            return time.perf_counter() - t0

        run()
        times = [run() for _ in range(reps)]
        os.remove(out_path)
        return {"kind": kind, "repeated": times, "nbytes": nbytes}
    return {"kind": kind, "repeated": _times(run, reps), "nbytes": nbytes}


def _streamed_copy(src: str, dst: str, step: int) -> None:
    """A plain copy as add_checksums reads and writes: steps of ``step`` through one buffer."""
    fi = os.open(src, os.O_RDONLY)
    fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    buf = memoryview(bytearray(step))
    try:
        pos = 0
        while True:
            got = os.preadv(fi, [buf], pos)
            if not got:
                break
            view = buf[:got]
            while view:
                n = os.pwrite(fo, view, pos + got - len(view))
                view = view[n:]
            pos += got
    finally:
        os.close(fi)
        os.close(fo)


def sample(kind: str, path: str, plain: str, reps: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--path", path, "--plain", plain,
           "--reps", str(reps)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{kind}: exit {done.returncode}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--rows", default=None, help="only the rows whose label contains this text")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--plain", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.path, args.plain, args.reps)))
        return 0

    from engine.format import checksums

    size = common.parse_size(args.size)
    folder = common.cache_dir(args.dir)
    plain = os.path.join(folder, f"crc-plain-{size}.safetensors")
    path = os.path.join(folder, f"crc-checked-{size}.safetensors")
    if not os.path.exists(plain):
        common.write_file(plain, common.checkpoint_entries(size))
    if not os.path.exists(path):
        shutil.copyfile(plain, path)
        checksums.add_checksums(path, fsync=False)
    for p in (plain, path):  # warm
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass
    rows = [r for r in ROWS if args.rows is None or args.rows in r]
    got: dict[str, list[float]] = {r: [] for r in rows}
    nbytes = 0
    for _ in range(args.runs):
        for r in rows:  # interleaved: a slow moment of the machine falls on every row alike
            s = sample(r, path, plain, args.reps)
            got[r].append(statistics.median(s["repeated"]))
            nbytes = s["nbytes"]
    print(f"{nbytes / 1e9:.2f} GB of tensor data, {args.runs} samples x {args.reps} calls, CRC-32C in hardware: "
          f"{checksums.hardware()}")
    for r in rows:
        sec = statistics.median(got[r])
        print(f"  {r:<26} {nbytes / sec / 1e9:7.2f} GB/s  ({sec * 1e3:8.1f} ms)")

    def ratio(a: str, b: str) -> None:
        if a in got and b in got:
            print(f"  {a} / {b}: {statistics.median(got[b]) / statistics.median(got[a]):.3f}x the speed")

    ratio("owned, verify", "owned, skip")
    ratio("owned, skip", "owned, plain file")
    ratio("ring host side, verify", "ring host side, skip")
    ratio("add_checksums", "copy, streamed")
    ratio("add_checksums", "copy, shutil.copyfile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
