"""The host copy engine against this machine's own limit, in one run.

Every row moves the tensor bytes of one warm BF16 checkpoint (2 GiB by default) out of the
page cache, on every core, and is printed as GB/s and as a ratio to the machine's limit
measured in the same run (a native parallel ``memcpy`` of the same bytes from a warm,
fully mapped read-only mapping into pre-faulted memory, same thread count; see
``asv_benchmarks/benchmarks/host.py``):

* ``limit``: that copy, repeated in one process, into 4 KiB pages as a torch tensor's memory is
  (``limit into huge pages``: the same into transparent huge pages, as numpy allocates large
  arrays and as the limit did before: faster by the TLB misses it saves, which no load into a
  model's tensors gets);
* ``floor: native pread`` / ``floor: native fresh mapping``: what any load that does not
  already hold a populated mapping of the file pays at least (native, nothing of the
  engine's): the kernel's copy out of the page cache, or a mapping built, populated, copied
  from and torn down.  The limit leaves those costs out; a first load in a process cannot;
* ``engine copy path, dma=none``: the engine's device copy path (the native chunk ring, its
  default geometry) over the emulated CUDA runtime (``tests/emucudart``) whose copies complete
  without moving bytes: the host side of a GPU load (page cache -> page-locked chunk), which
  is what this host can show;
* ``engine copy path, dma=none, staging kept``: the same with the ring kept between loads
  (``engine.keep_staging(True)``): the repeated loads page-lock nothing;
  ``..., staging and mappings kept``: also the file's mapping kept populated between loads
  (``engine.keep_mappings(True)``): the repeated loads map nothing either;
* ``engine ring alone, 4 KiB chunks``: the same with chunks of one page (``ENGINE_RING``), so
  that the ring's own cost per chunk (take, fill, issue, record, recycle) dominates: printed
  as chunks per second;
* ``engine copy path, dma=memcpy``: the same with each device copy done by a CPU
  ``memcpy`` on a stream thread, as an emulated DMA engine (it costs this host a second
  copy of every byte and a core, which a GPU's DMA engine does not);
* ``load_into first`` / ``repeated``: ``engine.load_into`` into pre-faulted torch tensors,
  in a process that has imported torch: the first call in a fresh process, and the median
  of the calls after it; ``load_into, mappings kept``: the same with
  ``engine.keep_mappings(True)`` (the first call maps and populates the whole file, every
  later one copies out of that mapping: the limit's own source);
* ``reference first`` / ``repeated``: ``safetensors.torch.load_file`` + ``copy_`` into the
  same kind of tensors;
* ``cold``: ``load_into`` and the reference's first call with the file evicted from the
  page cache first (``--cold``).

``--aligned`` adds the load rows for a copy of the checkpoint whose data starts on a 64-byte
line (its header padded with spaces, as the format allows): the kernel's copy out of the page
cache slows to two thirds or less when a file offset and its destination sit differently in a
line, which is the case for every tensor of a file whose data starts 8 bytes into one.

How the page cache holds the file decides what a mapping costs: a file read in by large
sequential reads (or written by large writes) sits in large folios, and mapping it costs
little; a file faulted in page by page (read through a mapping, as the reference reads)
sits in 4 KiB folios, and a mapping costs an entry per page to build and tear down, more
than ``pread``'s own overhead.  ``--cache both`` (the default) measures each state, the
file in large folios and a copy of it page by page (``host.cache_state``), and prints how
much of the cache each read put in large folios (``FileHugePages``).

Every sample is a fresh process (rows interleaved, ``--runs`` samples each), the engine's
bytecode is compiled first, the files are read in their states before the first sample.
The engine's copy source (``ENGINE_COPY_SOURCE``) is its default, ``auto`` (each copy
thread times what mapping its pieces' pages costs against copying them and maps while that
is under a quarter, else ``pread``s), unless
``--source`` says otherwise; ``--source all`` adds the rows with each source pinned.

    python scripts/bench_host.py                       # 2 GiB, 7 samples per row, both cache states
    python scripts/bench_host.py --size 256MB --runs 3 # quick
    python scripts/bench_host.py --cache large --source all --cold --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FOLIOS = {"large": "large folios", "small": "4 KiB pages"}
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "asv_benchmarks"))
from benchmarks import common, host  # noqa: E402

# -- children: one sample each, printed as one JSON line ------------------------------------------


def _tensors(path: str):
    import torch

    import engine

    h = engine.read_header(path)
    dst = {k: torch.empty(h[k].shape, dtype=torch.bfloat16) for k in h.keys()}
    for t in dst.values():
        t.fill_(1)  # pre-faulted, as a model's parameters are
    return dst


def _repeated(run, reps: int) -> list[float]:
    """Seconds of ``reps`` calls of ``run`` after an untimed one (the destination's first
    touch is not part of a limit or a floor)."""
    run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def child(kind: str, path: str, reps: int, cold: bool) -> dict:
    out: dict = {"kind": kind}
    if kind.startswith("floor-"):
        floor = host.Floor(path, kind.partition("-")[2])
        if cold:  # one read of the evicted file: what the disk gives every core's reads
            common.evict_cache(path)
            t0 = time.perf_counter()
            floor.run()
            out.update(first=time.perf_counter() - t0, repeated=[])
        else:
            out.update(repeated=_repeated(floor.run, reps))
        out.update(nbytes=floor.nbytes, ok=floor.check(path))
        floor.close()
    elif kind == "limit":
        lim = host.Limit(path)
        out.update(repeated=_repeated(lim.run, reps), nbytes=lim.nbytes, ok=lim.check(), threads=lim.threads)
        lim.close()
        # the same into huge pages, as numpy allocates its large arrays (not a tensor's memory)
        lim = host.Limit(path, huge=True)
        out.update(huge=_repeated(lim.run, reps))
        lim.close()
    elif kind.startswith("device") or kind.startswith("ringrate"):
        if kind.startswith("ringrate"):  # one page per chunk: the ring's own cost per chunk
            from engine.gpu.geometry import default_geometry

            os.environ["ENGINE_RING"] = f"{4096 / 2**20},64,{default_geometry().threads}"
        dma, _, keep = kind.partition("-")[2].partition("-")
        if keep:  # the ring kept between loads (engine.keep_staging); "kept": mappings too
            import engine

            engine.keep_staging(True)
            engine.keep_mappings(keep == "kept")
        load = host.RingLoad(path, dma=dma)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            load.run()
            times.append(time.perf_counter() - t0)
        ok = True
        out["maxrss"] = common.hwm_bytes()  # the load's peak, before the check's own buffers
        if dma == "memcpy":
            lim = host.Limit(path)
            ok = load.check(lim.src, lim.start)
            lim.close()
        out.update(first=times[0], repeated=times[1:], nbytes=load.nbytes, ok=ok)
        load.close()
    else:
        import torch  # an inference server has torch loaded before it loads weights

        lib, _, mode = kind.partition("-")
        if lib == "engine":
            import engine

            engine.keep_mappings(mode == "kept")  # the file's mapping kept between calls
            dst = _tensors(path)

            def load():
                engine.load_into(path, dst)
        else:
            import safetensors.torch

            dst = _tensors(path)

            def load():
                for k, v in safetensors.torch.load_file(path).items():
                    dst[k].copy_(v)

        huge_before = None
        if cold:
            common.evict_cache(path)
            huge_before = host.file_huge_kib()
        t0 = time.perf_counter()
        load()
        first = time.perf_counter() - t0
        if huge_before is not None:  # how the cold read left the file in the page cache
            out["huge_gained_kib"] = host.file_huge_kib() - huge_before
        times = []
        if not cold:
            for _ in range(reps):
                t0 = time.perf_counter()
                load()
                times.append(time.perf_counter() - t0)
        out.update(first=first, repeated=times, nbytes=sum(t.numel() * 2 for t in dst.values()))
        probe = next(iter(dst))
        import safetensors

        with safetensors.safe_open(path, framework="pt") as f:
            # bytes, not values: a random BF16 pattern may be a NaN, which equals nothing
            out["ok"] = bool(dst[probe].view(torch.uint8).equal(f.get_tensor(probe).view(torch.uint8)))
    out.setdefault("maxrss", common.hwm_bytes())  # this process's own peak (VmHWM), not the parent's
    return out


def sample(kind: str, path: str, reps: int, cold: bool, source: str) -> dict:
    env = dict(os.environ, ENGINE_COPY_SOURCE=source)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--path", path, "--reps", str(reps)]
    if cold:
        cmd.append("--cold")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{kind}: exit {done.returncode}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the run -----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5, help="repeated calls per sample")
    ap.add_argument("--cold", action="store_true", help="also the cold rows")
    ap.add_argument("--source", default="auto", choices=["auto", "pread", "mmap", "all"])
    ap.add_argument("--cache", default="both", choices=["large", "small", "both"],
                    help="the page cache state of the file: large folios, 4 KiB pages, or a file in each")
    ap.add_argument("--aligned", action="store_true", help="also a copy of the file with its data on a 64-byte line")
    ap.add_argument("--rows", default=None, help="only the rows whose label contains this text (and the limit)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.path, a.reps, a.cold)))
        return 0

    common.compile_engine()
    path = common.checkpoint_file(common.parse_size(a.size), base=a.dir)
    states = ["large", "small"] if a.cache == "both" else [a.cache]
    bases = {"": path}
    if a.aligned:
        bases[" [data on a 64-byte line]"] = host.aligned_copy(path)
    # (row tag, file, page cache state): the small state on a copy of the file, so that both
    # states stay in the cache through the run
    files = []
    for btag, base in bases.items():
        for st in states:
            f = base if st == "large" else host.twin(base, "pages")
            stag = f" [{FOLIOS[st]}]" if len(states) > 1 else ""
            files.append((stag + btag, f, st))
    sources = ["auto", "pread", "mmap"] if a.source == "all" else [a.source]
    # (label, child kind, copy source, cold, file, state)
    plan = [("limit", "limit", sources[0], False, path, states[0])]
    for ftag, f, st in files:
        plan += [(f"floor: native pread{ftag}", "floor-pread", sources[0], False, f, st),
                 (f"floor: native fresh mapping{ftag}", "floor-mapped", sources[0], False, f, st)]
        for s in sources:
            tag = (f" [{s}]" if len(sources) > 1 else "") + ftag
            plan += [(f"engine copy path, dma=none{tag}", "device-none", s, False, f, st),
                     (f"engine ring alone, 4 KiB chunks, dma=none{tag}", "ringrate-none", s, False, f, st),
                     (f"engine copy path, dma=none, staging kept{tag}", "device-none-keep", s, False, f, st),
                     (f"engine copy path, dma=none, staging and mappings kept{tag}", "device-none-kept", s, False,
                      f, st),
                     (f"engine copy path, dma=memcpy{tag}", "device-memcpy", s, False, f, st),
                     (f"load_into{tag}", "engine", s, False, f, st),
                     (f"load_into, mappings kept{tag}", "engine-kept", s, False, f, st)]
        plan.append((f"reference load_file + copy_{ftag}", "reference", sources[0], False, f, st))
    if a.cold:
        plan += [("floor: native pread, cold", "floor-pread", sources[0], True, path, "large"),
                 ("load_into cold", "engine", sources[0], True, path, "large"),
                 ("reference cold", "reference", sources[0], True, path, "large")]
    if a.rows:
        plan = [p for p in plan if p[0] == "limit" or a.rows in p[0]]
    results: dict[str, list[dict]] = {label: [] for label, *_ in plan}
    read_in = []  # how each file's first read left it in the page cache
    for _, f, st in files:
        gained = host.cache_state(f, st)
        if gained is not None:
            read_in.append(f"{os.path.basename(f)} ({st}): {gained / 2**20:.2f} of {os.path.getsize(f) / 2**30:.2f} GiB")
    began = time.time()
    for i in range(a.runs):
        for label, kind, source, cold, f, st in plan:
            if not cold:
                host.cache_state(f, st, evict=False)  # whatever was reclaimed comes back in its state
            results[label].append(sample(kind, f, a.reps, cold, source))
        print(f"sample {i + 1}/{a.runs} done ({time.time() - began:.0f} s)", file=sys.stderr)

    nbytes = results["limit"][0]["nbytes"]
    med = statistics.median

    def rep(label):  # median over samples of each sample's median repeated call (None: not run)
        return med(med(r["repeated"]) for r in results[label]) if results.get(label) else None

    def first(label):
        return med(r["first"] for r in results[label]) if results.get(label) else None

    limit = rep("limit")
    rows = [("limit (native parallel memcpy, populated mapping)", limit, None),
            ("limit into huge pages (not a tensor's memory; not the ratios' base)",
             med(med(r["huge"]) for r in results["limit"]), None)]
    for ftag, _, _ in files:
        ref = f"reference load_file + copy_{ftag}"
        rows += [(f"floor: native pread{ftag}", rep(f"floor: native pread{ftag}"), None),
                 (f"floor: native fresh mapping{ftag}", rep(f"floor: native fresh mapping{ftag}"), None)]
        for s in sources:
            tag = (f" [{s}]" if len(sources) > 1 else "") + ftag
            rows += [(f"engine copy path, dma=none{tag} (repeated)", rep(f"engine copy path, dma=none{tag}"), None),
                     (f"engine copy path, dma=none, staging kept{tag} (repeated)",
                      rep(f"engine copy path, dma=none, staging kept{tag}"), None),
                     (f"engine copy path, dma=none, staging and mappings kept{tag} (repeated)",
                      rep(f"engine copy path, dma=none, staging and mappings kept{tag}"), None),
                     (f"engine copy path, dma=memcpy{tag} (repeated)", rep(f"engine copy path, dma=memcpy{tag}"),
                      None),
                     (f"load_into{tag}, first call", first(f"load_into{tag}"), first(ref)),
                     (f"load_into{tag}, repeated", rep(f"load_into{tag}"), rep(ref)),
                     (f"load_into, mappings kept{tag}, first call", first(f"load_into, mappings kept{tag}"),
                      first(ref)),
                     (f"load_into, mappings kept{tag}, repeated", rep(f"load_into, mappings kept{tag}"), rep(ref))]
        rows += [(f"{ref}, first call", first(ref), None), (f"{ref}, repeated", rep(ref), None)]
    if a.cold:
        rows += [("floor: native pread, cold", first("floor: native pread, cold"), None),
                 ("load_into cold", first("load_into cold"), first("reference cold")),
                 ("reference cold", first("reference cold"), None)]
    threads = results["limit"][0]["threads"]
    print(f"\n{nbytes / 1e9:.2f} GB of tensor data, {threads} threads, {a.runs} fresh-process samples per row "
          f"(median), source {a.source}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if read_in:
        print("page cache in large folios (FileHugePages) gained when each file was read in: " + "; ".join(read_in))
    print("| row | median ms | GB/s | x limit | x reference |\n|---|---|---|---|---|")
    table = []
    for label, sec, ref in rows:
        if sec is None:  # left out by --rows
            continue
        ratio_ref = f"{ref / sec:.2f}x" if ref else ""
        print(f"| {label} | {sec * 1e3:.1f} | {nbytes / sec / 1e9:.2f} | {limit / sec:.2f}x | {ratio_ref} |")
        table.append({"row": label, "seconds": sec, "gbps": nbytes / sec / 1e9, "x_limit": limit / sec,
                      "x_reference": (ref / sec) if ref else None})
    cold_huge = {label: med(r["huge_gained_kib"] for r in rs) / 2**20 for label, rs in results.items()
                 if rs and all("huge_gained_kib" in r for r in rs)}
    if cold_huge:
        print("the cold reads left in large folios (GiB of the file's): "
              + ", ".join(f"{k} {v:.2f}" for k, v in cold_huge.items()))
    for label in results:
        if label.startswith("engine ring alone"):
            sec = rep(label)
            print(f"{label}: {nbytes / 4096 / sec:,.0f} chunks/s ({nbytes / 4096:,.0f} chunks of 4 KiB in {sec * 1e3:.1f} ms)")
    bad = [label for label, rs in results.items() if not all(r.get("ok", True) for r in rs)]
    rss = {label: max(r["maxrss"] for r in rs) for label, rs in results.items()}
    print("peak RSS per row (GB): " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in rss.items()))
    print("bytes checked: " + ("all rows equal the file" if not bad else f"MISMATCH in {bad}"))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps({"nbytes": nbytes, "runs": a.runs, "source": a.source, "cache": a.cache, "rows": table,
                                "samples": results, "rss": rss}) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
