"""Whole checkpoints over HTTP and S3 against the line rate, in one run.

A BF16 Llama-shaped checkpoint (2 GB by default, 4 shards and an index) is served by nginx on
127.0.0.1 from a warm page cache (``harness.served``): over HTTP, and as S3 through path-style
anonymous GETs of the same files, so that the server is never the bottleneck.  Rows (``--rows``
names them), interleaved, each sample a fresh process:

* ``line rate``: one ``curl -o /dev/null`` per shard, all at once; ``fault limit (no network)``:
  fresh memory of the checkpoint's size faulted in as an owned load's is (the owned-load bound
  printed below is the two one after the other);
* ``engine http`` / ``engine s3``: ``engine.torch.load_file(url)`` of the index (owned CPU
  tensors); ``... repeated``: a warm-up load then 3 in the process (their median);
  ``... huge pages`` / ``4k pages`` / ``fault-ahead 1`` / ``fault-ahead 0``: ``ENGINE_HUGE_PAGES``
  or ``ENGINE_FAULT_AHEAD`` forced; ``... load_into``: ``engine.load_into`` into pre-faulted tensors;
* ``engine http cache_dir 1st`` / ``2nd``: with ``cache_dir=`` an empty directory, then the next
  load served from it; ``disk write+fsync``: the bytes written and fsynced, no network (the 1st
  load's allowance is ``(engine http + disk write+fsync) / 0.9``); ``local owned load``:
  ``load_file(backend="pread")`` of the local shards;
* ``engine http device`` / ``s3 device``: the load into an emulated device (``tests/emucudart``)
  through the chunk ring, copies that move nothing (socket -> page-locked chunk); ``... memcpy``:
  copies that move the bytes; ``... repeated``: the ring kept between 3 loads;
* ``GETs + reference``: each shard fetched whole with ``urllib``, then ``safetensors.torch.load``
  (``... repeated`` as above); ``download + reference``: fetched to files, then ``load_file``;
* peers installed in ``--peers-python``: ``s3fs + reference``, Run:ai Model Streamer (S3),
  ``safetensors-streaming``.

Each row: GB/s of tensor bytes, ratios to the line rate and to ``engine http``, the loading
process's peak RSS (``VmHWM``) and whether its bytes equal the local files' (a checksum taken
after the clock stops; lazily mapped tensors are read inside the clock).

    python scripts/bench_remote.py                       # 2 GB, 5 samples per row
    python scripts/bench_remote.py --size 512MB --runs 3 # quick
    python scripts/bench_remote.py --sweep               # connections x request size, http and s3
    python scripts/bench_remote.py --peers-python /path/to/venv/bin/python --json out.json
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import harness
from benchmarks import common


def _measure(load, repeat: int = 0) -> dict:
    """``load()`` once (or a warm-up and ``repeat`` more: their median): seconds, peak RSS, checksum."""
    import torch  # noqa: F401  (an inference server has torch loaded)

    common.reset_hwm()
    t = harness.times(load, repeat, warmup=1) if repeat else harness.times(load, 1, warmup=0)
    out = load.last if hasattr(load, "last") else None
    return {"seconds": harness.median(t), "hwm": common.hwm_bytes(), "checksum": common.touch_all(out or {})}


def _keeping(fn):
    """``fn`` whose last result is kept on it (``.last``), for :func:`_measure`'s checksum."""
    def run():
        run.last = None
        run.last = fn()
    return run


def engine_load(url: str, options: dict, repeat: int = 0) -> dict:
    import engine.torch

    return _measure(_keeping(lambda: engine.torch.load_file(url, **options)), repeat)


def engine_load_into(url: str) -> dict:
    import torch

    import engine
    import engine.urls.remote

    out = {}
    for h in engine.urls.remote.read_metadata(url).headers.values():
        for name in h.keys():
            dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[h[name].dtype]
            out[name] = torch.ones(h[name].shape, dtype=dt)
    return _measure(_keeping(lambda: (engine.load_into(url, out), out)[1]))


def engine_cached(url: str, cache: str, first: bool) -> dict:
    """``load_file(url, cache_dir=cache)``: into an empty directory, or the next load (the directory
    filled by an untimed load where it is empty)."""
    import engine.torch

    if first:
        shutil.rmtree(cache, ignore_errors=True)
    elif not os.path.isdir(cache) or not os.listdir(cache):
        engine.torch.load_file(url, cache_dir=cache)
    return _measure(_keeping(lambda: engine.torch.load_file(url, cache_dir=cache)))


