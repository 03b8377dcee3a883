"""What the benchmark scripts share: fresh-process samples, rounds, data, servers, the table and the JSON.

A script imports it first (it puts this checkout, asv_benchmarks/ and tests/ first on ``sys.path``)
and holds only what it measures: :func:`call` runs a sample in a fresh interpreter, :func:`rounds`
interleaves the rows, :class:`Report` prints the table and writes ``--json`` in one shape:
``{"script", "argv", "commit", "date", "machine": {"cores", "memory_gib", "cpu"}, "rows": [{"case",
"impl", "median_s", "gbps", "bytes", "runs", "samples", ...}]}``; ``impl`` is ``engine`` (``engine,
<variant>``), ``reference``, a peer's name, or ``limit: <what>`` for a machine limit measured in the
same run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator

import checkout_path

ROOT = checkout_path.use_checkout()
for _p in (os.path.join(ROOT, "asv_benchmarks"), os.path.join(ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(1, _p)
RESULT = "RESULT "
median = statistics.median


def parse_size(text: str | int) -> int:
    """Bytes of ``2GB``, ``1.5GB``, ``256MiB``, ``4G`` (decimal) or a plain number of bytes."""
    t = str(text).strip()
    if t.isdigit():
        return int(t)
    from engine.checkpoints.shards import parse_size as engine_size

    return engine_size(t + "B" if t[-1:].upper() in "KMGT" else t)


#: the flags scripts share: (type, help)
FLAGS: dict[str, tuple[Callable[[str], object], str]] = {
    "runs": (int, "samples per row"), "reps": (int, "timed calls per sample"),
    "size": (parse_size, "bytes: 2GB, 1.5GB, 256MiB, or a number"), "dir": (str, "where the data files go")}


def parser(doc: str | None, **flags) -> argparse.ArgumentParser:
    """An argument parser with the script's docstring as its help, ``--json PATH``, and the
    :data:`FLAGS` named in ``flags`` with their defaults (``--size`` parsed by :func:`parse_size`)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", default=None, help="write the rows here (the common shape)")
    for name, default in flags.items():
        ap.add_argument("--" + name, type=FLAGS[name][0], default=default, help=FLAGS[name][1])
    return ap


def cannot(reason: str) -> None:
    """Stop: the script cannot run on this machine (exit status 2, the reason on stderr)."""
    print(f"cannot run here: {reason}", file=sys.stderr)
    raise SystemExit(2)


def missing(module: str, python: str | None = None) -> str | None:
    """Why ``python`` (default this one) cannot import ``module``, or None if it can."""
    if python in (None, sys.executable):
        found = importlib.util.find_spec(module) is not None
    else:
        try:
            found = subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0
        except OSError:
            return f"{python} cannot run"
    return None if found else f"{module} is not installed" + (f" in {python}" if python else "")


# -- fresh processes ------------------------------------------------------------------------------


def _command(fn: Callable, args: tuple, python: str | None) -> list[str]:
    path = os.path.abspath(sys.modules[fn.__module__].__file__ or "")
    name = os.path.basename(path)[:-3]
    code = (f"import sys, json; sys.path.insert(0, {os.path.dirname(path)!r}); import harness, {name}; "
            f"harness._child({name}.{fn.__name__}, json.loads(sys.argv[1]))")
    return [python or sys.executable, "-c", code, json.dumps(args)]


def _child(fn: Callable, args: list) -> None:
    sys.stdout.write(RESULT + json.dumps(fn(*args)) + "\n")
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: nothing to time there, and gloo's threads may abort it


class _Proc:
    """A child with its output in files (the pipes of several children at once could fill and stall)."""

    def __init__(self, cmd: list[str], env: dict | None, what: str) -> None:
        self.out, self.err, self.what = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"), what
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=self.err, text=True, env=env, cwd=ROOT)

    def result(self, timeout: float, check: bool):
        try:
            rc: int | str = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = f"killed after {timeout:g} s ({self.proc.wait()})"
        text = []
        for f in (self.out, self.err):
            f.seek(0)
            text.append(f.read())
            f.close()
        found = [ln for ln in text[0].splitlines() if ln.startswith(RESULT)]
        if found:
            return json.loads(found[-1][len(RESULT):])
        lines = (text[1] or text[0]).strip().splitlines()
        if check:
            raise RuntimeError(f"{self.what}: exit {rc}:\n" + "\n".join(lines[-25:]))
        return {"error": lines[-1][:300] if lines else f"exit {rc}"}


