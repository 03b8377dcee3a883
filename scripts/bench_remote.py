"""Whole checkpoints over HTTP and S3 against the line rate, in one run.

A BF16 Llama-shaped checkpoint (2 GB by default, in 4 shards with an index) is served by
nginx (Debian's package, started here with its own config on 127.0.0.1, warm page cache):
over HTTP, and as S3 through path-style anonymous GETs of the same files
(``AWS_ENDPOINT_URL`` pointing at nginx, which answers the ranged GETs S3 reads are on the
wire), so that the server is never the bottleneck.  Rows, interleaved, each sample a fresh
process (the engine's bytecode compiled first):

* ``line rate``: one ``curl -o /dev/null`` per shard, all at once (what the loopback and
  nginx deliver);
* ``fault limit (no network)``: fresh memory of the checkpoint's size with its pages
  faulted in as an owned load's are (huge pages where granted), no network: what an owned
  load pays on top of the network on this machine (the bound printed below the table is
  ``1 / (1 / line + 1 / fault)``, the two one after the other);
* ``engine http`` / ``engine s3``: ``engine.torch.load_file(url)`` of the index (CPU owned
  tensors), each sample a fresh process; ``... repeated``: the same load repeated in one
  process (a warm-up load, then 3, the median of those 3 is the sample);
  ``... huge pages`` / ``... 4k pages`` and ``... fault-ahead 1`` / ``... fault-ahead 0``:
  the owned load with ``ENGINE_HUGE_PAGES`` or ``ENGINE_FAULT_AHEAD`` forced either way
  (what each part gives on this machine, whatever its rule chose);
* ``engine http load_into`` / ``engine s3 load_into``: ``engine.load_into`` into
  pre-faulted tensors (a model's parameters, allocated before the load);
* ``engine http cache_dir 1st``: the owned load with ``cache_dir=`` an empty directory
  (every shard also written and fsynced there); ``... 2nd``: the next load of the same URL,
  served from the files there; ``disk write+fsync``: the checkpoint's bytes written from
  memory to a file on the same file system, write-back started as they go, and fsynced, no
  network (the first load's
  allowance is ``(engine http + disk write+fsync) / 0.9``, printed below the table);
  ``local owned load``: ``load_file`` of the same shards from the local directory with
  ``backend="pread"`` (owned tensors): what the second load's copies are read at;
* ``engine http device`` / ``engine s3 device``: the same load into an emulated device
  (the emulated CUDA runtime of the tests, ``tests/emucudart``) through the chunk ring: the
  connections receive each chunk's ranged GET straight into the ring's page-locked chunk,
  and the ring issues its copy; the device's copies complete without moving bytes (the host
  side of a GPU load: socket -> page-locked chunk; a GPU's DMA engine does the rest); its
  clock starts after the headers are read, the other engine rows' before.  ``... memcpy``:
  the copies move the bytes (a CPU copy standing in for the DMA engine, a core's work a GPU
  host does not pay), so that the bytes that reached the "device" are compared;
  ``... repeated``: a warm-up load, then 3 in the same process, the ring kept between
  them: the steady state, without a fresh process's set-up (the first touch
  of the ring's 128 MiB of page-locked chunks, huge pages where granted);
* ``GETs + reference``: each shard fetched whole with ``urllib`` into memory, one after
  the other, then ``safetensors.torch.load`` of those bytes (the reference's own way to
  load bytes it did not read from a file); ``... repeated`` in one process as above;
  ``download + reference``: each shard fetched to a local file, then
  ``safetensors.torch.load_file`` of each and a read of every tensor;
* peers, where installed in ``--peers-python`` (a separate environment, so that their
  pins never touch this one): ``s3fs + reference`` (``cat_file`` of each shard, then
  ``safetensors.torch.load``), Run:ai Model Streamer's S3 path, ``safetensors-streaming``.

Each row reports GB/s of tensor bytes (median), its ratio to the line rate and to the engine,
the peak RSS of the loading process (``VmHWM``) and whether the bytes equal the local file's
(a checksum of every tensor, taken after the clock stops).  Engine rows stop the clock
when every tensor is in memory; rows whose tensors are lazily mapped (the reference's)
include the read of every tensor, since that is when their bytes arrive.

    python scripts/bench_remote.py                       # 2 GB, 5 samples per row
    python scripts/bench_remote.py --size 512MB --runs 3 # quick
    python scripts/bench_remote.py --sweep               # connections x request size, http and s3
    python scripts/bench_remote.py --peers-python /path/to/venv/bin/python --json out.json
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "asv_benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from benchmarks import common  # noqa: E402
from servers import Nginx, nginx_binary  # noqa: E402

#: the child's preamble: the checksum helper and the peak-RSS reset, then the row's code
_PRELUDE = f"""
import json, os, sys, time
sys.path.insert(0, {os.path.join(ROOT, 'asv_benchmarks')!r})
from benchmarks import common
import torch
common.reset_hwm()
"""

_REPORT = """
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "hwm": common.hwm_bytes(), "checksum": common.touch_all(out)}))
"""


def _engine_load(url: str, options: str = "") -> str:
    return f"import engine.torch\nt0 = time.perf_counter()\nout = engine.torch.load_file({url!r}{options})\n"


def _engine_repeated(url: str, options: str = "", loads: int = 3) -> str:
    """A warm-up load, then ``loads`` more in the same process: the sample is their median
    (``t0`` is set so that the report's clock reads it)."""
    return (
        "import engine.torch, statistics\n"
        f"engine.torch.load_file({url!r}{options})\n"
        "times = []\n"
        f"for _ in range({loads}):\n"
        "    out = None\n"
        "    t = time.perf_counter()\n"
        f"    out = engine.torch.load_file({url!r}{options})\n"
        "    times.append(time.perf_counter() - t)\n"
        "t0 = time.perf_counter() - statistics.median(times)\n"
    )


def _engine_cached(url: str, cache: str, first: bool) -> str:
    """``load_file(url, cache_dir=cache)``: the first load into an empty directory, or the
    next one (the directory filled by an untimed load where it is empty)."""
    return (
        "import engine.torch, shutil\n"
        + (f"shutil.rmtree({cache!r}, ignore_errors=True)\n" if first else
           f"if not os.path.isdir({cache!r}) or not os.listdir({cache!r}):\n"
           f"    engine.torch.load_file({url!r}, cache_dir={cache!r})\n")
        + "common.reset_hwm()\n"
        + "t0 = time.perf_counter()\n"
        + f"out = engine.torch.load_file({url!r}, cache_dir={cache!r})\n"
    )


def _disk_write(nbytes: int, directory: str) -> str:
    """The cache's other half: the checkpoint's bytes written to a new file on the cache's
    file system and made durable, from memory faulted in before the clock: 16 MiB writes,
    each one's write-back started at once (``sync_file_range``, through libc), then
    ``fsync``: the disk's own pace (writing everything before one ``fsync`` measured up to
    3x slower on this VM)."""
    return (
        "import ctypes\n"
        "from benchmarks import host\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]\n"
        f"data = host.prefaulted({nbytes})\n"
        f"path = os.path.join({directory!r}, 'disk-write.bin')\n"
        "view = memoryview(data)\n"
        "t0 = time.perf_counter()\n"
        "fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)\n"
        "for i in range(0, len(view), 16 << 20):\n"
        "    n = os.pwrite(fd, view[i:i + (16 << 20)], i)\n"
        "    libc.sync_file_range(fd, i, n, 2)  # SYNC_FILE_RANGE_WRITE\n"
        "os.fsync(fd)\n"
        "os.close(fd)\n"
        "seconds = time.perf_counter() - t0\n"
        "os.unlink(path)\n"
        "t0 = time.perf_counter() - seconds\n"
        "out = {}\n"
    )


def _gets_reference(urls: list[str], repeat: int = 0) -> str:
    """Each shard's bytes with ``urllib``, then the reference's ``load`` of them; with
    ``repeat``, a warm-up and ``repeat`` more in one process (the median is the sample)."""
    once = (
        "    out = {}\n"
        f"    for url in {urls!r}:\n"
        "        with urllib.request.urlopen(url) as r:\n"
        "            out.update(safetensors.torch.load(r.read()))\n"
        "    return out\n"
    )
    code = "import urllib.request, safetensors.torch, statistics\ndef once():\n" + once
    if not repeat:
        return code + "t0 = time.perf_counter()\nout = once()\n"
    return code + (
        "once()\ntimes = []\n"
        f"for _ in range({repeat}):\n"
        "    out = None\n"
        "    t = time.perf_counter()\n"
        "    out = once()\n"
        "    times.append(time.perf_counter() - t)\n"
        "t0 = time.perf_counter() - statistics.median(times)\n"
    )


def _engine_load_into(url: str, options: str = "") -> str:
    return (
        "import engine, engine.urls.remote\n"
        f"info = engine.urls.remote.read_metadata({url!r})\n"
        "out = {}\n"
        "for h in info.headers.values():\n"
        "    for name in h.keys():\n"
        "        t = h[name]\n"
        "        out[name] = torch.ones(t.shape, dtype={'BF16': torch.bfloat16, 'F16': torch.float16, "
        "'F32': torch.float32}[t.dtype])\n"
        "common.reset_hwm()\n"
        "t0 = time.perf_counter()\n"
        f"engine.load_into({url!r}, out{options})\n"
    )


def _engine_device(url: str, dma: str = "none", repeat: int = 0) -> str:
    """A remote load into an emulated device (``host.BenchDevice``) through the chunk ring;
    with ``repeat``, a warm-up load and ``repeat`` more in the process, the ring kept between
    them (the median is the sample: the steady state, without the set-up of a first load)."""
    return (
        "import numpy as np\n"
        "from benchmarks import host\n"
        "from engine.loading import pipeline\nfrom engine.urls import remote_load\n"
        "from engine.loading.loader import _sources, key_bases as _bases\n"
        f"opened = remote_load.open_parts({url!r})\n"
        "parts = [p._replace(rows=list(p.header.table.file_order())) for p in opened.parts]\n"
        "bases = _bases(parts)\n"
        "total = sum(p.header.data_size for p in parts)\n"
        "block = host.prefaulted(total)\n"
        "targets, pos, out = {}, 0, {}\n"
        "for p, b in zip(parts, bases):\n"
        "    t = p.header.table\n"
        "    for r in p.rows:\n"
        "        n = int(t.ends[r]) - int(t.begins[r])\n"
        "        if n:\n"
        "            targets[b + r] = block[pos:pos + n]\n"
        "            out[t.names[r]] = torch.from_numpy(block[pos:pos + n])\n"
        "        pos += n\n"
        f"dev = host.BenchDevice({dma!r})\n"
        "def once():\n"
        "    pipeline.run_sources(_sources(parts, bases, remote_load.DEVICE_CHUNK_BYTES),\n"
        "        pipeline.Destination(device_targets=targets, device_ops=dev), threads=opened.reads.connections,\n"
        "        gpu_path='copy')\n"
        + ("common.reset_hwm()\nt0 = time.perf_counter()\nonce()\n" if not repeat else (
            "import statistics\n"
            "import engine\nengine.keep_staging(True)\n"
            "once()\n"
            "common.reset_hwm()\n"
            "times = []\n"
            f"for _ in range({repeat}):\n"
            "    t = time.perf_counter()\n"
            "    once()\n"
            "    times.append(time.perf_counter() - t)\n"
            "t0 = time.perf_counter() - statistics.median(times)\n"))
        + "dev.close(); opened.close()\n"
    )


def _fault_limit(nbytes: int) -> str:
    """The other half of an owned load: fresh memory for the tensors (the engine's own
    block, huge pages where granted), its pages faulted in 16 MiB at a time on every core,
    no network."""
    return (
        "from engine.sinks._host import host_block\n"
        "from engine.io.reader import populate_write, map_threads\n"
        "t0 = time.perf_counter()\n"
        f"block = host_block({nbytes})\n"
        "view = memoryview(block)\n"
        f"map_threads(lambda i: populate_write(view[i:i + (16 << 20)]), range(0, {nbytes}, 16 << 20), "
        "os.cpu_count() or 2)\n"
        "del view\n"
        "out = {}\n"
    )


def _download_then_reference(urls: list[str], scratch: str) -> str:
    return (
        "import shutil, urllib.request, safetensors.torch\n"
        f"scratch = {scratch!r}\n"
        "t0 = time.perf_counter()\n"
        "out = {}\n"
        f"for i, url in enumerate({urls!r}):\n"
        "    local = os.path.join(scratch, f'shard{i}.safetensors')\n"
        "    with urllib.request.urlopen(url) as r, open(local, 'wb') as f:\n"
        "        shutil.copyfileobj(r, f, 16 << 20)\n"
        "    out.update(safetensors.torch.load_file(local))\n"
        "common.touch_all(out)\n"
    )


def _s3fs_reference(keys: list[str], endpoint: str) -> str:
    return (
        "import s3fs, safetensors.torch\n"
        f"fs = s3fs.S3FileSystem(anon=True, client_kwargs={{'endpoint_url': {endpoint!r}}})\n"
        "t0 = time.perf_counter()\n"
        "out = {}\n"
        f"for key in {keys!r}:\n"
        "    out.update(safetensors.torch.load(fs.cat_file(key)))\n"
    )


def _runai(s3_urls: list[str]) -> str:
    return (
        "from runai_model_streamer import SafetensorsStreamer\n"
        "t0 = time.perf_counter()\n"
        "out = {}\n"
        "with SafetensorsStreamer() as streamer:\n"
        f"    streamer.stream_files({s3_urls!r})\n"
        "    for name, tensor in streamer.get_tensors():\n"
        "        out[name] = tensor.clone()\n"
    )


def _streaming(urls: list[str]) -> str:
    return (
        "import safetensors_streaming as ss\n"
        "t0 = time.perf_counter()\n"
        "out = {}\n"
        f"for url in {urls!r}:\n"
        "    out.update(ss.load_file(url) if hasattr(ss, 'load_file') else ss.load(url))\n"
    )


def _curl(urls: list[str]) -> float:
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["curl", "-s", "-f", "-o", "/dev/null", u]) for u in urls]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"curl failed: {codes}")
    return time.perf_counter() - t0