def disk_write(nbytes: int, directory: str) -> dict:
    """The cache's other half: the bytes written from pre-faulted memory to a new file in 16 MiB
    writes, each one's write-back started at once (``sync_file_range``), then ``fsync``."""
    import ctypes

    from benchmarks import host

    libc = ctypes.CDLL(None, use_errno=True)
    libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    view = memoryview(host.prefaulted(nbytes))
    path = os.path.join(directory, "disk-write.bin")

    def write():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for i in range(0, len(view), 16 << 20):
            libc.sync_file_range(fd, i, os.pwrite(fd, view[i : i + (16 << 20)], i), 2)  # SYNC_FILE_RANGE_WRITE
        os.fsync(fd)
        os.close(fd)

    out = _measure(write)
    os.unlink(path)
    return out


def fault_limit(nbytes: int) -> dict:
    """Fresh memory for the tensors (the engine's own block) faulted in 16 MiB at a time on every core."""
    from engine.io.reader import map_threads, populate_write
    from engine.sinks._host import host_block

    def fault():
        view = memoryview(host_block(nbytes))
        map_threads(lambda i: populate_write(view[i : i + (16 << 20)]), range(0, nbytes, 16 << 20), os.cpu_count() or 2)

    return _measure(fault)


def engine_device(url: str, dma: str, repeat: int = 0) -> dict:
    """A remote load into an emulated device (``host.BenchDevice``) through the chunk ring; the clock
    starts after the headers are read; ``repeat``: the ring kept between loads."""
    import torch
    from benchmarks import host

    import engine
    from engine.loading import pipeline
    from engine.loading.loader import _bases, _sources
    from engine.urls import remote_load

    opened = remote_load.open_parts(url)
    parts = [p._replace(rows=list(p.header.table.file_order())) for p in opened.parts]
    bases = _bases(parts)
    block = host.prefaulted(sum(p.header.data_size for p in parts))
    targets, pos, out = {}, 0, {}
    for p, b in zip(parts, bases, strict=True):
        t = p.header.table
        for r in p.rows:
            n = int(t.ends[r]) - int(t.begins[r])
            if n:
                targets[b + r] = block[pos : pos + n]
                out[t.names[r]] = torch.from_numpy(block[pos : pos + n])
            pos += n
    dev = host.BenchDevice(dma)
    if repeat:
        engine.keep_staging(True)

    def once():
        pipeline.run_sources(_sources(parts, bases, remote_load.DEVICE_CHUNK_BYTES),
                             pipeline.Destination(device_targets=targets, device_ops=dev),
                             threads=opened.reads.connections, gpu_path="copy")
        return out

    got = _measure(_keeping(once), repeat)
    opened.close()
    return got


def gets_reference(urls: list[str], repeat: int = 0) -> dict:
    import urllib.request

    import safetensors.torch

    def once():
        out = {}
        for url in urls:
            with urllib.request.urlopen(url) as r:
                out.update(safetensors.torch.load(r.read()))
        return out

    return _measure(_keeping(once), repeat)


def download_reference(urls: list[str], scratch: str) -> dict:
    import urllib.request

    import safetensors.torch

    def once():
        out = {}
        for i, url in enumerate(urls):
            local = os.path.join(scratch, f"shard{i}.safetensors")
            with urllib.request.urlopen(url) as r, open(local, "wb") as f:
                shutil.copyfileobj(r, f, 16 << 20)
            out.update(safetensors.torch.load_file(local))
        common.touch_all(out)  # inside the clock: the mapped tensors' bytes arrive now
        return out

    return _measure(_keeping(once))


def peer(name: str, urls: list[str], endpoint: str) -> dict:
    """A peer loader (installed in ``--peers-python``): s3fs + reference, Run:ai, safetensors-streaming."""
    out: dict = {}

    def once():
        out.clear()
        if name == "s3fs":
            import s3fs
            import safetensors.torch

            fs = s3fs.S3FileSystem(anon=True, client_kwargs={"endpoint_url": endpoint})
            for key in urls:
                out.update(safetensors.torch.load(fs.cat_file(key)))
        elif name == "runai":
            from runai_model_streamer import SafetensorsStreamer

            with SafetensorsStreamer() as streamer:
                streamer.stream_files(urls)
                out.update((k, t.clone()) for k, t in streamer.get_tensors())
        else:
            import safetensors_streaming as ss

            for url in urls:
                out.update(ss.load_file(url) if hasattr(ss, "load_file") else ss.load(url))
        return out

    return _measure(_keeping(once))


