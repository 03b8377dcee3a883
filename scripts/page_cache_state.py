#!/usr/bin/env python
"""How the page cache holds a file, and what mapping it costs: the figure the engine's
``auto`` copy source decides by (see ``_Choice`` in ``engine/io/_io.pyx``).

Maps the file read-only and populates it 2 MiB at a time (``MADV_POPULATE_READ``), timing
each step, then reads how much of the mapping the kernel mapped with one entry per 2 MiB
(``FilePmdMapped`` in ``/proc/self/smaps``), and times the unmapping (``MADV_DONTNEED``).
A 2 MiB folio maps whole in a microsecond or two; 4 KiB pages and smaller folios take an
entry per page.  Prints the steps by cost, the share mapped with one entry, and the total
time to map and to unmap the file: what every load from a fresh mapping pays, and what a
load through ``pread`` does not.  Run it on a warm file (it reads an evicted one from disk
and then measures the disk).

    python scripts/page_cache_state.py model.safetensors
    python scripts/page_cache_state.py --runs 3 /tmp/engine-bench-cache/v1-ckpt-2147483648.safetensors

``--after-cold LOAD`` first evicts the file and reads it in with one load in a fresh process
(timed), then measures the state that load left: ``load_into`` (``engine.load_into`` into
torch tensors), ``mapped`` (``engine.torch.load_file``, mapped, every page touched),
``reference`` (``safetensors.torch.load_file``, every page touched).  The engine is the one
Python imports (``PYTHONPATH`` chooses a tree).

Linux 5.14+ only (``MADV_POPULATE_READ``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
import sys
import time

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


COLD_LOADS = {
    "load_into": "import engine, torch\n"
                 "h = engine.read_header(P)\n"
                 "dst = {k: torch.empty(h[k].shape, dtype=torch.bfloat16) for k in h.keys()}\n"
                 "[t.fill_(1) for t in dst.values()]\n"
                 "t0 = time.perf_counter(); engine.load_into(P, dst)\n",
    "mapped": "import engine.torch, torch\n"
              "t0 = time.perf_counter(); d = engine.torch.load_file(P)\n"
              "[t.view(-1).view(torch.uint8)[::4096].sum() for t in d.values()]\n",
    "reference": "import safetensors.torch, torch\n"
                 "t0 = time.perf_counter(); d = safetensors.torch.load_file(P)\n"
                 "[t.view(-1).view(torch.uint8)[::4096].sum() for t in d.values()]\n",
}


def cold_load(path: str, load: str) -> float:
    """Evict ``path``, then run ``load`` (see :data:`COLD_LOADS`) in a fresh process; its seconds."""
    import subprocess

    sys.path[:0] = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "asv_benchmarks")]
    from benchmarks import common

    common.evict_cache(path)
    code = f"import time\nP = {path!r}\n" + COLD_LOADS[load] + "print(time.perf_counter() - t0)\n"
    # run from the root: the engine imported is the one PYTHONPATH or the installed package gives
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    return float(done.stdout.strip().splitlines()[-1])


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--runs", type=int, default=1, help="map, populate and unmap the file this many times")
    ap.add_argument("--after-cold", choices=sorted(COLD_LOADS), help="evict the file and read it in with this load first")
    a = ap.parse_args()
    if not sys.platform.startswith("linux"):
        print("Linux only (MADV_POPULATE_READ)", file=sys.stderr)
        return 2
    if a.after_cold:
        print(f"cold {a.after_cold}: {cold_load(a.path, a.after_cold):.2f} s")
    for run in range(a.runs):
        r = one_run(a.path)
        steps, mapped = r["steps"], len(r["steps"]) * STEP
        print(f"run {run + 1}: {len(steps)} steps of 2 MiB ({mapped / 2**30:.2f} GiB of {r['size'] / 2**30:.2f})")
        low = 0.0
        for high, label in BUCKETS:
            sel = [s for s in steps if low <= s < high]
            print(f"  {label:>16}: {len(sel):6d} steps, {1e3 * sum(sel):8.2f} ms")
            low = high
        slow, runs, longest, length = [s >= 5e-6 for s in steps], 0, 0, 0
        for dear in slow + [False]:  # runs of steps mapped page by page
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
