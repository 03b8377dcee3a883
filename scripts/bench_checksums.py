"""What verifying per-tensor checksums costs a load, and what adding them costs a file.

One warm BF16 checkpoint written plain and with a CRC-32C per tensor: the owned load and the chunk
ring (emulated runtime) verifying or not, and ``add_checksums`` against plain copies of the file.
Every sample a fresh process, the median of ``--reps`` calls after an untimed one.

    python scripts/bench_checksums.py --size 64MiB --runs 1 --reps 1      # a dry run
"""

from __future__ import annotations

import os
import shutil
import sys

import harness
from benchmarks import common, host

# (case, impl)
ROWS = [("owned load", "engine, verify"), ("owned load", "engine, skip"), ("owned load", "engine, plain file"),
        ("page cache -> page-locked chunk", "engine, verify"), ("page cache -> page-locked chunk", "engine, skip"),
        ("rewrite a file", "engine add_checksums"), ("rewrite a file", "limit: streamed copy"),
        ("rewrite a file", "limit: shutil.copyfile")]


def _streamed_copy(src: str, dst: str, step: int) -> None:
    """A plain copy as add_checksums reads and writes: steps of ``step`` through one buffer."""
    buf = memoryview(bytearray(step))
    with open(src, "rb", buffering=0) as fi, open(dst, "wb", buffering=0) as fo:
        while got := fi.readinto(buf):
            fo.write(buf[:got])


def sample(case: str, impl: str, path: str, plain: str, reps: int) -> list[float]:
    """One sample (a fresh process): seconds of ``reps`` calls after an untimed one."""
    import engine.numpy
    from engine.format import checksums

    if case == "owned load":
        kw = {"verify_checksums": False} if impl.endswith("skip") else {}
        src = plain if impl.endswith("plain file") else path
        return harness.times(lambda: engine.numpy.load_file(src, backend="pread", **kw), reps)
    if case.startswith("page cache"):
        return harness.times(host.RingLoad(path, dma="none", verify=impl.endswith("verify")).run, reps)
    # each call replaces an existing copy of the plain file, as add_checksums replaces its file
    out = os.path.join(os.path.dirname(plain), "rewrite.safetensors")
    temp = out + ".tmp"

    def rewrite() -> None:
        if impl == "engine add_checksums":
            checksums.add_checksums(out, fsync=False)
            return
        if impl.endswith("copyfile"):
            shutil.copyfile(plain, temp)
        else:
            _streamed_copy(plain, temp, checksums.STEP_BYTES)
        os.replace(temp, out)

    times = []
    for _ in range(reps + 1):
        shutil.copyfile(plain, out)  # untimed: the file to replace
        times += harness.times(rewrite, 1, warmup=0)
    os.remove(out)
    return times[1:]


def main(argv=None) -> int:
    ap = harness.parser(__doc__, size="1GiB", runs=7, reps=5, dir=None)
    ap.add_argument("--rows", help="only the rows whose case or impl contains this text")
    a = ap.parse_args(argv)
    from engine.format import checksums

    size = a.size
    folder = common.cache_dir(a.dir)
    plain = os.path.join(folder, f"crc-plain-{size}.safetensors")
    path = os.path.join(folder, f"crc-checked-{size}.safetensors")
    if not os.path.exists(plain):
        common.write_file(plain, common.checkpoint_entries(size))
    if not os.path.exists(path):
        shutil.copyfile(plain, path)
        checksums.add_checksums(path, fsync=False)
    common.warm_cache(plain)
    common.warm_cache(path)
    rows = [r for r in ROWS if a.rows is None or a.rows in ", ".join(r)]
    got = harness.rounds(rows, a.runs, lambda r: harness.median(harness.call(sample, *r, path, plain, a.reps)))
    report = harness.Report()
    nbytes = host.data_range(plain)[1]
    for (case, impl), secs in got.items():
        report.add(case, impl, secs, nbytes)
    report.ratio("x_skip", lambda r: report.seconds(r["case"], "engine, skip"))
    report.ratio("x_copy", lambda r: report.seconds(r["case"], "limit: streamed copy"))
    report.note(f"CRC-32C in hardware: {checksums.hardware()}")
    return report.finish(a.json, "case", "impl", "median_s", "gbps", "x_skip", "x_copy")


if __name__ == "__main__":
    sys.exit(main())
