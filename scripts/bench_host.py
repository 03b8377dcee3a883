"""The host copy engine against this machine's own limit, in one run.

Every row moves the tensor bytes of one warm BF16 checkpoint out of the page cache on every core, as
GB/s and as a ratio to limits measured in the same run (``benchmarks/host.py``): the device copy path
(the chunk ring over the emulated CUDA runtime) and ``load_into`` against the reference, the file
cached in large folios and/or page by page (``--cache``), with each copy source (``--source all``),
cold (``--cold``) and with its data on a 64-byte line (``--aligned``).  A fresh process per sample.

    python scripts/bench_host.py --size 256MB --runs 3 # quick (default 2 GiB, 7 runs)
"""

from __future__ import annotations

import os
import sys

import harness
from benchmarks import common, host

FOLIOS = {"large": "large folios", "small": "4 KiB pages"}


def sample(kind: str, path: str, reps: int, cold: bool) -> dict:
    """One sample of ``kind`` (runs in a fresh process): the first call's seconds, the next calls'."""
    out: dict = {}
    if kind.startswith("floor-"):
        floor = host.Floor(path, kind.partition("-")[2])
        if cold:  # one read of the evicted file: what the disk gives every core's reads
            common.evict_cache(path)
            out.update(first=harness.times(floor.run, 1, warmup=0)[0], repeated=[])
        else:
            out.update(repeated=harness.times(floor.run, reps))
        out.update(ok=floor.check(path))
        floor.close()
    elif kind == "limit":
        for key, huge in (("repeated", False), ("huge", True)):
            lim = host.Limit(path, huge=huge)
            out[key] = harness.times(lim.run, reps)
            out["ok"] = out.get("ok", True) and lim.check()
            lim.close()
    elif kind.startswith(("device", "ringrate")):
        if kind.startswith("ringrate"):  # one page per chunk: the ring's own cost per chunk
            from engine.gpu.geometry import default_geometry

            os.environ["ENGINE_RING"] = f"{4096 / 2**20},64,{default_geometry().threads}"
        dma, _, keep = kind.partition("-")[2].partition("-")
        if keep:  # the ring kept between loads; "kept": the mappings too
            import engine

            engine.keep_staging(True)
            engine.keep_mappings(keep == "kept")
        load = host.RingLoad(path, dma=dma)
        t = harness.times(load.run, reps + 1, warmup=0)
        out.update(first=t[0], repeated=t[1:], maxrss=common.hwm_bytes(), ok=True)
        if dma == "memcpy":
            lim = host.Limit(path)
            out["ok"] = load.check(lim.src, lim.start)
            lim.close()
        load.close()
    else:
        import safetensors
        import torch  # an inference server has torch loaded before it loads weights

        import engine

        lib, _, mode = kind.partition("-")
        dst = harness.destination(path)
        if lib == "engine":
            engine.keep_mappings(mode == "kept")

            def load():
                engine.load_into(path, dst)
        else:
            import safetensors.torch

            def load():
                for k, v in safetensors.torch.load_file(path).items():
                    dst[k].copy_(v)

        if cold:
            common.evict_cache(path)
            before = host.file_huge_kib()
        t = harness.times(load, 1 if cold else reps + 1, warmup=0)
        if cold and before is not None:  # how the cold read left the file in the page cache
            out["huge_gained_kib"] = host.file_huge_kib() - before
        out.update(first=t[0], repeated=t[1:])
        probe = next(iter(dst))
        with safetensors.safe_open(path, framework="pt") as f:  # bytes: a random BF16 may be a NaN
            out["ok"] = bool(dst[probe].view(torch.uint8).equal(f.get_tensor(probe).view(torch.uint8)))
    out.setdefault("maxrss", common.hwm_bytes())  # this process's own peak (VmHWM)
    return out


