"""Streaming-reader benchmarks against the reference safetensors, in one run.

Prints a table of medians (and GB/s) for: owned CPU load (warm), load_into (warm and cold),
selective load, row and column slices, and on a machine with a GPU the CUDA load against the
reference's safe_open(device="cuda"), load_file + .to("cuda") and the pinned host-to-device
bandwidth.  Cold-cache runs evict the file with posix_fadvise(POSIX_FADV_DONTNEED).

    python scripts/bench_reader.py                 # 2 GB BF16 checkpoint, 5 runs
    python scripts/bench_reader.py --quick         # 128 MB, 3 runs (smoke)
    python scripts/bench_reader.py --json out.json
    python scripts/bench_reader.py --only fresh    # load_into warm and cold, cold load_file (both
                                                   # backends): one fresh process per sample
    python scripts/bench_reader.py --only stats    # statistics during a streaming load, and the
                                                   # same reads bare (no engine) with and without the fold;
                                                   # CPU seconds (user + system, getrusage) per GB of the
                                                   # load and of the fold
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# the asv suites' shared helpers (page-cache eviction and warming)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "asv_benchmarks"))
from benchmarks.common import compile_engine  # noqa: E402
from benchmarks.common import evict_cache as evict  # noqa: E402
from benchmarks.common import warm_cache as warm  # noqa: E402


def make_checkpoint(path: str, total_bytes: int, width: int = 4096, weights: bool = False) -> None:
    """A BF16 checkpoint of LLaMA-like attention layers.

    Values are random finite BF16 bit patterns (all positive, many zeros and subnormals), or
    with ``weights`` like trained weights: normal, mean 0, std 0.02.  Only the statistics
    depend on which.
    """
    import torch

    import engine.torch

    if os.path.exists(path) and os.path.getsize(path) > total_bytes * 0.9:
        return
    rng = np.random.default_rng(0)
    sd = {}
    per_layer = 4 * width * width * 2  # q, k, v, o in BF16
    layers = max(1, total_bytes // per_layer)
    for i in range(layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if weights:
                w = rng.standard_normal((width, width), dtype=np.float32)
                w *= 0.02
                sd[f"model.layers.{i}.self_attn.{proj}.weight"] = torch.from_numpy(w).to(torch.bfloat16)
                continue
            raw = rng.integers(0, 1 << 14, (width, width), dtype=np.int16)  # finite BF16 bit patterns
            sd[f"model.layers.{i}.self_attn.{proj}.weight"] = torch.from_numpy(raw).view(torch.bfloat16)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(width, dtype=torch.bfloat16)
    engine.torch.save_file(sd, path)


def paired_medians(fn_a, fn_b, runs: int) -> tuple[float, float, float, tuple, tuple]:
    """Medians of ``fn_a`` and ``fn_b`` run alternately, the median of the per-pair ratios
    b/a (drift on a shared machine then affects both sides of each ratio alike), and the
    median user and system CPU seconds (all threads of this process) of each side, as
    ``(user, sys)`` pairs: the statistics kernels are user time, an owned load's page
    faults and copies are system time."""
    ta, tb, ca, cb = [], [], [], []
    for _ in range(runs):
        for fn, out, cpu in ((fn_a, ta, ca), (fn_b, tb, cb)):
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu.append((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime))
    ratio = statistics.median(b / a for a, b in zip(ta, tb, strict=False))

    def med_cpu(c, other):
        # (user, sys, user + sys, median over the pairs of this side's user + sys minus the other's)
        return (statistics.median(u for u, _ in c), statistics.median(s for _, s in c),
                statistics.median(u + s for u, s in c),
                statistics.median((u + s) - (ou + os_) for (u, s), (ou, os_) in zip(c, other, strict=False)))

    return statistics.median(ta), statistics.median(tb), ratio, med_cpu(ca, cb), med_cpu(cb, ca)


def median_time(fn, runs: int, before=None) -> float:
    times = []
    for _ in range(runs):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json")
    ap.add_argument("--only", choices=["load", "stats", "slice", "fresh"], help="run one group of cases")
    ap.add_argument("--sample", nargs=3, metavar=("CASE", "IMPL", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sample:
        return _sample(*args.sample)
    compile_engine()  # no sample compiles the engine's modules (see compile_engine)
    size = (128 << 20) if args.quick else (2 << 30)
    runs = args.runs or (3 if args.quick else 5)

    import safetensors
    import safetensors.torch as ref
    import torch

    import engine
    import engine.torch

    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"bench-reader-{size >> 20}M.safetensors")
    make_checkpoint(path, size)
    nbytes = os.path.getsize(path)
    header = engine.read_header(path)
    rows = []

    def row(name, ours, theirs, note=""):
        rows.append(dict(case=name, engine_s=ours, reference_s=theirs,
                         ratio=(theirs / ours) if theirs else None, gbps=nbytes / ours / 1e9, note=note))

    def want(group: str) -> bool:
        return args.only in (None, group)

    warm(path)
    if args.only == "fresh":  # not part of the default run: it starts a process per sample
        _fresh_rows(path, runs, row)
    if want("load"):
        _load_rows(path, header, runs, row, ref, engine, torch)
    if want("stats"):
        _stats_rows(path, args.dir, size, runs, row, engine)
    if want("slice"):
        _slice_rows(path, header, runs, row, ref, engine, safetensors)
    if want("load") and torch.cuda.is_available():
        _cuda_rows(path, runs, row, ref, engine, torch, safetensors)
    info = dict(
        date=time.strftime("%Y-%m-%d"), python=platform.python_version(), torch=torch.__version__,
        safetensors=safetensors.__version__, cores=os.cpu_count(), machine=platform.machine(),
        cpu=_cpu_model(), gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        file_bytes=nbytes, runs=runs,
    )
    print(f"# {info}")
    print(f"{'case':<38} {'engine s':>9} {'ref s':>9} {'ref/eng':>8} {'GB/s':>7}  note")
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        ref_s = f"{r['reference_s']:.3f}" if r["reference_s"] else "-"
        print(f"{r['case']:<38} {r['engine_s']:>9.3f} {ref_s:>9} {ratio:>8} {r['gbps']:>7.2f}  {r['note']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=2)
    return 0


def _load_rows(path, header, runs, row, ref, engine, torch):
    def touch(d):  # read every byte of the loaded tensors, same work for both sides
        for t in d.values():
            t.view(-1).view(torch.uint8)[::4096].sum()

    row("owned CPU load, warm (pread)",
        median_time(lambda: engine.torch.load_file(path, backend="pread"), runs),
        median_time(lambda: ref.load_file(path, backend="pread"), runs),
        "reference load_file(backend='pread')")

    dst = {k: torch.empty(header[k].shape, dtype=torch.bfloat16) for k in header.keys()}
    for t in dst.values():
        t.zero_()  # fault the pages in once: load_into fills memory a model already owns

    def ref_into():
        loaded = ref.load_file(path)
        for k, t in loaded.items():
            dst[k].copy_(t)

    row("load_into, warm", median_time(lambda: engine.load_into(path, dst), runs),
        median_time(ref_into, runs), "reference load_file + copy_")
    row("load_into, cold", median_time(lambda: engine.load_into(path, dst), runs, before=lambda: evict(path)),
        median_time(lambda: touch(ref.load_file(path)), runs, before=lambda: evict(path)),
        "reference load_file, every page touched")
    warm(path)



#: (case, note): one fresh process per sample, see _sample
FRESH_CASES = (
    ("load_into, warm", "reference load_file + copy_ into the same pre-faulted tensors"),
    ("load_into, cold", "reference load_file + copy_; file evicted before each sample"),
    ("load_file default (mmap), cold", "reference load_file; both then touch every page; file evicted"),
    ("load_file pread, cold", "reference load_file(backend='pread'); file evicted before each sample"),
    ("bare reads, cold: buffered vs O_DIRECT",
     "no engine: 2 threads of 16 MiB preadv into one block, buffered (engine column, the engine's choice) "
     "against the same reads with O_DIRECT (ref column)"),
)


def _fresh_rows(path, runs, row) -> None:
    """Each case ``runs`` times per side, engine and reference alternated, every sample a
    fresh process (imports, allocation and eviction outside the timed part)."""
    import subprocess

    for case, note in FRESH_CASES:
        times: dict = {"engine": [], "reference": []}
        for _ in range(runs):
            for impl in ("engine", "reference"):
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--sample", case, impl, path],
                                     check=True, capture_output=True, text=True).stdout
                times[impl].append(json.loads(out.strip().splitlines()[-1])["seconds"])
        ours, theirs = times["engine"], times["reference"]
        ratio = statistics.median(r / e for e, r in zip(ours, theirs, strict=False))
        row(case + " [fresh]", statistics.median(ours), statistics.median(theirs),
            f"{note}; ref/eng median of {runs} paired ratios {ratio:.2f}x; engine "
            f"{min(ours):.3f}-{max(ours):.3f} s, reference {min(theirs):.3f}-{max(theirs):.3f} s")


def _sample(case: str, impl: str, path: str) -> int:
    """One timed sample in this (fresh) process; prints ``{"seconds": ...}``."""
    import safetensors.torch as ref
    import torch

    import engine
    import engine.torch

    header = engine.read_header(path)
    dst = None
    if case.startswith("load_into"):
        dst = {k: torch.empty(header[k].shape, dtype=torch.bfloat16) for k in header.keys()}
        for t in dst.values():
            t.zero_()  # fault the pages in once: load_into fills memory a model already owns

    def touch(d):  # read a byte of every page of every tensor: same work for both sides
        for t in d.values():
            t.view(-1).view(torch.uint8)[::4096].sum()

    def ref_into():
        for k, t in ref.load_file(path).items():
            dst[k].copy_(t)

    fn = None if case.startswith("bare reads") else {
        ("load_into, warm", "engine"): lambda: engine.load_into(path, dst),
        ("load_into, warm", "reference"): ref_into,
        ("load_into, cold", "engine"): lambda: engine.load_into(path, dst),
        ("load_into, cold", "reference"): ref_into,
        ("load_file default (mmap), cold", "engine"): lambda: touch(engine.torch.load_file(path)),
        ("load_file default (mmap), cold", "reference"): lambda: touch(ref.load_file(path)),
        ("load_file pread, cold", "engine"): lambda: engine.torch.load_file(path, backend="pread"),
        ("load_file pread, cold", "reference"): lambda: ref.load_file(path, backend="pread"),
    }[(case, impl)]
    if case.startswith("bare reads"):
        fn = lambda: _bare_cold(path, direct=impl == "reference")  # noqa: E731
    if "cold" in case:
        evict(path)
    else:
        warm(path)
    t0 = time.perf_counter()
    fn()
    print(json.dumps(dict(seconds=time.perf_counter() - t0)))
    return 0


def _bare_cold(path: str, *, direct: bool, threads: int = 2, request: int = 16 << 20) -> None:
    """The whole file read by ``threads`` threads in ``request``-byte ``preadv`` calls into one
    anonymous block, through the page cache or around it (``O_DIRECT``: aligned offsets,
    sizes and memory; the block is page-aligned and the last request rounded up)."""
    from engine.io.reader import run_threads
    from engine.sinks import host_block

    size = os.path.getsize(path)
    padded = -(-size // 4096) * 4096
    block = host_block(padded)
    view = memoryview(block)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))

    def worker(i: int) -> None:
        for lo in range(i * request, padded, threads * request):
            hi = min(lo + request, padded)
            while lo < hi:
                n = os.preadv(fd, [view[lo:hi]], lo)
                if n <= 0:
                    if lo >= size:
                        break
                    raise OSError(f"{path}: short read at {lo}")
                lo += n
                if lo >= size:
                    break

    try:
        run_threads([lambda i=i: worker(i) for i in range(threads)], name="bench-cold")
    finally:
        os.close(fd)
        view.release()
        block.close()


def _stats_rows(path, directory, size, runs, row, engine):
    # statistics computed during the streaming load (issue target: at most +15% load time),
    # on the bit-pattern checkpoint and on one whose values look like trained weights
    weights_path = os.path.join(directory, f"bench-reader-weights-{size >> 20}M.safetensors")
    make_checkpoint(weights_path, size, weights=True)
    for label, p in (("random bit patterns", path), ("weight-like values", weights_path)):
        warm(p)
        gb = os.path.getsize(p) / 1e9

        def plain(p=p):
            for _ in engine.stream(p, framework="pt", device="cpu"):
                pass

        def with_stats(p=p):
            for _ in engine.stream(p, framework="pt", device="cpu", stats=True):
                pass

        with_stats()  # compile (or load) the kernels outside the measurement
        t_plain, t_stats, ratio, cpu_plain, cpu_stats = paired_medians(plain, with_stats, 3 * runs)
        row(f"stream(stats=True), {label}", t_stats, t_plain,
            f"vs stream(); statistics add {100 * (ratio - 1):+.0f}% to the load (median of {3 * runs} pairs); "
            + _cpu_note(cpu_plain, cpu_stats, gb))
        if label.startswith("weight"):
            for mode, what in (("fold", "the fold alone adds"), ("windows", "reading in windows alone adds")):
                t_plain, t_mode, ratio, cpu_plain, cpu_mode = paired_medians(
                    lambda p=p: _bare_load(p, engine, "requests"), lambda m=mode, p=p: _bare_load(p, engine, m), 3 * runs)
                name = "bare reads + fold" if mode == "fold" else "bare window reads"
                row(f"{name}, {label}", t_mode, t_plain,
                    f"vs bare reads; {what} {100 * (ratio - 1):+.0f}% (median of {3 * runs} pairs); "
                    + _cpu_note(cpu_plain, cpu_mode, gb, "fold" if mode == "fold" else "window reads"))
    warm(path)


def _cpu_note(plain: tuple, with_stats: tuple, gb: float, added: str = "fold") -> str:
    """CPU seconds (user + system of every thread, from getrusage) per GB of the file: the
    load's own and what the fold adds (median of the per-pair differences), then the split."""
    return (f"CPU s/GB: load {plain[2] / gb:.3f}, {added} {with_stats[3] / gb:+.3f} "
            f"({100 * with_stats[3] / plain[2]:+.0f}% of the load's CPU); "
            f"user s {plain[0]:.2f} -> {with_stats[0]:.2f}, sys s {plain[1]:.2f} -> {with_stats[1]:.2f}")


