"""Loads from a network-like mount: a file read through bindfs (FUSE) over a tmpfs folder, cold in
the mount's page cache for every sample, each row the median of fresh processes: native floors, the
engine's ``load_into`` (and mapped), a ``get_tensor`` loop on the engine and on the reference.
Needs bindfs and /dev/fuse.

    python scripts/bench_netfs.py --gib 2 --runs 7
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import harness
from benchmarks import common, host

ROWS = {"floor": "limit: native pread", "one stream": "limit: one stream of 8 MiB reads", "load_into": "engine",
        "load_into mapped": "engine, mapped", "get_tensor loop": "engine, get_tensor loop", "reference": "reference"}


def sample(path: str, row: str) -> float:
    """One cold load through the mount in this fresh process: its seconds."""
    import engine

    floor = host.Floor(path, "pread") if row == "floor" else None  # its destination allocated here, untimed
    dest = harness.destination(path)
    common.evict_cache(path)  # cold in the FUSE mount's page cache

    def stream():
        fd = os.open(path, os.O_RDONLY)
        buf = bytearray(8 << 20)
        while os.readv(fd, [buf]):
            pass
        os.close(fd)

    def loop():
        lib = engine if row == "get_tensor loop" else __import__("safetensors")
        with lib.safe_open(path, framework="pt") as f:
            for k in sorted(f.keys()):
                dest[k].copy_(f.get_tensor(k))

    def into():
        engine.load_into(path, dest)

    run = floor.run if floor else {"one stream": stream, "load_into": into, "load_into mapped": into}.get(row, loop)
    return harness.times(run, 1, warmup=0)[0]


def main(argv=None) -> int:
    ap = harness.parser(__doc__, runs=5)
    ap.add_argument("--gib", type=float, default=1.0, help="file size in GiB of F32 tensors of 32 MiB")
    a = ap.parse_args(argv)
    from servers import FuseMount

    if shutil.which("bindfs") is None or not os.path.exists("/dev/fuse"):
        harness.cannot("needs bindfs (apt-get install bindfs) and /dev/fuse")
    common.compile_engine()
    base = tempfile.mkdtemp(prefix="engine-netfs-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        src = harness.checkpoint(0, os.path.join(base, "src"), entries=[
            (f"layers.{i}.weight", "F32", (2048, 4096)) for i in range(max(1, round(a.gib * 32)))])
        size = os.path.getsize(src)
        env = {r: harness.child_env(ENGINE_COPY_SOURCE="mmap" if r == "load_into mapped" else None) for r in ROWS}
        try:
            with FuseMount(os.path.dirname(src), os.path.join(base, "mnt")) as mount:
                path = mount.path(os.path.basename(src))
                got = harness.rounds(ROWS, a.runs, lambda r: harness.call(sample, path, r, env=env[r]), warmup=True)
        except BaseException as exc:  # FuseMount says why it cannot mount with pytest's skip
            if type(exc).__name__ != "Skipped":
                raise
            harness.cannot(str(exc))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report = harness.Report()
    for row, secs in got.items():
        report.add("file on a FUSE mount (bindfs over tmpfs), cold -> CPU tensors", ROWS[row], secs, size)
    report.ratio("x_floor", report.seconds(impl=ROWS["floor"]))
    report.ratio("x_reference", report.seconds(impl="reference"))
    return report.finish(a.json, "impl", "median_s", "gbps", "x_floor", "x_reference")


if __name__ == "__main__":
    sys.exit(main())
