"""Streaming-reader benchmarks against the reference safetensors, in one run.

The owned CPU load, load_into (warm and cold: the file evicted), the selective load, row and column
slices and, with a GPU, the CUDA load against the pinned host-to-device bandwidth.  ``--only fresh``:
load_into and cold loads, a fresh process per sample; ``--only stats``: statistics during a streaming
load, and bare reads with and without the fold, with their CPU seconds per GB.

    python scripts/bench_reader.py --quick         # 128 MB, 3 runs (default 2 GB, 5 runs)
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile

import harness
import numpy as np
from benchmarks.common import compile_engine
from benchmarks.common import evict_cache as evict
from benchmarks.common import warm_cache as warm

#: (case, what the reference row does): one fresh process per sample, see fresh_sample
FRESH_CASES = {
    "load_into, warm": "load_file + copy_ into the same pre-faulted tensors",
    "load_into, cold": "load_file + copy_; file evicted before each sample",
    "load_file default (mmap), cold": "load_file; both then touch every page; file evicted",
    "load_file pread, cold": "load_file(backend='pread'); file evicted before each sample",
    "bare reads, cold: buffered vs O_DIRECT": "no engine: 2 threads of 16 MiB preadv into one block, buffered "
                                              "(engine row, the engine's choice) against O_DIRECT (reference row)",
}


def _touch(d) -> None:  # read a byte of every page of every tensor: the same work for both sides
    import torch

    for t in d.values():
        t.view(-1).view(torch.uint8)[::4096].sum()


def paired_medians(fn_a, fn_b, runs: int):
    """Medians of ``fn_a`` and ``fn_b`` run alternately, the median of the per-pair ratios b/a, and
    each side's median CPU seconds ``(user, sys, user + sys, user + sys minus the other side's)``:
    the statistics kernels are user time, an owned load's page faults and copies system time."""
    t: tuple = ([], [])
    cpu: tuple = ([], [])
    for _ in range(runs):
        for i, fn in enumerate((fn_a, fn_b)):
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t[i].append(harness.times(fn, 1, warmup=0)[0])
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu[i].append((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime))
    med = harness.median

    def med_cpu(c, other):
        return (med(u for u, _ in c), med(s for _, s in c), med(u + s for u, s in c),
                med((u + s) - (ou + os_) for (u, s), (ou, os_) in zip(c, other, strict=True)))

    ratio = med(b / a for a, b in zip(*t, strict=True))
    return med(t[0]), med(t[1]), ratio, med_cpu(*cpu), med_cpu(cpu[1], cpu[0])


def _loads(path: str, dst: dict) -> dict:
    """What the load rows run: ``{case: (the engine's, the reference's)}``."""
    import safetensors.torch as ref

    import engine
    import engine.torch

    def ref_into():
        for k, t in ref.load_file(path).items():
            dst[k].copy_(t)

    def into():
        engine.load_into(path, dst)

    return {"load_into, warm": (into, ref_into), "load_into, cold": (into, ref_into),
            "load_file default (mmap), cold": (lambda: _touch(engine.torch.load_file(path)),
                                               lambda: _touch(ref.load_file(path))),
            "load_file pread, cold": (lambda: engine.torch.load_file(path, backend="pread"),
                                      lambda: ref.load_file(path, backend="pread")),
            "bare reads, cold: buffered vs O_DIRECT": (lambda: _bare(path, "buffered"),
                                                       lambda: _bare(path, "direct"))}


def fresh_sample(case: str, impl: str, path: str) -> float:
    """One timed sample in this fresh process: its seconds."""
    fn = _loads(path, harness.destination(path))[case][impl == "reference"]
    (evict if "cold" in case else warm)(path)
    return harness.times(fn, 1, warmup=0)[0]


