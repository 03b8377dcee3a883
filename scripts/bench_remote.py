"""Whole checkpoints over HTTP, S3, GCS, Azure and the Hugging Face Hub against the line rate, in one run.

A BF16 Llama-shaped checkpoint in 4 shards, served by nginx on 127.0.0.1 from a warm page cache over
HTTP and as S3, GCS and Azure Blob (path-style, anonymous: the engine's token and SharedKey signing are
still sent), and as a gated Hub repo (a Hub on 127.0.0.1 answering the API and redirecting each file to
nginx, as the Hub redirects to its CDN).  Rows (``--rows`` names them), interleaved, a fresh process per sample: the line rate,
the engine's loads and their variants, machine limits, the reference and peers in ``--peers-python``.
Per row: GB/s, x line rate, x engine http, peak RSS and whether the bytes equal the files'.

    python scripts/bench_remote.py --size 512MB --runs 3 # quick
    python scripts/bench_remote.py --sweep               # connections x request size, http and s3
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import shutil
import sys
import tempfile

import harness
from benchmarks import common, host
from servers import HubServer


def _measure(load, repeat: int = 0) -> dict:
    """``load()`` once (or a warm-up and ``repeat`` more: their median): seconds, peak RSS, checksum."""
    import torch  # noqa: F401  (an inference server has torch loaded)

    last = [None]

    def run():
        last[0] = None
        last[0] = load()

    common.reset_hwm()
    t = harness.times(run, repeat or 1, warmup=1 if repeat else 0)
    return {"seconds": harness.median(t), "hwm": common.hwm_bytes(), "checksum": common.touch_all(last[0] or {})}


def engine_load(url: str, options: dict, repeat: int = 0) -> dict:
    import engine.torch

    return _measure(lambda: engine.torch.load_file(url, **options), repeat)


def engine_load_into(url: str) -> dict:
    import engine
    import engine.urls.remote

    out = harness.destination(list(engine.urls.remote.read_metadata(url).headers.values()))
    return _measure(lambda: (engine.load_into(url, out), out)[1])


def engine_cached(url: str, cache: str, first: bool) -> dict:
    """Into an empty ``cache_dir``, or the next load (the directory filled untimed where it is empty)."""
    import engine.torch

    if first:
        shutil.rmtree(cache, ignore_errors=True)
    elif not os.path.isdir(cache) or not os.listdir(cache):
        engine.torch.load_file(url, cache_dir=cache)
    return _measure(lambda: engine.torch.load_file(url, cache_dir=cache))


def disk_write(nbytes: int, directory: str) -> dict:
    """The bytes written from pre-faulted memory in 16 MiB writes, each one's write-back started at
    once (``sync_file_range``), then ``fsync``: the disk's own pace."""
    from engine.io.reader import start_writeback

    view, path = memoryview(host.prefaulted(nbytes)), os.path.join(directory, "disk-write.bin")

    def write():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for i in range(0, len(view), 16 << 20):
            start_writeback(fd, i, os.pwrite(fd, view[i : i + (16 << 20)], i))
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
    """Into an emulated device (``host.BenchDevice``) through the chunk ring, the clock started after
    the headers are read; ``repeat``: the ring kept between loads."""
    import torch

    import engine
    from engine.loading import pipeline
    from engine.loading.loader import _sources, key_bases
    from engine.urls import remote_load

    opened = remote_load.open_parts(url)
    parts = [p._replace(rows=list(p.header.table.file_order())) for p in opened.parts]
    bases = key_bases(parts)
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
    engine.keep_staging(bool(repeat))
    dest = pipeline.Destination(device_targets=targets, device_ops=dev)
    got = _measure(lambda: (pipeline.run_sources(_sources(parts, bases, remote_load.DEVICE_CHUNK_BYTES), dest,
                                                 threads=opened.reads.connections, gpu_path="copy"), out)[1], repeat)
    opened.close()
    return got


def reference(urls: list[str], download: str | None = None, repeat: int = 0) -> dict:
    """Each shard fetched whole with ``urllib`` then ``safetensors.torch.load``; with ``download`` (a
    folder) fetched to files there, then ``load_file`` and a read of every tensor."""
    import urllib.request

    import safetensors.torch

    def once():
        out = {}
        for i, url in enumerate(urls):
            with urllib.request.urlopen(url) as r:
                if download is None:
                    out.update(safetensors.torch.load(r.read()))
                    continue
                local = os.path.join(download, f"shard{i}.safetensors")
                with open(local, "wb") as f:
                    shutil.copyfileobj(r, f, 16 << 20)
            out.update(safetensors.torch.load_file(local))
        if download:
            common.touch_all(out)  # inside the clock: a mapping's bytes arrive now
        return out

    return _measure(once, repeat)