def local_checksum(directory: str) -> int:
    import engine.torch

    return common.touch_all(engine.torch.load_file(directory))


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--size", default="2GB")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--peers-python", default=None, help="python of an environment with the peer loaders")
    ap.add_argument("--rows", default=None, help="comma-separated row names to run (default all)")
    ap.add_argument("--sweep", action="store_true", help="engine http only: connections x request size")
    a = ap.parse_args(argv)
    import engine

    common.compile_engine()
    directory = harness.checkpoint(harness.parse_size(a.size), shards=a.shards)
    shards = common.checkpoint_files(directory)
    names = [os.path.basename(f) for f in shards]
    nbytes = sum(engine.read_header(f).data_size for f in shards)
    expected = harness.call(local_checksum, directory)
    scratch = tempfile.mkdtemp(prefix="engine-download-", dir=common.cache_dir())  # as large as the checkpoint
    py, peers = sys.executable, a.peers_python
    with harness.served(directory) as (ng, index, s3_index, s3_env):
        urls = [ng.url("ckpt/" + n) for n in names]
        env, cache = harness.child_env(), os.path.join(scratch, "cache")

        def forced(**kw):
            return harness.child_env(**kw)

        rows: dict[str, tuple] = {"line rate": ("http -> CPU, owned", "limit: curl line rate", None)}
        for scheme, url, e in (("http", index, env), ("s3", s3_index, s3_env)):
            rows.update({
                f"engine {scheme}": (f"{scheme} -> CPU, owned", "engine", engine_load, (url, {}), e),
                f"engine {scheme} repeated": (f"{scheme} -> CPU, owned, repeated", "engine", engine_load,
                                              (url, {}, 3), e),
                f"engine {scheme} load_into": (f"{scheme} -> CPU tensors (load_into)", "engine", engine_load_into,
                                               (url,), e),
                f"engine {scheme} device": (f"{scheme} -> page-locked chunk (emulated device)", "engine",
                                            engine_device, (url, "none"), e)})
        if a.sweep:
            rows = {"line rate": rows["line rate"]}
            for scheme, url, e in (("http", index, env), ("s3", s3_index, s3_env)):
                for conns in (4, 8, 16):
                    for chunk in (16, 64):
                        opts = {"connections": conns, "chunk_bytes": chunk << 20}
                        for rep in (0, 3):
                            name = f"{scheme} c={conns} {chunk}MiB" + " repeated" * bool(rep)
                            rows[name] = (f"{scheme} -> CPU, owned" + ", repeated" * bool(rep),
                                          f"engine, {conns} connections, {chunk} MiB", engine_load, (url, opts, rep), e)
        else:
            http = "http -> CPU, owned"
            for var, val in (("HUGE_PAGES", "1"), ("HUGE_PAGES", "0"), ("FAULT_AHEAD", "1"), ("FAULT_AHEAD", "0")):
                what = {"HUGE_PAGES1": "huge pages", "HUGE_PAGES0": "4k pages"}.get(var + val, f"fault-ahead {val}")
                e = forced(**{"ENGINE_" + var: val})
                rows[f"engine http {what}"] = (http, f"engine, ENGINE_{var}={val}", engine_load, (index, {}), e)
                if var == "HUGE_PAGES":
                    rows[f"engine http repeated {what}"] = (http + ", repeated", f"engine, ENGINE_{var}={val}",
                                                            engine_load, (index, {}, 3), e)
            rows.update({
                "fault limit (no network)": (http, "limit: page faults of fresh memory", fault_limit, (nbytes,), env),
                "engine http cache_dir 1st": (http + ", cache_dir", "engine, 1st load", engine_cached,
                                              (index, cache, True), env),
                "engine http cache_dir 2nd": (http + ", cache_dir", "engine, 2nd load", engine_cached,
                                              (index, cache, False), env),
                "disk write+fsync": (http + ", cache_dir", "limit: disk write+fsync", disk_write, (nbytes, scratch), env),
                "local owned load": ("local files -> CPU, owned", "engine", engine_load,
                                     (directory, {"backend": "pread"}), env),
                "engine http device memcpy": ("http -> emulated device, copies move the bytes", "engine",
                                              engine_device, (index, "memcpy"), env),
                "engine http device repeated": ("http -> page-locked chunk (emulated device), repeated", "engine",
                                                engine_device, (index, "none", 3), env),
                "GETs + reference": (http, "reference, GETs + load", gets_reference, (urls,), env),
                "GETs + reference repeated": (http + ", repeated", "reference, GETs + load", gets_reference,
                                              (urls, 3), env),
                "download + reference": (http, "reference, download + load_file", download_reference,
                                         (urls, scratch), env)})
            s3_keys = ["bucket/ckpt/" + n for n in names]
            for name, module, case, peer_urls, e in (
                    ("s3fs", "s3fs", "s3 -> CPU, owned", s3_keys, s3_env),
                    ("runai", "runai_model_streamer", "s3 -> CPU, owned", ["s3://" + k for k in s3_keys], s3_env),
                    ("safetensors-streaming", "safetensors_streaming", http, urls, env)):
                why = harness.missing(module, peers) if peers else "no --peers-python"
                rows[name] = (case, name, why) if why else (case, name, peer, (name, peer_urls, ng.base), e, peers)
        if a.rows:
            wanted = {r.strip() for r in a.rows.split(",")} | {"line rate"}
            rows = {k: v for k, v in rows.items() if k in wanted}
        skipped = {k: v for k, v in rows.items() if len(v) == 3 and k != "line rate"}
        rows = {k: v for k, v in rows.items() if k not in skipped}

        def sample(name):
            r = rows[name]
            if name == "line rate":
                return {"seconds": harness.curl(urls), "checksum": expected}
            return harness.call(r[2], *r[3], env=r[4], python=r[5] if len(r) > 5 else py, check=False)

        got = harness.rounds(rows, a.runs, sample, warmup=True)
    shutil.rmtree(scratch, ignore_errors=True)
    report = harness.Report()
    for name, samples in got.items():
        case, impl = rows[name][:2]
        ok = [s for s in samples if "seconds" in s]
        moved = not (name.startswith(("fault", "line", "disk")) or name.endswith(("device", "device repeated")))
        report.add(case, impl, [s["seconds"] for s in ok], nbytes, row=name,
                   peak_bytes=harness.median([s["hwm"] for s in ok if "hwm" in s] or [0]) or None,
                   equal=all(s.get("checksum") == expected for s in ok) if moved and ok else None,
                   errors=[s["error"] for s in samples if "error" in s])
    for name, (case, impl, why) in skipped.items():
        report.rows.append({"case": case, "impl": impl, "median_s": None, "gbps": None, "bytes": nbytes, "runs": 0,
                            "row": name, "skipped": why})
    line, engine_s = report.seconds(impl="limit: curl line rate"), report.seconds("http -> CPU, owned", "engine")
    report.ratio("x_line", lambda r: line)
    report.ratio("x_engine", lambda r: engine_s)
    fault = report.seconds(impl="limit: page faults of fresh memory")
    if line and fault:
        report.note(f"owned-load bound (line rate and page faults one after the other): "
                    f"{nbytes / (line + fault) / 1e9:.2f} GB/s")
    seconds = {r.get("row"): r["median_s"] for r in report.rows}
    disk, first = seconds.get("disk write+fsync"), seconds.get("engine http cache_dir 1st")
    if engine_s and disk and first:
        allowance = (engine_s + disk) / 0.9
        report.note(f"cache_dir 1st: {first:.2f} s against an allowance of {allowance:.2f} s "
                    f"((engine http + disk write+fsync) / 0.9): {'within' if first <= allowance else 'OVER'}")
    report.note(f"{nbytes / 1e9:.2f} GB of tensor bytes in {a.shards} shards, nginx on 127.0.0.1, "
                f"{a.runs} samples per row; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for r in report.rows:
        if r.get("errors") or r.get("skipped"):
            report.note(f"{r['row']}: {r.get('skipped') or r['errors'][0]}")
    return report.finish(a.json, "row", "median_s", "gbps", "x_line", "x_engine", "peak_bytes", "equal")


if __name__ == "__main__":
    sys.exit(main())