def call(fn: Callable, *args, env: dict | None = None, python: str | None = None, timeout: float = 600,
         check: bool = True):
    """``fn(*args)`` in a fresh interpreter (``fn``'s script imported there as a module, its ``main``
    not run): what it returned (JSON).  ``check=False``: ``{"error": ...}`` where it failed."""
    return _Proc(_command(fn, args, python), env, f"{fn.__name__}{args}"[:200]).result(timeout, check)


def run_code(code: str, *, env: dict | None = None, python: str | None = None, timeout: float = 600,
             check: bool = True):
    """A snippet in a bare fresh interpreter (nothing imported first, the checkout as the working
    folder) that prints ``RESULT <json>`` itself: that JSON, as :func:`call`."""
    return _Proc([python or sys.executable, "-c", code], env, code[:80]).result(timeout, check)


def ranks(fn: Callable, world: int, *args, env: dict | None = None, timeout: float = 600) -> list:
    """``fn(rank, world, port, *args)`` in ``world`` fresh interpreters started together (``port``: a
    free one for their process group): what each returned, by rank."""
    from servers import free_port

    port = free_port()
    procs = [_Proc(_command(fn, (r, world, port, *args), None), env, f"rank {r} of {world}") for r in range(world)]
    return [p.result(timeout, True) for p in procs]


def child_env(**extra: str | None) -> dict:
    """This environment with ``extra`` set (None: removed) and the checkout on ``PYTHONPATH``."""
    env = {**os.environ, "PYTHONPATH": checkout_path.pythonpath()}
    for k, v in extra.items():
        env.pop(k, None) if v is None else env.__setitem__(k, v)
    return env


# -- timing ----------------------------------------------------------------------------------------