def _bare(path, mode: str, threads: int = 2, request: int = 16 << 20) -> None:
    """The least work a 2-thread owned load of ``path`` can do: ``threads`` threads taking
    ``request``-byte reads in turn into one anonymous block.  ``mode``: ``"requests"``, one ``preadv``
    per request of the tensor bytes; ``"fold"``, the same reads made and folded window by window by
    :meth:`engine.statistics.Accumulator.read` (the floor of ``stream(stats=True)``); ``"windows"``,
    the window-sized reads of ``"fold"`` without the fold; ``"buffered"`` / ``"direct"``, the whole
    file through the page cache or around it (``O_DIRECT``: the last request rounded up)."""
    import engine
    from engine.io.reader import pread_into, run_threads
    from engine.sinks import host_block

    whole = mode in ("buffered", "direct")
    if not whole:  # not imported in a cold sample's clock
        from engine import statistics as est
        from engine.loading.cpu_stats import StatsCollector

        window = StatsCollector.WINDOW
    start = 0 if whole else engine.read_header(path).data_start
    size = os.path.getsize(path) - start
    end = -(-size // 4096) * 4096 if whole else size
    block = host_block(end)
    dest = np.frombuffer(block, np.uint8)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if mode == "direct" else 0))

    def worker(i: int) -> None:
        acc = est.Accumulator("BF16") if mode == "fold" else None
        for lo in range(i * request, end, threads * request):
            hi = min(lo + request, end)
            if acc is not None:
                if acc.read(fd, start + lo, dest[lo:hi], window) != hi - lo:
                    raise OSError(f"{path}: short read at {start + lo}")
            elif mode == "windows":
                for w in range(lo, hi, window):
                    pread_into(fd, start + w, [memoryview(dest[w : min(w + window, hi)])], path=path)
            elif whole:  # the last request may pass the file's end
                while lo < min(hi, size):
                    n = os.preadv(fd, [memoryview(dest[lo:hi])], lo)
                    if n <= 0:
                        raise OSError(f"{path}: short read at {lo}")
                    lo += n
            else:
                pread_into(fd, start + lo, [memoryview(dest[lo:hi])], path=path)

    try:
        run_threads([lambda i=i: worker(i) for i in range(threads)], name="bench-bare")
    finally:
        os.close(fd)
        dest = None  # the array's export of the block must go before the block closes  # noqa: F841
        block.close()


def _cpu_note(plain: tuple, added: tuple, gb: float, what: str = "fold") -> str:
    return (f"CPU s/GB: load {plain[2] / gb:.3f}, {what} {added[3] / gb:+.3f} ({100 * added[3] / plain[2]:+.0f}% of "
            f"the load's CPU); user s {plain[0]:.2f} -> {added[0]:.2f}, sys s {plain[1]:.2f} -> {added[1]:.2f}")


