"""How fast a fresh process faults fresh memory in: 4 KiB pages against transparent huge pages.

Each sample is a new process that maps ``--size`` of anonymous memory (with
``MADV_HUGEPAGE`` or without) and faults it in with ``MADV_POPULATE_WRITE``, 16 MiB at a
time, on ``--threads`` threads; rows alternate.  It is what an owned load's destination
costs before any byte lands, and it is what decides ``ENGINE_HUGE_PAGES``' default
(``engine.sinks._host.huge_pages``): on a VM whose balloon reports free 2 MiB blocks to
the hypervisor, a fresh huge page is one the host faults in too.

    python scripts/fresh_faults.py                 # 1 GiB, 1 and 2 threads, 4 samples per row
    python scripts/fresh_faults.py --size 2GiB --runs 6
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_CHILD = r"""
import ctypes, mmap, sys, threading, time
size, huge, threads = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
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
t0 = time.perf_counter()
pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
for t in pool: t.start()
for t in pool: t.join()
seconds = time.perf_counter() - t0
huge_kib = next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages"))
print(size / seconds / 1e9, huge_kib)
"""


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args(argv)
    size = _size(args.size)
    rows = [(huge, int(t)) for t in args.threads.split(",") for huge in (0, 1)]
    results: dict[tuple[int, int], list[tuple[float, int]]] = {r: [] for r in rows}
    for _ in range(args.runs):
        for huge, threads in rows:
            out = subprocess.run([sys.executable, "-c", _CHILD, str(size), str(huge), str(threads)],
                                 capture_output=True, text=True, check=True)
            rate, huge_kib = out.stdout.split()
            results[(huge, threads)].append((float(rate), int(huge_kib)))
    print(f"{size / (1 << 30):.2f} GiB faulted in by MADV_POPULATE_WRITE, a fresh process per sample, "
          f"{args.runs} samples per row")
    print(f"{'pages':>10} {'threads':>7} {'median GB/s':>11}  samples                     huge MiB granted")
    for (huge, threads), got in results.items():
        rates = [r for r, _ in got]
        print(f"{'huge' if huge else '4 KiB':>10} {threads:>7} {statistics.median(rates):11.2f}  "
              f"{' '.join(f'{r:.2f}' for r in rates):27} {statistics.median(k for _, k in got) / 1024:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
