"""The chunk ring's geometry by measurement: ``scripts/gpu_check.py --sweep``.

Times device loads of the checkpoint (``engine.load_into(directory, tensors)`` into device
tensors made once) over a grid of the ring's parameters: chunk size, chunks in flight (their
product, the page-locked bytes, at most :data:`MAX_PINNED`), copy threads (the host's cores
less 8, 6, 4, 2 and 0, at least 1), where the copy threads take the bytes
(``ENGINE_COPY_SOURCE``: ``auto`` or ``pread``) and, for chunks filled out of a mapping, how
they write them (``ENGINE_RING_STORES``: ``stream``, past the caches, or ``cached``).  One
child process does it all, the CUDA context up once: for each configuration it sets
``ENGINE_RING``, ``ENGINE_COPY_SOURCE`` and ``ENGINE_RING_STORES`` (the engine reads them at
each load) and loads twice, each load after closing the rings
that earlier loads left (so each one sets up its ring, as the first load of a process
does), timed to ``torch.cuda.synchronize()``.  A configuration's rate is the median of its
two loads.

``ENGINE_RING_UNMAP`` (``end``: each file mapped once for the load and dropped when it
ends; ``chunk``: each chunk's mapped run released as soon as it is copied) and the ``mmap``
source are variants beside ``auto`` and ``pread``.  Each load's ring records
(``engine.load_records()``, where the engine has them) are kept with its configuration.

``--short`` (what ``scripts/gpu_check.py`` runs inside its budget): the default geometry
with every source (``pread``, ``mmap``, ``auto``) under each unmap mode, then three other
shapes (half and twice the chunk size at the same page-locked bytes, another thread
count); each configuration's first load sets its ring up and its second reuses it, so the
two show a process's first load and a warm ring.

The order makes a sweep cut short by its budget still useful: first every geometry at the
default threads, source and stores, then every thread count, source and stores for the
three fastest geometries, then the rest, fastest geometries first.  No configuration starts when what is
left of the budget would not cover it.  The bytes of the fastest configuration are checked
at the end: a load of it into zeroed tensors must give the checksum that the process's
first load (untimed, the default geometry, into zeroed tensors) gave.

Writes ``gpu_check-sweep.json`` (every configuration's loads) and ``gpu_check-sweep.md`` (the
configurations by rate, then the best rate for each value of each parameter: the curve), and
prints the best geometry as an ``ENGINE_RING=chunk_mib,chunks,threads`` line.

With ``--device cpu`` it is a dry run on the emulated CUDA runtime (tests/emucudart, its
copies are memcpy on a stream thread: not a rate of any GPU) over a small grid, every
configuration's bytes checked against the files, so that CI can run it in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # imported from elsewhere (a test): its sibling modules
    sys.path.insert(0, HERE)
import checkout_path  # noqa: E402

ROOT = checkout_path.use_checkout()

MIB = 1 << 20
#: the grid on a GPU
CHUNK_MIB = (1, 2, 4, 8, 16)
CHUNKS = (8, 16, 32, 64)
#: the most a configuration page-locks (the engine's own default ceiling)
MAX_PINNED = 256 * MIB
#: the dry run's grid (a 64 MB checkpoint, the emulated runtime)
DRY_CHUNK_MIB = (1, 4)
DRY_CHUNKS = (4, 16)
#: copy threads: the host's cores plus these, at least 1
THREAD_OFFSETS = (-8, -6, -4, -2, 0)
#: (``ENGINE_COPY_SOURCE``, ``ENGINE_RING_STORES``, ``ENGINE_RING_UNMAP``): a chunk filled by
#: ``pread`` is written by the kernel and holds no mapping, so neither the stores nor the
#: unmap setting applies to it ("-": left unset)
VARIANTS = (("auto", "stream", "end"), ("auto", "cached", "end"), ("pread", "-", "-"), ("mmap", "stream", "end"),
            ("auto", "stream", "chunk"), ("mmap", "stream", "chunk"))
#: the short sweep's sources and unmap modes, every pair at the default geometry
SHORT_SOURCES = ("pread", "mmap", "auto")
SHORT_UNMAP = ("end", "chunk")
#: geometries whose every thread count, source and stores are timed right after the first pass
TOP = 3
#: what the sweep's JSON and markdown are called in --out
NAME = "gpu_check-sweep"


def thread_counts(cores: int) -> list[int]:
    return sorted({max(1, cores + d) for d in THREAD_OFFSETS})


def geometries(dry: bool) -> list[tuple[int, int]]:
    """(chunk MiB, chunks) pairs of the grid, page-locking at most :data:`MAX_PINNED`."""
    sizes, counts = (DRY_CHUNK_MIB, DRY_CHUNKS) if dry else (CHUNK_MIB, CHUNKS)
    return [(m, n) for m in sizes for n in counts if m * n * MIB <= MAX_PINNED]


Config = tuple[int, int, int, str, str, str]  # chunk MiB, chunks, threads, source, stores, unmap


def short_configs(default: tuple[int, int, int], cores: int) -> list[Config]:
    """The short sweep (``--short``): ``default`` (chunk MiB, chunks, threads) with every
    source under each unmap mode, then half and twice the chunk size (the same page-locked
    bytes) and another thread count (every core, or half the default's where that is every
    core), at the engine's default source and unmap."""
    mib, chunks, threads = default
    out: list[Config] = [(mib, chunks, threads, src, "-", unmap) for unmap in SHORT_UNMAP for src in SHORT_SOURCES]
    other = cores if cores != threads else max(1, threads // 2)
    shapes = [(max(1, mib // 2), chunks * 2, threads), (mib * 2, max(2, chunks // 2), threads), (mib, chunks, other)]
    for m, n, t in shapes:
        cfg = (m, n, t, "-", "-", "-")
        if cfg not in out and (m, n, t) != (mib, chunks, threads):
            out.append(cfg)
    return out


def order(geoms: list[tuple[int, int]], threads: list[int], base_threads: int, rates: dict,
          first: tuple[int, int] | None = None) -> Iterator[tuple[str, Config]]:
    """Configurations in the order they are timed, each with its stage (``"A"``, ``"B"``,
    ``"C"``, see the module's text); ``rates`` (configuration -> GB/s) is read as the
    sweep goes, to rank the geometries after the first pass; ``first`` is timed first."""
    seen: set = set()
    if first in geoms:
        geoms = [first, *[g for g in geoms if g != first]]

    def fresh(stage, configs):
        for c in configs:
            if c not in seen:
                seen.add(c)
                yield stage, c

    base = VARIANTS[0]
    yield from fresh("A", [(m, n, base_threads, *base) for m, n in geoms])
    rank = sorted(geoms, key=lambda g: -rates.get((g[0], g[1], base_threads, *base), 0.0))
    yield from fresh("B", [(m, n, t, *v) for m, n in rank[:TOP] for t in threads for v in VARIANTS])
    yield from fresh("C", [(m, n, t, *v) for m, n in rank[TOP:] for t in threads for v in VARIANTS])


# -- the child: one process, every configuration ------------------------------------------------------


class _Target:
    """What the sweep loads into, and how: ``load()`` (seconds of one load), ``zero()``,
    ``fingerprint()`` (of the loaded bytes), ``reference`` (the fingerprint the bytes must
    have, None until known), ``nbytes``, ``close()``."""

    reference: str | None = None
    nbytes = 0
    name = ""

    def load(self, cold: bool = True) -> float:
        """Seconds of one load; ``cold``: the rings earlier loads left are closed first."""
        raise NotImplementedError

    def zero(self) -> None:
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError

    def close(self) -> dict:
        return {}


class _Cuda(_Target):
    """Preallocated torch tensors on the device; ``engine.load_into(directory, tensors)``."""

    def __init__(self, files: list[str], dev: str) -> None:
        import bench_gpu
        import torch

        self.torch = torch
        torch.cuda.init()
        torch.empty(1, device=dev)  # the CUDA context is up before any clock
        self.dev = dev
        self.name = torch.cuda.get_device_name(torch.device(dev))
        self.directory = os.path.dirname(files[0])
        self.tensors = bench_gpu._engine_load_into_prepare(files, dev)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self.checksum = bench_gpu.checksum
        torch.cuda.synchronize()

    def load(self, cold: bool = True) -> float:
        import engine
        from engine.gpu import rings

        if cold:  # the load sets its ring up, as a process's first load does
            rings.release_rings()
        self.torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.load_into(self.directory, self.tensors, strict=True)
        self.torch.cuda.synchronize()
        return time.perf_counter() - t0

    def zero(self) -> None:
        for t in self.tensors.values():
            t.zero_()
        self.torch.cuda.synchronize()

    def fingerprint(self) -> str:
        return self.checksum(self.tensors)


class _Emulated(_Target):
    """The checkpoint's tensors as host arrays behind the emulated CUDA runtime
    (tests/emucudart): the engine's pipeline, its chunk ring and the runtime's entry points
    as on a GPU, the copies a memcpy on the emulator's stream thread."""

    def __init__(self, files: list[str]) -> None:
        import hashlib
        import mmap

        import numpy as np

        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from emucudart import EmulatedRingOps, Emulator

        import engine

        self.np, self.hashlib = np, hashlib
        self.emu = Emulator()
        self.ops = EmulatedRingOps(self.emu)
        self.name = "the emulated CUDA runtime (tests/emucudart), not a GPU"
        self.files = files
        self.layout = []  # (file, begins, ends, data_start, base)
        self.dst: dict = {}
        base = 0
        ref = hashlib.blake2b(digest_size=16)
        for f in files:
            h = engine.read_header(f)
            t = h.table
            self.layout.append((f, t.begins, t.ends, h.data_start, base))
            with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
                for r in range(len(t.names)):
                    b, e = h.data_start + int(t.begins[r]), h.data_start + int(t.ends[r])
                    self.dst[base + r] = np.zeros(e - b, np.uint8)
                    ref.update(m[b:e])
            base += len(t.names)
        self.reference = ref.hexdigest()
        self.nbytes = sum(len(a) for a in self.dst.values())

    def load(self, cold: bool = True) -> float:
        from engine.gpu import rings
        from engine.loading import pipeline
        from engine.planning.plan import plan_reads

        if cold:
            rings.release_rings()
        fds = []
        try:
            sources = []
            for f, begins, ends, data_start, base in self.layout:
                fds.append(os.open(f, os.O_RDONLY))
                rows = list(range(len(begins)))
                sources.append(pipeline.Source(fds[-1], f, plan_reads(begins, ends, rows, data_start, 16 * MIB), base))
            t0 = time.perf_counter()
            pipeline.run_sources(sources, pipeline.Destination(device_targets=self.dst, device_ops=self.ops))
            return time.perf_counter() - t0
        finally:
            for fd in fds:
                os.close(fd)

    def zero(self) -> None:
        for a in self.dst.values():
            a.fill(0)

    def fingerprint(self) -> str:
        h = self.hashlib.blake2b(digest_size=16)
        for key in sorted(self.dst):
            h.update(self.dst[key].data)
        return h.hexdigest()

    def close(self) -> dict:
        from engine.gpu import rings

        rings.release_rings()
        self.ops.close()
        st = self.emu.stats()
        # every chunk unlocked, every copy from a page-locked chunk, on the ring's device
        return {"emulator": st, "clean": st["registered"] == 0 and st["pageable"] == 0 and st["wrong_device"] == 0}


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


#: the variables a configuration sets ("-" in a configuration: left unset, the engine's default)
KNOBS = ("ENGINE_RING", "ENGINE_COPY_SOURCE", "ENGINE_RING_STORES", "ENGINE_RING_UNMAP")


def _configure(cfg: Config) -> None:
    """The environment the engine reads a configuration from at each load."""
    mib, chunks, threads, *rest = cfg
    for name, value in zip(KNOBS, [f"{mib},{chunks},{threads}", *rest], strict=True):
        if value == "-":
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _recorded(target: _Target, cold: bool) -> tuple[float, dict | None]:
    """One load of ``target`` and the ring's records of it summed (None where the engine
    keeps none)."""
    import bench_gpu

    cm, on = bench_gpu.ring_records()
    with cm as got:
        seconds = target.load(cold)
    return seconds, bench_gpu.sum_records(bench_gpu.record_dicts(got)) if on else None


def child(dev: str, files: list[str], seconds: float, short: bool = False) -> int:
    """Time the grid (or with ``short`` the short sweep) within ``seconds`` (from now),
    printing one JSON line per event: the start, the untimed first load, each configuration,
    the check of the best one, the end."""
    t_start = time.monotonic()
    deadline = t_start + seconds
    dry = not dev.startswith("cuda")
    target: _Target = _Emulated(files) if dry else _Cuda(files, dev)
    from engine.gpu.geometry import default_geometry

    saved = {k: os.environ.get(k) for k in KNOBS}
    for k in saved:  # the first load and the default geometry: the engine's defaults
        os.environ.pop(k, None)
    default = default_geometry()
    try:  # the cores this process may run on, as the engine counts them for its default
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = max(1, os.cpu_count() or 1)
    threads = thread_counts(cores)
    geoms = geometries(dry)
    first = (default.chunk_bytes // MIB, default.chunks)
    base = (first[0], first[1], default.threads)
    short_list = short_configs(base, cores) if short else []
    total = len(short_list) if short else len(geoms) * len(threads) * len(VARIANTS)
    _emit({"event": "start", "device": target.name, "cores": cores, "threads": threads, "geometries": geoms,
           "variants": VARIANTS, "configs": total, "bytes": target.nbytes, "short": short,
           "default": [default.chunk_bytes // MIB, default.chunks, default.threads],
           "engine_file": checkout_path.engine_origin(), "ring_file": checkout_path.engine_origin("engine.gpu._ring"),
           "setup_s": round(time.monotonic() - t_start, 2)})
    rates: dict = {}
    walls: list[float] = []
    ran = 0
    try:
        # a process's first load pays for what only a first load sets up (the runtime the ring
        # opens, the driver's state for a first copy): untimed, default geometry, into zeroed
        # tensors; on a GPU its bytes are the reference the best configuration's must match
        t0 = time.monotonic()
        target.zero()
        target.load()
        fp = target.fingerprint()
        if target.reference is None:
            target.reference = fp
        _emit({"event": "warm-up", "bytes_ok": fp == target.reference, "seconds": round(time.monotonic() - t0, 2)})
        plan = (("S", c) for c in short_list) if short else order(geoms, threads, default.threads, rates, first)
        for stage, cfg in plan:
            # no configuration starts that the budget would not cover, with the final check after it
            need = 2.5 * max(walls) + 2.0 if walls else 0.0
            if time.monotonic() + need > deadline:
                break
            _configure(cfg)
            mib, chunks, nthreads, source, how, unmap = cfg
            record: dict = {"event": "config", "stage": stage, "chunk_mib": mib, "chunks": chunks,
                            "threads": nthreads, "source": source, "stores": how, "unmap": unmap}
            t0 = time.monotonic()
            try:
                # the full grid sets the ring up for each load; the short sweep's second load
                # reuses the ring of its first (a process's first load, then a warm one)
                first_load, rec1 = _recorded(target, True)
                if dry:  # the emulator's bytes are cheap to check: every configuration's
                    target.zero()
                second, rec2 = _recorded(target, not short)
                if dry:
                    record["bytes_ok"] = target.fingerprint() == target.reference
                record["seconds"] = [first_load, second]
                record["gbps"] = [target.nbytes / s / 1e9 for s in (first_load, second)]
                record["median_gbps"] = statistics.median(record["gbps"])
                record["records"] = [rec1, rec2]
                rates[cfg] = record["median_gbps"] if record.get("bytes_ok", True) else 0.0
            except Exception as exc:  # a geometry the ring refuses: reported, the sweep goes on
                record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rates[cfg] = 0.0
            walls.append(time.monotonic() - t0)
            ran += 1
            _emit(record)
        if rates and max(rates.values()) > 0:
            best = max(rates, key=lambda c: rates[c])
            _configure(best)
            target.zero()
            seconds_best = target.load()
            fp = target.fingerprint()
            _emit({"event": "check", "config": list(best), "bytes_ok": fp == target.reference,
                   "fingerprint": fp, "reference": target.reference, "seconds": seconds_best})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        closing = target.close()
    _emit({"event": "end", "ran": ran, "not_run": total - ran, "elapsed_s": round(time.monotonic() - t_start, 1),
           **closing})
    return 0


# -- the parent: checkpoint, the child, the report ---------------------------------------------------


def parse_events(stdout: str) -> list[dict]:
    out = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def summarize(events: list[dict]) -> dict:
    """The sweep's result from the child's events: ``configs`` (those that ran, fastest
    first), ``best`` (or None), ``start``, ``warmup``, ``check``, ``end`` (each None if
    missing)."""
    start = next((e for e in events if e.get("event") == "start"), None)
    end = next((e for e in events if e.get("event") == "end"), None)
    check = next((e for e in events if e.get("event") == "check"), None)
    warmup = next((e for e in events if e.get("event") == "warm-up"), None)
    configs = [e for e in events if e.get("event") == "config"]
    ranked = sorted(configs, key=lambda e: -(e.get("median_gbps") or 0.0) if e.get("bytes_ok", True) else 0.0)
    best = next((e for e in ranked if e.get("median_gbps") and e.get("bytes_ok", True)), None)
    return {"start": start, "warmup": warmup, "end": end, "check": check, "configs": ranked, "best": best}


def ring_line(cfg: dict) -> str:
    """The ``ENGINE_RING=chunk_mib,chunks,threads`` line of a configuration."""
    return f"ENGINE_RING={cfg['chunk_mib']},{cfg['chunks']},{cfg['threads']}"


def env_line(cfg: dict) -> str:
    """Every variable of a configuration that it sets, as a shell would take them."""
    parts = [ring_line(cfg)]
    for name, key in (("ENGINE_COPY_SOURCE", "source"), ("ENGINE_RING_STORES", "stores"),
                      ("ENGINE_RING_UNMAP", "unmap")):
        if cfg.get(key, "-") != "-":
            parts.append(f"{name}={cfg[key]}")
    return " ".join(parts)


def records_text(rec: dict | None) -> str:
    """A load's ring records in a table cell: waits, page-locking, bytes per source, the
    ring's shape and unmap mode ("-" where the engine kept none)."""
    if not rec:
        return "-"
    if not rec.get("loads"):
        return "no load through the ring"

    def sec(key):
        v = rec.get(key)
        return "-" if v is None else f"{v:.3f}"

    def gb(key):
        v = rec.get(key)
        return "-" if v is None else f"{v / 1e9:.1f}"

    shape = ""
    if rec.get("chunk_bytes") and rec.get("slots"):
        shape = f" {rec['chunk_bytes'] / (1 << 20):g}Mx{rec['slots']:g}/{rec.get('threads') or '?'}t"
    net = f" network {gb('network_bytes')}" if rec.get("network_bytes") else ""
    pageable = f"; {rec['pageable']:g} PAGEABLE (chunks not page-locked)" if rec.get("pageable") else ""
    # loads with device kernels: the tensors reported and the seconds their reports (the
    # kernels' launches) took on the issuing thread
    hooked = (f"; kernels at {rec.get('reported') or 0:g} reports, {sec('report_s')} s"
              if rec.get("hooked") else "")
    return (f"{rec.get('loads', 0):g} loads ({rec.get('cold', 0):g} cold); wait fill {sec('fill_wait_s')}"
            f" slot {sec('slot_wait_s')} lock {sec('lock_s')} s; GB pread {gb('pread_bytes')}"
            f" mmap {gb('mmap_bytes')}{net};{shape} {rec.get('source') or '-'}, unmap {rec.get('unmap') or '-'}{pageable}"
            f"{hooked}")


def _curve(configs: list[dict], key: str) -> list[tuple]:
    """For each value of ``key``: the best and the median rate over the configurations that ran."""
    by: dict = {}
    for c in configs:
        if c.get("median_gbps"):
            by.setdefault(c.get(key, "-"), []).append(c["median_gbps"])
    return [(v, max(r), statistics.median(r), len(r)) for v, r in sorted(by.items())]


def markdown(meta: dict, result: dict) -> str:
    start, best = result["start"] or {}, result["best"]
    lines = [f"ring sweep on {meta['device_name']}; {meta['date']}; {start.get('cores', '?')} cores; checkpoint"
             f" {meta['size']} bytes ({start.get('bytes', 0) / 1e9:.2f} GB of tensors); {len(result['configs'])} of"
             f" {start.get('configs', '?')} configurations in {meta['total_s']:.0f} s (budget {meta['budget_s']} s)", "",
             "Each configuration loaded twice (its ring set up by each load); GB/s is the median of the two.", ""]
    if best:
        check = result["check"] or {}
        verdict = {True: "bytes checked", False: "BYTES DIFFER from the first load's",
                   None: "bytes not checked"}[check.get("bytes_ok")]
        lines.append(f"best: `{ring_line(best)}` (with `{env_line(best)}`): {best['median_gbps']:.2f} GB/s"
                     f" ({verdict})")
        d = start.get("default")
        if d:
            ref = next((c for c in result["configs"] if [c["chunk_mib"], c["chunks"], c["threads"]] == d
                        and (c["source"], c["stores"], c.get("unmap", "-")) == VARIANTS[0]
                        and c.get("median_gbps")), None)
            if ref:
                rank = result["configs"].index(ref) + 1
                lines.append(f"the default ({d[0]} MiB x {d[1]} chunks, {d[2]} threads, source"
                             f" {VARIANTS[0][0]}, stores {VARIANTS[0][1]}, unmap {VARIANTS[0][2]}):"
                             f" {ref['median_gbps']:.2f} GB/s, rank {rank}")
        lines.append("")
    lines += ["| rank | chunk MiB | chunks | page-locked MiB | threads | source | stores | unmap | GB/s"
              " | GB/s of each load | stage | ring records (first load) | detail |",
              "|---:|---:|---:|---:|---:|---|---|---|---:|---|---|---|---|"]
    for i, c in enumerate(result["configs"], 1):
        rate = f"{c['median_gbps']:.2f}" if c.get("median_gbps") else "-"
        each = " / ".join(f"{g:.2f}" for g in c.get("gbps", []))
        detail = c.get("error") or ("" if c.get("bytes_ok", True) else "bytes differ")
        rec = records_text((c.get("records") or [None])[0])
        lines.append(f"| {i} | {c['chunk_mib']} | {c['chunks']} | {c['chunk_mib'] * c['chunks']} | {c['threads']} |"
                     f" {c['source']} | {c['stores']} | {c.get('unmap', '-')} | {rate} | {each} | {c['stage']} |"
                     f" {rec} | {detail.replace('|', '/')} |")
    for key, title in (("chunk_mib", "chunk MiB"), ("chunks", "chunks"), ("threads", "threads"),
                       ("source", "source"), ("stores", "stores"), ("unmap", "unmap")):
        lines += ["", f"| {title} | best GB/s | median GB/s | configurations |", "|---|---:|---:|---:|"]
        lines += [f"| {v} | {b:.2f} | {m:.2f} | {n} |" for v, b, m, n in _curve(result["configs"], key)]
    return "\n".join(lines) + "\n"


def run_child(dev: str, files: list[str], left: float, runner: Callable, env: dict,
              short: bool = False) -> tuple[list[dict], str | None]:
    """The sweep's child within ``left`` seconds (it stops starting configurations 10 s
    before, and is stopped at ``left``): its events, and why it failed (or None)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--device", dev,
           "--seconds", f"{max(1.0, left - 10):.1f}", *(["--short"] if short else []), "--files", *files]
    rc, stdout, stderr = runner(cmd, left, env)
    if rc is None:
        return parse_events(stdout), f"the child ran past the budget and was stopped ({left:.0f} s)"
    if rc != 0:
        tail = [ln for ln in (stderr or stdout).strip().splitlines() if ln.strip()][-1:] or ["no output"]
        return parse_events(stdout), f"exit code {rc}: {tail[0][:300]}"
    return parse_events(stdout), None


def run(out: str, dev: str, files_for: Callable[[float], list[str] | None], budget: float, start: float,
        runner: Callable, env: dict, meta: dict) -> int:
    """The sweep as ``scripts/gpu_check.py --sweep`` runs it: the checkpoint
    (``files_for(deadline)``), its pages read once (a warm page cache), the child within what
    is left of ``budget`` seconds from ``start`` (``time.monotonic()``), the report.
    ``runner(cmd, timeout, env)`` runs a command: ``(exit code or None on timeout, stdout,
    stderr)``.  Exit status 0 when a configuration ran and the best one's bytes checked."""
    import bench_gpu

    deadline = start + budget
    os.makedirs(out, exist_ok=True)
    files = files_for(deadline)
    events: list[dict] = []
    error = None
    if files is None:
        error = "no checkpoint"
    else:
        bench_gpu.warm(files)
        # the report and the files are written after the child: a few seconds kept for them
        events, error = run_child(dev, files, deadline - time.monotonic() - 5, runner, env)
    result = summarize(events)
    total = time.monotonic() - start
    start_event = result["start"] or {}
    meta = {**meta, "total_s": round(total, 1), "budget_s": budget,
            "device_name": start_event.get("device", meta.get("device_name", dev)),
            "engine_file": {"parent": checkout_path.engine_origin(), "child": start_event.get("engine_file"),
                            "child_ring": start_event.get("ring_file")}}
    best, check = result["best"], result["check"]
    where = meta["engine_file"]
    # what makes the sweep fail, first found first: its figures are then not to be used
    problems = [
        (files is not None and result["start"] is not None
         and not all(checkout_path.from_checkout(p or "") for p in where.values()),
         f"the engine is not all this checkout's ({ROOT}): {where}"),
        (result["warmup"] is not None and not result["warmup"].get("bytes_ok"), "the first load's bytes differ"),
        (any(c.get("bytes_ok") is False for c in result["configs"]), "a configuration's bytes differ from the files"),
        (result["end"] is not None and not result["end"].get("clean", True),
         f"the emulated runtime was left unclean: {(result['end'] or {}).get('emulator')}"),
        (best is None, "no configuration ran"),
        (best is not None and not (check and check.get("bytes_ok")), "the best configuration's bytes differ or were"
         " not checked"),
    ]
    error = error or next((why for bad, why in problems if bad), None)
    record = {"meta": meta, "error": error, "best": best, "check": check, "end": result["end"],
              "start": result["start"], "warmup": result["warmup"], "configs": result["configs"],
              "ring": ring_line(best) if best else None}
    base = os.path.join(out, NAME)
    with open(base + ".json", "w") as f:
        json.dump(record, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(meta, result))
    ran = len(result["configs"])
    print(f"== ring sweep on {meta['device_name']}: {ran} of {start_event.get('configs', '?')} configurations"
          f" in {total:.0f} s (budget {budget:.0f} s)")
    for c in result["configs"][:5]:
        rate = f"{c['median_gbps']:.2f} GB/s" if c.get("median_gbps") else c.get("error", "failed")
        print(f"  {env_line(c)}: {rate}")
    if error:
        print(f"FAILED: {error}")
    if best:
        print(f"best: {env_line(best)}: {best['median_gbps']:.2f} GB/s,"
              f" bytes {'checked' if check and check.get('bytes_ok') else 'NOT checked or differ'}")
        print(ring_line(best))
    print(f"engine: parent {where['parent']}; child {where['child']}; its ring extension {where['child_ring']}")
    print(f"wrote {base}.json and {base}.md")
    return 1 if error else 0


def main() -> int:
    ap = argparse.ArgumentParser(description="the child of scripts/gpu_check.py --sweep (run that instead)")
    ap.add_argument("--child", action="store_true", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--short", action="store_true", help="the short sweep of scripts/gpu_check.py")
    ap.add_argument("--files", nargs="+", required=True)
    args = ap.parse_args()
    return child(args.device, args.files, args.seconds, args.short)


if __name__ == "__main__":
    sys.exit(main())