def main(argv=None) -> int:
    ap = harness.parser(__doc__, size="2GiB", runs=7, reps=5, dir=None)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--source", default="auto", choices=["auto", "pread", "mmap", "all"])
    ap.add_argument("--cache", default="both", choices=["large", "small", "both"])
    ap.add_argument("--aligned", action="store_true")
    ap.add_argument("--rows", help="only the rows whose name contains this text (and the limit)")
    a = ap.parse_args(argv)
    common.compile_engine()
    path = common.checkpoint_file(a.size, base=a.dir)
    nbytes = host.data_range(path)[1]
    states = ["large", "small"] if a.cache == "both" else [a.cache]
    bases = {"": path, **({" [data on a 64-byte line]": host.aligned_copy(path)} if a.aligned else {})}
    # (tag, file, page cache state): the small state on a copy, so that both stay cached through the run
    files = [(f" [{FOLIOS[st]}]" * (len(states) > 1) + btag, base if st == "large" else host.twin(base, "pages"), st)
             for btag, base in bases.items() for st in states]
    sources = ["auto", "pread", "mmap"] if a.source == "all" else [a.source]
    plan = []  # (label, the old row name --rows matches; case; impl; child kind; copy source; cold; file; state)

    def add(label, case, impl, kind, f=path, st=states[0], source=sources[0], cold=False):
        if not a.rows or kind == "limit" or a.rows in label:
            plan.append((label, case, impl, kind, source, cold, f, st))

    add("limit", "warm file -> CPU memory", "limit: native memcpy", "limit")
    for ftag, f, st in files:
        add(f"floor: native pread{ftag}", f"warm file -> CPU memory{ftag}", "limit: native pread", "floor-pread", f, st)
        add(f"floor: native fresh mapping{ftag}", f"warm file -> CPU memory{ftag}", "limit: native fresh mapping",
            "floor-mapped", f, st)
        for s in sources:
            stag = f" [{s}]" * (len(sources) > 1)
            tag = stag + ftag
            chunk = f"page cache -> page-locked chunk, dma=none{tag}"
            for label, case, impl, kind in (
                    ("engine copy path, dma=none", chunk, "engine", "device-none"),
                    ("engine ring alone, 4 KiB chunks, dma=none", f"ring alone, 4 KiB chunks, dma=none{tag}", "engine",
                     "ringrate-none"),
                    ("engine copy path, dma=none, staging kept", chunk, "engine, staging kept", "device-none-keep"),
                    ("engine copy path, dma=none, staging and mappings kept", chunk, "engine, staging and mappings kept",
                     "device-none-kept"),
                    ("engine copy path, dma=memcpy", f"page cache -> page-locked chunk, dma=memcpy{tag}", "engine",
                     "device-memcpy"),
                    ("load_into", f"load_into{ftag}", "engine" + stag, "engine"),
                    ("load_into, mappings kept", f"load_into{ftag}", "engine, mappings kept" + stag, "engine-kept")):
                add(label + tag, case, impl, kind, f, st, s)
        add(f"reference load_file + copy_{ftag}", f"load_into{ftag}", "reference", "reference", f, st)
    if a.cold:
        add("floor: native pread, cold", "cold file -> CPU memory", "limit: native pread", "floor-pread", cold=True)
        add("load_into cold", "load_into cold", "engine", "engine", cold=True)
        add("reference cold", "load_into cold", "reference", "reference", cold=True)
    for _, f, st in files:
        gained = host.cache_state(f, st)
        if gained is not None:
            print(f"{os.path.basename(f)} ({st}): {gained / 2**20:.2f} GiB of the page cache in large folios",
                  file=sys.stderr)

    def one(p):
        kind, source, cold, f, st = p[3:]
        if not cold:
            host.cache_state(f, st, evict=False)  # whatever was reclaimed comes back in its state
        return harness.call(sample, kind, f, a.reps, cold, env=harness.child_env(ENGINE_COPY_SOURCE=source))

    got = harness.rounds(plan, a.runs, one)
    report = harness.Report()
    for p, samples in got.items():
        label, case, impl, kind = p[:4]
        extra = {"row": label, "ok": all(s.get("ok", True) for s in samples), "peak_rss_bytes": max(s["maxrss"] for s in samples)}
        if any(s.get("huge_gained_kib") is not None for s in samples):
            extra["huge_gained_kib"] = harness.median(s.get("huge_gained_kib", 0) for s in samples)
        if "first" in samples[0] and not kind.startswith(("device", "ringrate")):
            report.add(case + (", first call" if samples[0]["repeated"] else ""), impl,
                       [s["first"] for s in samples], nbytes, **extra)
        if samples[0]["repeated"]:
            report.add(case + (", repeated" if kind in ("engine", "engine-kept", "reference") else ""), impl,
                       [harness.median(s["repeated"]) for s in samples], nbytes, **extra)
        if kind == "limit":
            report.add(case, "limit: native memcpy into huge pages (not a tensor's memory)",
                       [harness.median(s["huge"]) for s in samples], nbytes)
        if kind.startswith("ringrate"):
            report.note(f"{case}: {nbytes / 4096 / report.rows[-1]['median_s']:,.0f} chunks/s")
    report.ratio("x_limit", report.seconds(impl="limit: native memcpy"))
    report.against("x_reference", "reference")
    bad = [f"{r['case']} / {r['impl']}" for r in report.rows if r.get("ok") is False]
    report.note("bytes checked: " + (f"MISMATCH in {bad}" if bad else "every row equals the file"))
    report.finish(a.json, "case", "impl", "median_s", "gbps", "x_limit", "x_reference", "peak_rss_bytes")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
