"""How fast a fresh process faults fresh memory in: 4 KiB pages against transparent huge pages.

Each sample is a new process that maps ``--size`` of anonymous memory (with ``MADV_HUGEPAGE`` or
without) and faults it in with ``MADV_POPULATE_WRITE``, 16 MiB at a time, on ``--threads`` threads;
rows alternate.  It is what an owned load's destination costs before any byte lands, and what decides
``ENGINE_HUGE_PAGES``' default (``engine.sinks._host.huge_pages``).

    python scripts/fresh_faults.py --size 2GiB --runs 6
"""

from __future__ import annotations

import sys

import harness


def sample(size: int, huge: bool, threads: int) -> dict:
    """One fresh process's faults: seconds, and the huge pages it was granted (KiB)."""
    import ctypes
    import mmap
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        block.madvise(mmap.MADV_HUGEPAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(block))
    step = 16 << 20

    def work(i):
        for off in range(i * step, size, threads * step):
            if libc.madvise(base + off, min(step, size - off), 23) != 0:  # MADV_POPULATE_WRITE
                raise OSError(ctypes.get_errno(), "madvise")

    def run() -> None:
        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()

    seconds = harness.times(run, 1, warmup=0)[0]
    with open("/proc/self/smaps_rollup") as f:
        huge_kib = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))
    return {"seconds": seconds, "huge_kib": huge_kib}


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, size="1GiB", runs=4)
    ap.add_argument("--threads", default="1,2")
    a = ap.parse_args(argv)
    size = a.size
    rows = [(huge, int(t)) for t in a.threads.split(",") for huge in (False, True)]
    got = harness.rounds(rows, a.runs, lambda r: harness.call(sample, size, *r))
    report = harness.Report()
    for (huge, threads), samples in got.items():
        report.add(f"fault in fresh memory, {threads} thread(s)", f"limit: {'huge' if huge else '4 KiB'} pages",
                   [s["seconds"] for s in samples], size, threads=threads,
                   huge_granted_bytes=harness.median(s["huge_kib"] for s in samples) * 1024)
    return report.finish(a.json, "case", "impl", "median_s", "gbps", "huge_granted_bytes")


if __name__ == "__main__":
    sys.exit(main())