def _bare_load(path, engine, mode: str, threads: int = 2, request: int = 16 << 20) -> None:
    """The least work a 2-thread owned load of ``path`` can do, with or without statistics.

    One anonymous block for all data (as engine loads use), ``threads`` threads taking
    ``request``-byte reads in turn.  ``mode``: ``"requests"``, one ``preadv`` per request;
    ``"fold"``, the same reads made and folded window by window by
    :meth:`engine.statistics.Accumulator.read` (one accumulator per thread for the whole
    file: no tensors, plans, queues or merges); ``"windows"``, the window-sized reads of
    ``"fold"`` without the fold (from Python: a little user time per call).  ``"fold"``
    against ``"requests"`` is the floor the statistics kernel sets on the overhead of
    ``stream(stats=True)`` on this machine; ``"windows"`` tells how much of it is the
    smaller reads rather than the fold.
    """
    from engine import statistics as est
    from engine.io.reader import pread_into, run_threads
    from engine.loading.cpu_stats import StatsCollector
    from engine.sinks import host_block

    start = engine.read_header(path).data_start
    size = os.path.getsize(path) - start
    block = host_block(size)  # the anonymous block an owned load fills
    dest = np.frombuffer(block, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    window = StatsCollector.WINDOW

    def worker(i: int) -> None:
        acc = est.Accumulator("BF16")
        for lo in range(i * request, size, threads * request):
            hi = min(lo + request, size)
            if mode == "fold":
                if acc.read(fd, start + lo, dest[lo:hi], window) != hi - lo:
                    raise OSError(f"{path}: short read at {start + lo}")
            elif mode == "windows":
                for w in range(lo, hi, window):
                    pread_into(fd, start + w, [memoryview(dest[w : min(w + window, hi)])], path=path)
            else:
                pread_into(fd, start + lo, [memoryview(dest[lo:hi])], path=path)

    try:
        run_threads([lambda i=i: worker(i) for i in range(threads)], name="bench-bare")
    finally:
        os.close(fd)
        dest = None  # the array's export of the block must go before the block closes  # noqa: F841
        block.close()


def _slice_rows(path, header, runs, row, ref, engine, safetensors):
    eighth = header.keys()[: max(1, len(header) // 8)]
    sel_bytes = sum(header[k].nbytes for k in eighth)
    row("selective load 1/8 (names)",
        median_time(lambda: dict(engine.stream(path, framework="pt", device="cpu", names=eighth)), runs),
        median_time(lambda: _ref_names(ref, path, eighth), runs),
        f"{sel_bytes / 1e6:.0f} MB selected; reference safe_open + get_tensor")

    big = next(k for k in header.offset_keys() if len(header[k].shape) == 2)
    n0 = header[big].shape[0]

    def slice_ours(backend, index):
        with engine.safe_open(path, framework="pt", backend=backend) as f:
            return f.get_slice(big)[index]

    def slice_ref(index):
        with safetensors.safe_open(path, framework="pt") as f:
            return f.get_slice(big)[index]

    for label, index in (("rows [:n/4]", (slice(0, n0 // 4),)), ("columns [:, :n/4]", (slice(None), slice(0, n0 // 4)))):
        for backend in ("mmap", "pread"):
            row(f"get_slice {label}, {backend}",
                median_time(lambda b=backend, i=index: slice_ours(b, i).sum(), runs),
                median_time(lambda i=index: slice_ref(i).sum(), runs), "then .sum()")


def _ref_names(ref, path, names):
    import safetensors

    with safetensors.safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k).clone() for k in names}


def _cuda_rows(path, runs, row, ref, engine, torch, safetensors):
    sync = torch.cuda.synchronize
    n = os.path.getsize(path)
    pinned = torch.empty(min(n, 1 << 30), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(pinned, device="cuda")

    def h2d():
        dev.copy_(pinned, non_blocking=True)
        sync()

    h2d()
    t = median_time(h2d, runs)
    h2d_gbps = pinned.numel() / t / 1e9

    def ours():
        engine.torch.load_file(path, device="cuda:0")
        sync()

    def ref_cuda():
        ref.load_file(path, device="cuda:0")
        sync()

    def ref_to():
        {k: v.to("cuda") for k, v in ref.load_file(path).items()}
        sync()

    ours()
    t_ours = median_time(ours, runs)
    row("CUDA load, warm", t_ours, median_time(ref_cuda, runs), "reference load_file(device='cuda')")
    row("CUDA load vs load_file + .to", t_ours, median_time(ref_to, runs), "reference load_file then .to('cuda')")
    row("pinned H2D bandwidth", n / (h2d_gbps * 1e9), None,
        f"{h2d_gbps:.1f} GB/s measured; engine reaches {n / t_ours / 1e9 / h2d_gbps:.0%} of it")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