def _sample(python: str, code: str, env: dict) -> dict:
    out = subprocess.run([python, "-c", _PRELUDE + code + _REPORT], capture_output=True, text=True, env=env,
                         timeout=600)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _has(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GB")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--peers-python", default=None, help="python of an environment with the peer loaders")
    ap.add_argument("--rows", default=None, help="comma-separated row names to run (default all)")
    ap.add_argument("--sweep", action="store_true", help="engine http only: connections x request size")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if nginx_binary() is None:
        print("nginx is not installed (apt-get install nginx-light)", file=sys.stderr)
        return 2
    common.ensure_engine_importable()
    common.compile_engine()
    path = common.checkpoint_file(common.parse_size(args.size))
    directory = common.sharded_copy(path, args.shards)
    shards = common.checkpoint_files(directory)
    nbytes = _tensor_bytes(shards)
    www = tempfile.mkdtemp(prefix="engine-www-")
    atexit.register(shutil.rmtree, www, True)
    os.symlink(directory, os.path.join(www, "ckpt"))
    os.makedirs(os.path.join(www, "bucket"))
    os.symlink(directory, os.path.join(www, "bucket", "ckpt"))
    scratch = tempfile.mkdtemp(prefix="engine-download-", dir=common.cache_dir())
    atexit.register(shutil.rmtree, scratch, True)  # the downloaded shards: as large as the checkpoint
    for f in shards:
        os.chmod(f, 0o644)
    common.warm_cache(directory)
    expected = _local_checksum(directory)
    py = sys.executable
    peers = args.peers_python
    results: dict[str, list[dict]] = {}
    with Nginx(www) as ng:
        index = ng.url("ckpt/model.safetensors.index.json")
        shard_urls = [ng.url("ckpt/" + os.path.basename(f)) for f in shards]
        s3_index = "s3://bucket/ckpt/model.safetensors.index.json"
        s3_env = {**os.environ, "AWS_ENDPOINT_URL": ng.base, "AWS_NO_SIGN_REQUEST": "1",
                  "AWS_ACCESS_KEY_ID": "anonymous", "AWS_SECRET_ACCESS_KEY": "anonymous",
                  "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1",
                  "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
        env = dict(os.environ)
        rows: dict[str, tuple] = {}
        cache = os.path.join(scratch, "cache")
        if args.sweep:
            for scheme, url, e in (("http", index, env), ("s3", s3_index, s3_env)):
                for conns in (4, 8, 16):
                    for chunk in (16, 64):
                        opts = f", connections={conns}, chunk_bytes={chunk} << 20"
                        rows[f"{scheme} c={conns} {chunk}MiB"] = (py, _engine_load(url, opts), e)
                        rows[f"{scheme} c={conns} {chunk}MiB repeated"] = (py, _engine_repeated(url, opts), e)
            rows = {"line rate": ("curl",), **rows}
        else:
            rows = {
                "line rate": ("curl",),
                "fault limit (no network)": (py, _fault_limit(nbytes), env),
                "engine http": (py, _engine_load(index), env),
                "engine http repeated": (py, _engine_repeated(index), env),
                "engine http huge pages": (py, _engine_load(index), {**env, "ENGINE_HUGE_PAGES": "1"}),
                "engine http 4k pages": (py, _engine_load(index), {**env, "ENGINE_HUGE_PAGES": "0"}),
                "engine http repeated huge pages": (py, _engine_repeated(index), {**env, "ENGINE_HUGE_PAGES": "1"}),
                "engine http repeated 4k pages": (py, _engine_repeated(index), {**env, "ENGINE_HUGE_PAGES": "0"}),
                "engine http fault-ahead 1": (py, _engine_load(index), {**env, "ENGINE_FAULT_AHEAD": "1"}),
                "engine http fault-ahead 0": (py, _engine_load(index), {**env, "ENGINE_FAULT_AHEAD": "0"}),
                "engine http load_into": (py, _engine_load_into(index), env),
                "engine s3": (py, _engine_load(s3_index), s3_env),
                "engine s3 repeated": (py, _engine_repeated(s3_index), s3_env),
                "engine s3 load_into": (py, _engine_load_into(s3_index), s3_env),
                "engine http cache_dir 1st": (py, _engine_cached(index, cache, True), env),
                "engine http cache_dir 2nd": (py, _engine_cached(index, cache, False), env),
                "disk write+fsync": (py, _disk_write(nbytes, scratch), env),
                "local owned load": (py, _engine_load(directory, ", backend='pread'"), env),
                "engine http device": (py, _engine_device(index), env),
                "engine s3 device": (py, _engine_device(s3_index), s3_env),
                "engine http device memcpy": (py, _engine_device(index, "memcpy"), env),
                "engine http device repeated": (py, _engine_device(index, repeat=3), env),
                "GETs + reference": (py, _gets_reference(shard_urls), env),
                "GETs + reference repeated": (py, _gets_reference(shard_urls, repeat=3), env),
                "download + reference": (py, _download_then_reference(shard_urls, scratch), env),
            }
            if peers and _has(peers, "s3fs"):
                rows["s3fs + reference"] = (peers, _s3fs_reference(
                    ["bucket/ckpt/" + os.path.basename(f) for f in shards], ng.base), s3_env)
            if peers and _has(peers, "runai_model_streamer"):
                rows["run:ai s3"] = (peers, _runai(["s3://bucket/ckpt/" + os.path.basename(f) for f in shards]),
                                     s3_env)
            if peers and _has(peers, "safetensors_streaming"):
                rows["safetensors-streaming"] = (peers, _streaming(shard_urls), env)
        if args.rows:
            wanted = {r.strip() for r in args.rows.split(",")}
            rows = {k: v for k, v in rows.items() if k in wanted or k == "line rate"}
        for row in rows.values():  # one untimed warm-up of each
            if row[0] == "curl":
                _curl(shard_urls)
            else:
                _sample(*row)
        for _ in range(args.runs):
            for name, row in rows.items():
                if row[0] == "curl":
                    res = {"seconds": _curl(shard_urls), "checksum": expected}
                else:
                    res = _sample(*row)
                results.setdefault(name, []).append(res)
    _report(results, nbytes, expected, args)
    return 0


def _tensor_bytes(files: list[str]) -> int:
    import engine

    return sum(engine.read_header(f).data_size for f in files)


def _local_checksum(directory: str) -> int:
    code = (f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'asv_benchmarks')!r})\n"
            "from benchmarks import common\nimport engine.torch\n"
            f"print(common.touch_all(engine.torch.load_file({directory!r})))\n")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def _report(results: dict, nbytes: int, expected: int, args) -> None:
    def med(name: str) -> float | None:
        ok = [r["seconds"] for r in results.get(name, []) if "seconds" in r]
        return statistics.median(ok) if ok else None

    line = med("line rate")
    engine = med("engine http")
    fault = med("fault limit (no network)")
    print(f"{nbytes / 1e9:.2f} GB of tensor bytes in {args.shards} shards, nginx on 127.0.0.1, "
          f"{args.runs} samples per row, medians; date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'row':34} {'GB/s':>6} {'x line':>7} {'x engine':>8} {'peak RSS GB':>11}  bytes")
    table = {}
    for name, samples in results.items():
        errors = [r["error"] for r in samples if "error" in r]
        s = med(name)
        if s is None:
            print(f"{name:34} failed: {errors[0] if errors else '?'}")
            table[name] = {"error": errors[0] if errors else "?"}
            continue
        rate = nbytes / s / 1e9
        hwm = [r["hwm"] for r in samples if "hwm" in r]
        equal = all(r.get("checksum") == expected for r in samples if "seconds" in r)
        xl = f"{line / s:.2f}" if line else "-"
        xe = f"{engine / s:.2f}" if engine else "-"
        peak = f"{statistics.median(hwm) / 1e9:.2f}" if hwm else "-"
        # the emulated device's copies move no bytes (dma=none): nothing to compare there
        same = "-" if name.startswith(("fault", "line", "disk")) or name.endswith(
            ("device", "device repeated")) else (
            "equal" if equal else "DIFFER")
        print(f"{name:34} {rate:6.2f} {xl:>7} {xe:>8} {peak:>11}  {same}")
        table[name] = {"seconds": s, "gbps": rate, "x_line": line / s if line else None,
                       "peak_rss": statistics.median(hwm) if hwm else None, "equal": equal,
                       "errors": errors}
    if line and fault:
        bound = nbytes / (line + fault) / 1e9
        print(f"owned-load bound on this machine (line rate and page faults one after the other): {bound:.2f} GB/s")
    fault_bound = nbytes / (line + fault) / 1e9 if line and fault else None
    for name in ("engine http", "engine http repeated", "engine s3", "engine s3 repeated"):
        s = med(name)
        ref = med("GETs + reference repeated" if name.endswith("repeated") else "GETs + reference")
        if s and line and ref:
            bound = f", {nbytes / s / 1e9 / fault_bound:.2f}x the owned-load bound" if fault_bound else ""
            print(f"{name}: {line / s:.2f}x the line rate, {ref / s:.2f}x GETs + reference{bound}")
    for suffix in ("", " repeated"):
        ring = med(f"engine http device{suffix}")
        if ring and line:
            print(f"engine http device{suffix} (chunk ring): {line / ring:.2f}x the line rate")
    disk, first, second = med("disk write+fsync"), med("engine http cache_dir 1st"), med("engine http cache_dir 2nd")
    if engine and disk and first:
        allowance = (engine + disk) / 0.9
        print(f"cache_dir 1st: {first:.2f} s against an allowance of {allowance:.2f} s "
              f"((engine http {engine:.2f} s + disk write+fsync {disk:.2f} s) / 0.9): "
              f"{'within' if first <= allowance else 'OVER'}")
    local = med("local owned load")
    if second:
        against = f", {local / second:.2f}x the local owned load" if local else ""
        print(f"cache_dir 2nd: {nbytes / second / 1e9:.2f} GB/s from the local files{against}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "rows": table}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