def peer(name: str, urls: list[str], endpoint: str) -> dict:
    """A peer loader installed in ``--peers-python``."""
    def once():
        out: dict = {}
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

    return _measure(once)


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, size="2GB", runs=5)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--peers-python", help="python of an environment with the peer loaders")
    ap.add_argument("--rows", help="comma-separated row names to run (default all)")
    ap.add_argument("--sweep", action="store_true", help="engine loads only: connections x request size")
    a = ap.parse_args(argv)
    import engine

    common.compile_engine()
    directory = harness.checkpoint(a.size, shards=a.shards)
    names = [os.path.basename(f) for f in common.checkpoint_files(directory)]
    nbytes = sum(engine.read_header(os.path.join(directory, n)).data_size for n in names)
    expected = harness.call(engine_load, directory, {})["checksum"]
    scratch = tempfile.mkdtemp(prefix="engine-download-", dir=common.cache_dir())  # as large as the checkpoint
    rows: dict[str, tuple] = {}  # name: (case, impl, function, args, env, python), or (case, impl, why skipped)
    with harness.served(directory) as (ng, index, s3_index, s3_env), contextlib.ExitStack() as stack:
        urls, env, http = [ng.url("ckpt/" + n) for n in names], harness.child_env(), "http -> CPU, owned"

        def row(name, case, impl, fn, *args, env=env, python=None):
            rows[name] = (case, impl, fn, args, env, python)

        row("line rate", http, "limit: curl line rate", None)
        for scheme, url, e in (("http", index, env), ("s3", s3_index, s3_env)):
            for c, m in itertools.product((4, 8, 16), (16, 64)) if a.sweep else [(0, 0)]:
                opts = {"connections": c, "chunk_bytes": m << 20} if c else {}
                name, impl = (f"{scheme} c={c} {m}MiB", f"engine, {c} connections, {m} MiB") if c else \
                    (f"engine {scheme}", "engine")
                row(name, f"{scheme} -> CPU, owned", impl, engine_load, url, opts, env=e)
                row(name + " repeated", f"{scheme} -> CPU, owned, repeated", impl, engine_load, url, opts, 3, env=e)
            if not a.sweep:
                row(f"engine {scheme} load_into", f"{scheme} -> CPU tensors (load_into)", "engine", engine_load_into,
                    url, env=e)
                row(f"engine {scheme} device", f"{scheme} -> page-locked chunk (emulated device)", "engine",
                    engine_device, url, "none", env=e)
        if not a.sweep:
            # the same files as gs://, az:// (nginx answers as an anonymous store: the engine still sends
            # its token, or signs every request with SharedKey) and an hf:// repo (a Hub on 127.0.0.1
            # resolving the revision and redirecting each file to nginx, the CDN)
            key = base64.b64encode(b"bench account key, 32 bytes long").decode()
            stores = {
                "gs": ("gs://bucket/ckpt/model.safetensors.index.json",
                       harness.child_env(STORAGE_EMULATOR_HOST=ng.base, GOOGLE_OAUTH_ACCESS_TOKEN="bench-token")),
                "az": ("az://bucket/ckpt/model.safetensors.index.json", harness.child_env(
                    AZURE_STORAGE_CONNECTION_STRING=f"AccountName=bench;AccountKey={key};BlobEndpoint={ng.base}")),
            }
            hub = stack.enter_context(HubServer(ng.root, cdn=ng))
            hub.tokens.add("hf_bench")
            sha = hub.add("org/ckpt", directory, gated=True)
            hf_env = harness.child_env(HF_ENDPOINT=hub.endpoint, HF_TOKEN="hf_bench",
                                       HF_HOME=os.path.join(scratch, "hf_home"))
            stores["hf"] = ("hf://org/ckpt", hf_env)
            for scheme, (url, e) in stores.items():
                row(f"engine {scheme}", f"{scheme} -> CPU, owned", "engine", engine_load, url, {}, env=e)
            row("engine hf resolve URLs", "hf -> CPU, owned", "engine, the resolve URL of the index over http",
                engine_load, f"{hub.endpoint}/org/ckpt/resolve/{sha}/model.safetensors.index.json",
                {"headers": {"Authorization": "Bearer hf_bench"}}, env=hf_env)
            for var, val, what in (("HUGE_PAGES", "1", "huge pages"), ("HUGE_PAGES", "0", "4k pages"),
                                   ("FAULT_AHEAD", "1", "fault-ahead 1"), ("FAULT_AHEAD", "0", "fault-ahead 0")):
                e = harness.child_env(**{"ENGINE_" + var: val})
                row(f"engine http {what}", http, f"engine, ENGINE_{var}={val}", engine_load, index, {}, env=e)
                if var == "HUGE_PAGES":
                    row(f"engine http repeated {what}", http + ", repeated", f"engine, ENGINE_{var}={val}", engine_load,
                        index, {}, 3, env=e)
            cache = os.path.join(scratch, "cache")
            row("fault limit (no network)", http, "limit: page faults of fresh memory", fault_limit, nbytes)
            row("engine http cache_dir 1st", http + ", cache_dir", "engine, 1st load", engine_cached, index, cache, True)
            row("engine http cache_dir 2nd", http + ", cache_dir", "engine, 2nd load", engine_cached, index, cache, False)
            row("disk write+fsync", http + ", cache_dir", "limit: disk write+fsync", disk_write, nbytes, scratch)
            row("local owned load", "local files -> CPU, owned", "engine", engine_load, directory, {"backend": "pread"})
            row("engine http device memcpy", "http -> emulated device, copies move the bytes", "engine", engine_device,
                index, "memcpy")
            row("engine http device repeated", "http -> page-locked chunk (emulated device), repeated", "engine",
                engine_device, index, "none", 3)
            row("GETs + reference", http, "reference, GETs + load", reference, urls)
            row("GETs + reference repeated", http + ", repeated", "reference, GETs + load", reference, urls, None, 3)
            row("download + reference", http, "reference, download + load_file", reference, urls, scratch)
            keys = ["bucket/ckpt/" + n for n in names]
            for name, module, case, where, e in (
                    ("s3fs", "s3fs", "s3 -> CPU, owned", keys, s3_env),
                    ("runai", "runai_model_streamer", "s3 -> CPU, owned", ["s3://" + k for k in keys], s3_env),
                    ("safetensors-streaming", "safetensors_streaming", http, urls, env)):
                why = harness.missing(module, a.peers_python) if a.peers_python else "no --peers-python"
                rows[name] = (case, name, why) if why else (case, name, peer, (name, where, ng.base), e, a.peers_python)
        if a.rows:
            wanted = {r.strip() for r in a.rows.split(",")} | {"line rate"}
            rows = {k: v for k, v in rows.items() if k in wanted}
        run = [k for k, v in rows.items() if len(v) > 3]

        def sample(name):
            case, impl, fn, args, e, python = rows[name]
            if fn is None:
                return {"seconds": harness.curl(urls), "checksum": expected}
            return harness.call(fn, *args, env=e, python=python, check=False)

        got = harness.rounds(run, a.runs, sample, warmup=True)
    shutil.rmtree(scratch, ignore_errors=True)
    report = harness.Report()
    for name, v in rows.items():
        ok = [s for s in got.get(name, []) if "seconds" in s]
        moved = not (name.startswith(("fault", "line", "disk")) or name.endswith(("device", "device repeated")))
        r = report.add(v[0], v[1], [s["seconds"] for s in ok], nbytes, row=name, skipped=None if len(v) > 3 else v[2],
                       peak_bytes=harness.median([s["hwm"] for s in ok if "hwm" in s] or [0]) or None,
                       equal=all(s.get("checksum") == expected for s in ok) if moved and ok else None,
                       errors=[s["error"] for s in got.get(name, []) if "error" in s])
        if r["skipped"] or r["errors"]:
            report.note(f"{name}: {r['skipped'] or r['errors'][0]}")
    line, engine_s = report.seconds(impl="limit: curl line rate"), report.seconds(http, "engine")
    report.ratio("x_line", line)
    report.ratio("x_engine", engine_s)
    s = {r["row"]: r["median_s"] for r in report.rows}
    if line and s.get("fault limit (no network)"):
        report.note(f"owned-load bound (line rate and page faults one after the other): "
                    f"{nbytes / (line + s['fault limit (no network)']) / 1e9:.2f} GB/s")
    if engine_s and s.get("disk write+fsync") and s.get("engine http cache_dir 1st"):
        allowance, first = (engine_s + s["disk write+fsync"]) / 0.9, s["engine http cache_dir 1st"]
        report.note(f"cache_dir 1st: {first:.2f} s against an allowance of {allowance:.2f} s ((engine http + disk "
                    f"write+fsync) / 0.9): {'within' if first <= allowance else 'OVER'}")
    report.note(f"{nbytes / 1e9:.2f} GB of tensor bytes in {a.shards} shards, {a.runs} samples per row")
    return report.finish(a.json, "row", "median_s", "gbps", "x_line", "x_engine", "peak_bytes", "equal")


if __name__ == "__main__":
    sys.exit(main())