def times(fn: Callable, reps: int, warmup: int = 1, before: Callable | None = None) -> list[float]:
    """Seconds of ``reps`` calls of ``fn`` after ``warmup`` untimed ones; ``before()``, untimed,
    before each timed call."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def rounds(rows: Iterable, runs: int, sample: Callable, *, warmup: bool = False, rotate: bool = False) -> dict:
    """``{row: [sample(row), ...]}``: ``runs`` rounds of every row, interleaved (drift on a shared
    machine hits every row alike); ``warmup``: an untimed round first; ``rotate``: each round starts
    one row later."""
    rows = list(rows)
    out: dict = {r: [] for r in rows}
    for r in rows if warmup else []:
        sample(r)
    began = time.time()
    for i in range(runs):
        k = i % len(rows) if rotate else 0
        for r in rows[k:] + rows[:k]:
            out[r].append(sample(r))
        print(f"round {i + 1}/{runs} done ({time.time() - began:.0f} s)", file=sys.stderr, flush=True)
    return out


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


# -- data and servers ------------------------------------------------------------------------------------


def checkpoint(nbytes: int, folder: str | None = None, *, values: str = "bytes", entries: list | None = None,
               shards: int = 1, checksums: bool = False) -> str:
    """A checkpoint in ``folder`` (default ``common.cache_dir()``), made once: ``entries``
    (``[(name, dtype, shape)]``), or Llama-shaped BF16 of about ``nbytes`` tensor bytes.  ``values``:
    ``"bytes"`` (random, NaNs included: I/O does not care), ``"finite"`` (random finite bit patterns)
    or ``"weights"`` (normal, std 0.02).  ``shards > 1`` or ``checksums``: shard files and an index."""
    import hashlib

    from benchmarks import common

    folder = common.cache_dir(folder)
    if entries is None and values == "bytes":
        path = common.checkpoint_file(nbytes, base=folder)
    else:
        entries = entries or common.checkpoint_entries(nbytes)
        digest = hashlib.sha1(repr(entries).encode()).hexdigest()[:10]
        path = os.path.join(folder, f"v{common.GEN_VERSION}-{digest}-{values}.safetensors")
        if not os.path.exists(path):
            if values == "bytes":
                common.write_file(path, entries, metadata={"format": "pt"})
            else:
                _write_values(path, entries, values)
    if shards == 1 and not checksums:
        return path
    if not checksums:
        return common.sharded_copy(path, shards)
    directory = path[: -len(".safetensors")] + f"-{shards}shards-crc"
    if not os.path.exists(os.path.join(directory, "model.safetensors.index.json")):
        import engine.numpy
        from engine.checkpoints.shards import save_sharded

        arrays = engine.numpy.load_file(path)
        save_sharded(arrays, directory, max_shard_size=-(-sum(a.nbytes for a in arrays.values()) // shards),
                     checksums=True, fsync=False)
    return directory


def _write_values(path: str, entries: list, values: str) -> None:
    import ml_dtypes
    import numpy as np

    import engine.numpy

    kind = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}
    rng = np.random.default_rng(0)
    arrays = {}
    for name, dtype, shape in entries:
        bits = 8 * np.dtype(kind[dtype]).itemsize
        if values == "finite":  # below the top two bits: the exponent never reaches inf/NaN
            arrays[name] = rng.integers(0, 1 << (bits - 2), shape, dtype=f"int{bits}").view(kind[dtype])
        else:
            arrays[name] = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(kind[dtype])
    engine.numpy.save_file(arrays, path + ".partial", metadata={"format": "pt"})
    os.replace(path + ".partial", path)


def destination(headers) -> dict:
    """Torch tensors shaped and typed as every tensor of ``headers`` (a file's path, or headers), every
    page written once: the memory a model's parameters already own when a load fills them."""
    import torch

    import engine

    dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    headers = [engine.read_header(headers)] if isinstance(headers, str) else headers
    return {k: torch.empty(h[k].shape, dtype=dt[h[k].dtype]).fill_(1) for h in headers for k in h.keys()}


@contextlib.contextmanager
def served(directory: str) -> Iterator[tuple]:
    """nginx (tests/servers.py) on 127.0.0.1 serving the checkpoint ``directory`` from a warm page
    cache over HTTP (``nginx.url("ckpt/" + shard)``) and as S3 (``s3://bucket/ckpt/`` + shard):
    ``(nginx, http index URL, s3 index URL, the environment an S3 client needs)``."""
    from benchmarks import common
    from servers import Nginx, nginx_binary

    if nginx_binary() is None:
        cannot("nginx is not installed (apt-get install nginx-light)")
    www = tempfile.mkdtemp(prefix="engine-www-")
    try:
        os.symlink(directory, os.path.join(www, "ckpt"))
        os.makedirs(os.path.join(www, "bucket"))
        os.symlink(directory, os.path.join(www, "bucket", "ckpt"))
        for f in common.checkpoint_files(directory):
            os.chmod(f, 0o644)
        common.warm_cache(directory)
        with Nginx(www) as ng:
            env = {**os.environ, "AWS_ENDPOINT_URL": ng.base, "AWS_NO_SIGN_REQUEST": "1",
                   "AWS_ACCESS_KEY_ID": "anonymous", "AWS_SECRET_ACCESS_KEY": "anonymous",
                   "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1",
                   "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
            yield ng, ng.url("ckpt/model.safetensors.index.json"), "s3://bucket/ckpt/model.safetensors.index.json", env
    finally:
        shutil.rmtree(www, ignore_errors=True)


def curl(urls: list[str]) -> float:
    """Seconds for one ``curl -o /dev/null`` per URL, all at once: a server's line rate."""
    t0 = time.perf_counter()
    codes = [p.wait() for p in [subprocess.Popen(["curl", "-s", "-f", "-o", "/dev/null", u]) for u in urls]]
    if any(codes):
        raise RuntimeError(f"curl failed: {codes}")
    return time.perf_counter() - t0


# -- the report -----------------------------------------------------------------------------------


def machine() -> dict:
    """Cores, memory (GiB) and the CPU's model name of this machine."""
    import platform

    cpu, mem = platform.machine(), None
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/meminfo") as f:
            mem = round(int(f.readline().split()[1]) / 2**20, 1)
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    return {"cores": os.cpu_count(), "memory_gib": mem, "cpu": cpu}


def commit() -> str:
    """The checkout's short commit hash, ``+dirty`` with uncommitted changes to tracked files."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    try:
        return (git("rev-parse", "--short", "HEAD") or "unknown") + (
            "+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except OSError:
        return "unknown"


def _title(key: str) -> str:
    titles = {"median_s": "median", "gbps": "GB/s", "bytes": "MB"}
    return titles.get(key) or (key[:-6] + " MB" if key.endswith("_bytes") else key).replace("_", " ")


def _cell(key: str, v) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return " ".join(_cell(key, x) for x in v)
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if key.endswith("_s"):
        return fmt_time(v)
    if key.startswith("x_"):
        return f"{v:.2f}x"
    if key == "bytes" or key.endswith("_bytes"):
        return f"{v / 1e6:.1f}"
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) >= 0.01 else f"{v:.3g}"
    return str(v)


class Report:
    """The rows of one run: a Markdown table on stdout, the common JSON shape with ``--json``."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.notes: list[str] = []

    def add(self, case: str, impl: str, seconds, nbytes: int | None = None, **extra) -> dict:
        """A row: ``seconds`` one figure or the samples (the row's is their median); GB/s where
        ``nbytes`` is given; ``extra`` keys go into the row as they are."""
        xs = [seconds] if isinstance(seconds, (int, float)) else [s for s in (seconds or []) if s is not None]
        med = median(xs) if xs else None
        row = {"case": case, "impl": impl, "median_s": med, "gbps": nbytes / med / 1e9 if nbytes and med else None,
               "bytes": nbytes, "runs": len(xs), "samples": xs, **extra}
        self.rows.append(row)
        return row

    def seconds(self, case: str | None = None, impl: str | None = None) -> float | None:
        """The median of the first row of ``case`` and ``impl`` (either may be left out)."""
        return next((r["median_s"] for r in self.rows if case in (None, r["case"]) and impl in (None, r["impl"])), None)

    def ratio(self, key: str, base: Callable[[dict], float | None] | float | None) -> None:
        """``row[key] = base(row) / row's median`` for every row (above 1: faster than the base);
        ``base`` a number: the same for every row."""
        for r in self.rows:
            b = base(r) if callable(base) else base
            r[key] = b / r["median_s"] if b and r["median_s"] else None

    def against(self, key: str, impl: str) -> None:
        """:meth:`ratio` against the row of the same case whose impl is ``impl``."""
        self.ratio(key, lambda r: None if r["impl"] == impl else self.seconds(r["case"], impl))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def save(self, path: str, **meta) -> None:
        """The common JSON shape (the module docstring); ``meta``: more top-level keys."""
        doc = {"script": os.path.basename(sys.argv[0]), "argv": sys.argv[1:], "commit": commit(),
               "date": datetime.date.today().isoformat(), "machine": machine(), "rows": self.rows, **meta}
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {path}", file=sys.stderr)

    def finish(self, path: str | None, *cols: str, **meta) -> int:
        """Print the machine, the table of ``cols`` and the notes; write ``path`` if given; 0."""
        m = machine()
        print(f"# {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; commit {commit()}; "
              f"{datetime.datetime.now():%Y-%m-%d %H:%M}")
        print("| " + " | ".join(_title(c) for c in cols) + " |\n|" + "---|" * len(cols))
        for r in self.rows:
            print("| " + " | ".join(_cell(c, r.get(c)) for c in cols) + " |")
        print("\n".join(self.notes))
        if path:
            self.save(path, **meta)
        return 0
