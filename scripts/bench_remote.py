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
  faulted in, 16 MiB at a time on two threads: what an owned load pays on top of the
  network on this machine, where the receive copies and the page faults share two cores
  (the bound printed below the table is ``1 / (1 / line + 1 / fault)``);
* ``engine http`` / ``engine s3``: ``engine.torch.load_file(url)`` of the index (CPU owned
  tensors); ``engine http load_into`` / ``engine s3 load_into``: ``engine.load_into`` into
  pre-faulted tensors (a model's parameters, allocated before the load);
  ``engine http device``: the same load into an emulated device: the copy path through
  page-locked staging slots, into a device whose copies complete without moving bytes
  (the host side of a GPU load: socket -> pinned slot; a GPU's DMA engine does the rest);
  its clock starts after the headers are read, the other engine rows' before;
* ``download + reference``: what users do today: each shard fetched whole to a local file, one
  after the other over one connection,
  then ``safetensors.torch.load_file`` of each and a read of every tensor;
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
    python scripts/bench_remote.py --sweep               # connections x request size, engine http only
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


def _engine_load(url: str) -> str:
    return f"import engine.torch\nt0 = time.perf_counter()\nout = engine.torch.load_file({url!r})\n"


def _engine_load_into(url: str, options: str = "") -> str:
    return (
        "import engine, engine.remote\n"
        f"info = engine.remote.read_metadata({url!r})\n"
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


def _engine_device(url: str) -> str:
    return (
        "import numpy as np\n"
        "from benchmarks import host\n"
        "from engine import pipeline, remote_load\n"
        "from engine.loader import _bases, _sources\n"
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
        "dev = host.BenchDevice('none')\n"
        "common.reset_hwm()\n"
        "t0 = time.perf_counter()\n"
        "pipeline.run_sources(_sources(parts, bases, remote_load.DEVICE_CHUNK_BYTES),\n"
        "    pipeline.Destination(device_targets=targets, device_ops=dev), threads=opened.reads.connections,\n"
        "    gpu_path='copy')\n"
        "dev.close(); opened.close()\n"
    )


def _fault_limit(nbytes: int) -> str:
    """The other half of an owned load: fresh memory for the tensors, its pages faulted in
    (16 MiB at a time on two threads, as the engine's receivers do), no network."""
    return (
        "from engine.sinks._host import host_block\n"
        "from engine.reader import populate_write, map_threads\n"
        "t0 = time.perf_counter()\n"
        f"block = host_block({nbytes})\n"
        "view = memoryview(block)\n"
        f"map_threads(lambda i: populate_write(view[i:i + (16 << 20)]), range(0, {nbytes}, 16 << 20), 2)\n"
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
        if args.sweep:
            for conns in (4, 8, 16):
                for chunk in (8, 16, 32, 64):
                    code = _engine_load_into(index, f", connections={conns}, chunk_bytes={chunk} << 20")
                    rows[f"load_into c={conns} {chunk}MiB"] = (py, code, env)
            rows = {"line rate": ("curl",), **rows}
        else:
            rows = {
                "line rate": ("curl",),
                "fault limit (no network)": (py, _fault_limit(nbytes), env),
                "engine http": (py, _engine_load(index), env),
                "engine http load_into": (py, _engine_load_into(index), env),
                "engine s3": (py, _engine_load(s3_index), s3_env),
                "engine s3 load_into": (py, _engine_load_into(s3_index), s3_env),
                "engine http device": (py, _engine_device(index), env),
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
        same = "-" if name.startswith(("fault", "line")) or name.endswith("device") else (
            "equal" if equal else "DIFFER")
        print(f"{name:34} {rate:6.2f} {xl:>7} {xe:>8} {peak:>11}  {same}")
        table[name] = {"seconds": s, "gbps": rate, "x_line": line / s if line else None,
                       "peak_rss": statistics.median(hwm) if hwm else None, "equal": equal,
                       "errors": errors}
    fault = med("fault limit (no network)")
    if line and fault:
        bound = nbytes / (line + fault) / 1e9
        print(f"owned-load bound on this machine (line rate and page faults one after the other): {bound:.2f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "rows": table}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