def main(argv=None) -> int:
    ap = harness.parser(__doc__, runs=None, dir=tempfile.gettempdir())
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["load", "stats", "slice", "fresh"], help="run one group of cases")
    a = ap.parse_args(argv)
    compile_engine()
    size = (128 << 20) if a.quick else (2 << 30)
    runs = a.runs or (3 if a.quick else 5)
    import safetensors
    import safetensors.torch as ref
    import torch

    import engine
    import engine.torch

    # layers of four 4096 x 4096 BF16 projections and a norm
    layout = [(f"model.layers.{i}.self_attn.{p}.weight", "BF16", (4096, 4096)) for i in range(max(1, size >> 27))
              for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    layout += [(f"model.layers.{i}.input_layernorm.weight", "BF16", (4096,)) for i in range(max(1, size >> 27))]
    path = harness.checkpoint(size, a.dir, values="finite", entries=layout)
    nbytes = os.path.getsize(path)
    header = engine.read_header(path)
    report = harness.Report()

    def med(fn, before=None) -> float:
        return harness.median(harness.times(fn, runs, warmup=0, before=before))

    def pair(case, ours, theirs, note="", other="reference", impl="engine"):
        report.add(case, impl, ours, nbytes, note=note, x_other=theirs / ours if theirs else None)
        if theirs:
            report.add(case, other, theirs, nbytes)

    warm(path)
    if a.only == "fresh":  # not part of the default run: a process per sample
        for case, note in FRESH_CASES.items():
            got = harness.rounds(["engine", "reference"], runs,
                                 lambda impl, c=case: harness.call(fresh_sample, c, impl, path))
            ratio = harness.median(r / e for e, r in zip(got["engine"], got["reference"], strict=True))
            report.add(case + " [fresh]", "engine", got["engine"], nbytes, note=note, x_other=ratio)
            report.add(case + " [fresh]", "reference", got["reference"], nbytes)
    if a.only in (None, "load"):
        loads = _loads(path, harness.destination(path))
        for case, (ours, theirs), before, note in (
                ("owned CPU load, warm (pread)", loads["load_file pread, cold"], None, "load_file(backend='pread')"),
                ("load_into, warm", loads["load_into, warm"], None, "reference load_file + copy_"),
                ("load_into, cold", (loads["load_into, cold"][0], loads["load_file default (mmap), cold"][1]),
                 lambda: evict(path), "reference load_file, every page touched")):
            pair(case, med(ours, before), med(theirs, before), note)
        warm(path)
    if a.only in (None, "stats"):
        weights = harness.checkpoint(size, a.dir, values="weights", entries=layout)
        for label, p in (("random bit patterns", path), ("weight-like values", weights)):
            warm(p)
            gb = os.path.getsize(p) / 1e9

            def stream(p=p, **kw):
                for _ in engine.stream(p, framework="pt", device="cpu", **kw):
                    pass

            stream(stats=True)  # compile (or load) the kernels outside the measurement
            t_plain, t_stats, ratio, cpu_plain, cpu_stats = paired_medians(stream, lambda: stream(stats=True), 3 * runs)
            pair(f"stream(stats=True), {label}", t_stats, t_plain, f"statistics add {100 * (ratio - 1):+.0f}%; "
                 + _cpu_note(cpu_plain, cpu_stats, gb), other="engine, stream() without statistics")
            if label.startswith("weight"):
                for mode, name in (("fold", "bare reads + fold"), ("windows", "bare window reads")):
                    t_plain, t_mode, ratio, cpu_plain, cpu_mode = paired_medians(
                        lambda p=p: _bare(p, "requests"), lambda m=mode, p=p: _bare(p, m), 3 * runs)
                    pair(f"{name}, {label}", t_mode, t_plain, f"adds {100 * (ratio - 1):+.0f}%; "
                         + _cpu_note(cpu_plain, cpu_mode, gb, mode), other="limit: bare reads")
        warm(path)
    if a.only in (None, "slice"):
        eighth = header.keys()[: max(1, len(header) // 8)]

        def ref_names():
            with safetensors.safe_open(path, framework="pt") as f:
                return {k: f.get_tensor(k).clone() for k in eighth}

        def names():
            return dict(engine.stream(path, framework="pt", device="cpu", names=eighth))

        pair("selective load 1/8 (names)", med(names), med(ref_names), "reference safe_open + get_tensor")
        big = next(k for k in header.offset_keys() if len(header[k].shape) == 2)
        n0 = header[big].shape[0]

        def sliced(lib, index, **kw):
            with lib.safe_open(path, framework="pt", **kw) as f:
                return f.get_slice(big)[index].sum()

        for label, index in (("rows [:n/4]", (slice(0, n0 // 4),)), ("columns [:, :n/4]", (slice(None), slice(0, n0 // 4)))):
            for backend in ("mmap", "pread"):
                pair(f"get_slice {label}, {backend}", med(lambda b=backend, i=index: sliced(engine, i, backend=b)),
                     med(lambda i=index: sliced(safetensors, i)), "then .sum()")
    if a.only in (None, "load") and torch.cuda.is_available():
        _cuda_rows(path, med, pair, ref, engine, torch)
    return report.finish(a.json, "case", "impl", "median_s", "gbps", "x_other", "note")


def _cuda_rows(path, med, pair, ref, engine, torch) -> None:
    sync = torch.cuda.synchronize
    n = os.path.getsize(path)
    pinned = torch.empty(min(n, 1 << 30), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(pinned, device="cuda")

    def timed(fn):
        return med(lambda: (fn(), sync()))

    h2d = pinned.numel() / timed(lambda: dev.copy_(pinned, non_blocking=True)) / 1e9
    engine.torch.load_file(path, device="cuda:0")
    ours = timed(lambda: engine.torch.load_file(path, device="cuda:0"))
    pair("CUDA load, warm", ours, timed(lambda: ref.load_file(path, device="cuda:0")),
         "reference load_file(device='cuda')")
    pair("CUDA load vs load_file + .to", ours, timed(lambda: {k: v.to("cuda") for k, v in ref.load_file(path).items()}),
         "reference load_file then .to('cuda')")
    pair("CUDA load, warm", n / (h2d * 1e9), None, f"the engine reaches {n / ours / 1e9 / h2d:.0%} of it",
         impl="limit: pinned host-to-device copy")


if __name__ == "__main__":
    sys.exit(main())
