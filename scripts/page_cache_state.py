#!/usr/bin/env python
"""How the page cache holds a file, and what mapping it costs (``auto`` copy source's figure).

Maps the warm file, populates it 2 MiB at a time (``MADV_POPULATE_READ``, Linux 5.14+), and prints the
steps by cost, the share mapped with one entry per 2 MiB (``FilePmdMapped``) and the time to map and
to unmap.  ``--after-cold LOAD``: the file first evicted and read in by one load in a fresh process.

    python scripts/page_cache_state.py --runs 3 model.safetensors
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
import sys
import time

import harness

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # the number is Linux's ABI
STEP = 2 << 20
BUCKETS = ((5e-6, "under 5 us"), (20e-6, "5-20 us"), (200e-6, "20-200 us"), (float("inf"), "200 us and more"))


def pmd_mapped_kib(path: str) -> int | None:
    """``FilePmdMapped`` of this process's mapping of ``path`` (KiB), or None."""
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return None
    real = os.path.realpath(path)
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        if block.split("\n", 1)[0].endswith(real):
            found = re.search(r"^FilePmdMapped:\s+(\d+) kB", block, re.M)
            return int(found.group(1)) if found else None
    return None


def cold_load(path: str, load: str) -> float:
    """``path`` evicted, then read in by one ``load`` (in a fresh process): its seconds."""
    import safetensors.torch
    import torch
    from benchmarks import common

    import engine.torch

    common.evict_cache(path)
    if load == "load_into":
        dst = harness.destination(path)
        return harness.times(lambda: engine.load_into(path, dst), 1, warmup=0)[0]

    def touched():
        for t in (engine.torch if load == "mapped" else safetensors.torch).load_file(path).values():
            t.view(-1).view(torch.uint8)[::4096].sum()

    return harness.times(touched, 1, warmup=0)[0]


def one_run(path: str) -> dict:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    try:
        steps = []
        for off in range(0, size - size % STEP, STEP):
            t0 = time.perf_counter()
            m.madvise(MADV_POPULATE_READ, off, STEP)
            steps.append(time.perf_counter() - t0)
        pmd = pmd_mapped_kib(path)
        t0 = time.perf_counter()
        m.madvise(mmap.MADV_DONTNEED, 0, size - size % STEP)
        unmap = time.perf_counter() - t0
    finally:
        m.close()
    return {"steps": steps, "pmd_kib": pmd, "unmap": unmap, "size": size}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--runs", type=int, default=1, help="map, populate and unmap the file this many times")
    ap.add_argument("--after-cold", choices=["load_into", "mapped", "reference"])
    a = ap.parse_args()
    if not sys.platform.startswith("linux"):
        harness.cannot("Linux only (MADV_POPULATE_READ)")
    if a.after_cold:
        print(f"cold {a.after_cold}: {harness.call(cold_load, os.path.abspath(a.path), a.after_cold):.2f} s")
    for run in range(a.runs):
        r = one_run(a.path)
        steps, mapped = r["steps"], len(r["steps"]) * STEP
        print(f"run {run + 1}: {len(steps)} steps of 2 MiB ({mapped / 2**30:.2f} GiB of {r['size'] / 2**30:.2f})")
        low = 0.0
        for high, label in BUCKETS:
            sel = [s for s in steps if low <= s < high]
            print(f"  {label:>16}: {len(sel):6d} steps, {1e3 * sum(sel):8.2f} ms")
            low = high
        runs, longest, length = 0, 0, 0
        for dear in [s >= 5e-6 for s in steps] + [False]:  # runs of steps mapped page by page
            if dear:
                length += 1
            elif length:
                runs, longest, length = runs + 1, max(longest, length), 0
        print(f"  steps of 5 us and more come in {runs} runs, the longest {2 * longest} MiB")
        pmd = "unknown" if r["pmd_kib"] is None else f"{r['pmd_kib'] / 2**20:.2f} GiB ({r['pmd_kib'] * 1024 / mapped:.0%})"
        print(f"  mapped with one entry per 2 MiB (FilePmdMapped): {pmd}")
        print(f"  to map: {1e3 * sum(steps):.1f} ms; to unmap: {1e3 * r['unmap']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
