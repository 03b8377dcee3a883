"""How fast a fresh process faults fresh memory in (``MADV_POPULATE_WRITE``, 16 MiB at a time on
``--threads`` threads): 4 KiB pages against transparent huge pages, rows alternating, a new process
per sample.  What an owned load's destination costs before any byte lands, and what decides
``ENGINE_HUGE_PAGES``' default.

    python scripts/fresh_faults.py --size 2GiB --runs 6
"""

from __future__ import annotations

import sys

import harness


def sample(size: int, huge: bool, threads: int) -> dict:
    """One fresh process's faults: seconds, and the huge pages it was granted (KiB)."""
    import mmap

    from engine.io.reader import populate_write, run_threads

    block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        block.madvise(mmap.MADV_HUGEPAGE)
    view, step = memoryview(block), 16 << 20

    def work(i):
        for off in range(i * step, size, threads * step):
            if populate_write(view[off : off + step]):
                raise OSError("MADV_POPULATE_WRITE failed")

    seconds = harness.times(lambda: run_threads([lambda i=i: work(i) for i in range(threads)]), 1, warmup=0)[0]
    with open("/proc/self/smaps_rollup") as f:
        huge_kib = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))
    return {"seconds": seconds, "huge_kib": huge_kib}


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, size="1GiB", runs=4)
    ap.add_argument("--threads", default="1,2")
    a = ap.parse_args(argv)
    rows = [(huge, int(t)) for t in a.threads.split(",") for huge in (False, True)]
    got = harness.rounds(rows, a.runs, lambda r: harness.call(sample, a.size, *r))
    report = harness.Report()
    for (huge, threads), samples in got.items():
        report.add(f"fault in fresh memory, {threads} thread(s)", f"limit: {'huge' if huge else '4 KiB'} pages",
                   [s["seconds"] for s in samples], a.size, threads=threads,
                   huge_granted_bytes=harness.median(s["huge_kib"] for s in samples) * 1024)
    return report.finish(a.json, "case", "impl", "median_s", "gbps", "huge_granted_bytes")


if __name__ == "__main__":
    sys.exit(main())
