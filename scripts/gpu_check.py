"""Everything that decides the engine's device path, in one GPU command of at most 7 minutes.

``python3 scripts/gpu_check.py --wheels .whl --out OUT`` runs, within ``--budget`` seconds
(420 by default) of its own start, everything included, these rows in this order (the
most decisive first):

1. set-up: the peers' wheels of ``--wheels DIR`` installed with ``pip install --no-index
   --no-deps --target`` into a scratch folder put on the children's PYTHONPATH; the
   extensions built in place (``setup.py build_ext --inplace -j CORES``); the engine that a
   child imports, and its ring extension, must be this checkout's (the script puts its
   checkout first on ``sys.path`` and on the children's PYTHONPATH: nothing needs to be
   installed); the child also names the device and torch;
2. the checkpoint: Llama-3-8B-shaped, ``--size`` (8 GB in 4 shards by default, made once and
   reused from ``--dir``; 16.06 GB with ``--long``), its pages read once (a warm page cache);
3. the load rows of scripts/bench_gpu.py, each sample a fresh process: the limits (pinned
   host-to-device, page cache to pinned with 16 threads: one process each, the median of
   their repetitions inside it), InstantTensor ``Backend.MMAP``, every engine entry point
   (3 samples each), fastsafetensors;
4. the per-key loop of accelerate's ``load_state_dict`` (``safe_open(f, device=...)``,
   ``get_tensor(k)`` for every key), engine and reference;
5. warm start: the second load in the same process (each ``load_into(directory)`` sample
   loads twice; its first load is that row's figure, a process's first load), and a first
   load after ``engine.prepare_device`` (its seconds in the row);
6. the short sweep of the chunk ring (scripts/ring_sweep.py ``--short``, one process): the
   default geometry with ``ENGINE_COPY_SOURCE`` pread / mmap / auto under
   ``ENGINE_RING_UNMAP`` end / chunk, then three other shapes, each loaded twice (the first
   load sets the ring up, the second reuses it), the fastest's bytes checked;
7. the rest: byte-for-byte comparison with the reference for every dtype through every entry
   point (and over HTTP), ``pytest -m cuda``, the reference's ``load_file``, the loads with
   device kernels through the chunk ring (``stream(f)`` with ``stats=True``, ``quantize="int8"``
   and both, each beside the plain ``stream(f)`` of the same run, its ratio to it, its ring
   records with the tensors reported and the seconds their kernels' launches took, and a few
   tensors' results checked against the CPU kernels'), the validator's statistics (CPU: it has
   no device path), the device-kernel test modules on the real GPU (Numba's simulator off);
   with ``--device cpu``, the device pipeline over every shard on the emulated CUDA runtime
   (tests/emucudart) and on tests/emulated.py's device.

The budget is enforced here: no row (no sample, no test run) starts that the rest of the
budget cannot hold.  A row's cost is estimated from what it took so far (its own samples),
else from a conservative prior (:data:`PRIORS`; a load sample's prior is scaled by how the
samples so far compared with theirs), and every child is stopped at the budget's end
whatever its estimate.  The JSON and markdown files are rewritten after every row, so that
a run stopped from outside still leaves its table; a row that did not run says why
("budget: needs ~40 s, 12 s left"), and the rows the run never reached are listed as such.

Every load row reports its rate (the median of its samples), the host memory peak and, by
kind, the growth of anonymous, page-locked (the engine's count) and mapped file memory
during the load (scripts/host_memory.py) and the mapped file memory left after it, the
device memory peak, and what the chunk ring did (``engine.load_records()``: chunks, waits
for fills and for slots, page-locking time, bytes per source, the ring's shape, whether
this load set the ring up; the median over the samples); on a GPU a row whose anonymous +
page-locked growth passes :data:`HOST_BOUND` is marked over bound.

Writes ``gpu_check-<mode>.json`` and ``gpu_check-<mode>.md`` to ``--out`` and prints a
one-screen summary.  Exit status 0 when no row failed, 1 otherwise (a row skipped for the
budget is not a failure).

On a lent GPU host (the device tool runs in the checkout; ``.whl/`` is git-ignored, so it is
carried only when named)::

    mkdir -p .whl && cp ../shared/wheels/*.whl .whl/
    # device tool: carry [".whl"], timeout_s 480, command:
    python3 scripts/gpu_check.py --wheels .whl --out $OUT/gpu-check

Longer runs, each its own command: ``--long`` (16.06 GB, more rows, 9 minutes by default)
and ``--sweep`` (the ring's whole geometry grid, scripts/ring_sweep.py, 210 s by default);
``--budget`` sets any of them.

Dry run, on a machine without a GPU (CI runs it so that the script cannot rot; the
extensions built in place first, or the build row builds them):
``python scripts/gpu_check.py --device cpu --budget 60 --out DIR``.  Device rows load to
``device="cpu"`` there and say so; rows that need CUDA or a missing package say why they
were skipped; the sweep runs on the emulated CUDA runtime.  ``--skip build,pytest`` leaves
phases out (their rows say so).
"""

from __future__ import annotations

import time

#: the check's clock starts with the script
START = time.monotonic()

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
import xml.etree.ElementTree as ET  # noqa: E402
from collections.abc import Callable  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # imported from elsewhere (a test): its sibling modules
    sys.path.insert(0, HERE)
import checkout_path  # noqa: E402

# this checkout's engine in this process and in every child: on a GPU host it is built in
# place by the build row and installed nowhere (the parent imports it only after that row)
ROOT = checkout_path.use_checkout()
import bench_gpu  # noqa: E402
import driver_check  # noqa: E402
import ring_sweep  # noqa: E402

#: seconds of the whole command by default: 7 minutes on a GPU host, whose 15 minutes of
#: lending include its start-up
BUDGET = 420.0
#: ``--long``'s and ``--sweep``'s defaults
LONG_BUDGET = 540.0
SWEEP_BUDGET = 210.0
#: seconds kept at the end for the summary and the last write of the files
RESERVE = 3.0
#: checkpoint sizes by default: 8 GB, so that every row can fit the 7 minutes (a 16 GB one
#: doubles its making and every load; no GPU run of this check has measured the difference yet)
SIZE = {"check": "8GB", "long": "16.06GB", "cpu": "64MB"}
#: the peers and the name their wheel starts with
PEERS = {"instanttensor": "instanttensor", "fastsafetensors": "fastsafetensors",
         "runai_model_streamer": "runai_model_streamer"}
#: the rows that decide the device path, first: the limits, the peer to beat, every engine
#: entry point (``gpu_path`` auto and copy are the same ring, so one of them), the other peer
DECISIVE = [
    "limit: pinned host-to-device 1 GiB",
    "limit: page cache to pinned, split read, 16 threads",
    "InstantTensor Backend.MMAP",
    "engine load_file(f) per shard",
    "engine load_file(directory)",
    "engine safe_open(directory).get_tensors()",
    "engine stream(shards) auto",
    "engine load_into(directory)",
    "fastsafetensors (nogds, buffered)",
]
PER_KEY = ["engine safe_open(f, device) get_tensor per key", "reference safe_open(f, device) get_tensor per key"]
#: the second loads of :data:`FIRST_ROW`'s samples, a row of their own
FIRST_ROW = "engine load_into(directory)"
SECOND_ROW = "engine load_into(directory) second load in the same process"
PREPARED_ROW = "engine load_into(directory) first load after engine.prepare_device"
REFERENCE_ROWS = ["reference load_file(f, device) per shard"]
#: loads with device kernels, beside the plain load of the same entry point in the same run (the
#: lines: stats >= 0.9x, int8 >= 0.8x of it), each checked against the CPU kernels'
#: results; and the validator's statistics (the CPU's: it has no device path)
ONLOAD_PLAIN = "engine stream(f) per shard"
ONLOAD_ROWS = [ONLOAD_PLAIN, "engine stream(f) stats=True per shard", "engine stream(f) quantize=int8 per shard",
               "engine stream(f) stats=True quantize=int8 per shard",
               "engine WeightValidator(config).validate(directory)"]
#: ``--long`` only, after the rest
LONG_ROWS = [
    "engine load_into(directory) reload, staging and mappings kept",
    "engine load_into(f) per shard",
    "engine safe_open(index).get_tensors()",
    "reference load_file(f) then .to(device)",
    "InstantTensor default",
    "limit: pageable host-to-device 1 GiB",
    "limit: page cache to pinned, split read, 8 threads",
]
#: seconds one load sample may take at most (a 16 GB load takes under 20 on an H100 host)
SAMPLE_LIMIT = 120.0
#: samples per load row (a limit: one process, the median of its repetitions inside it)
RUNS = 3
LIMIT_RUNS = 1
#: what a device load may add to the host's anonymous and page-locked memory together, whatever
#: the model's size (the ring's chunks, counted in both, and everything else)
HOST_BOUND = 512 << 20
GPU_PATHS = ("auto", "copy")
PYTEST_RUNS = {
    "pytest -m cuda": ["-m", "cuda", "tests"],
    "pytest device-kernel modules": ["tests/test_device.py", "tests/test_cuda_kernels.py",
                                     "tests/test_cudart.py", "tests/test_load_hooks.py"],
}
#: conservative costs, seconds, before a row has run (GPU: from the H100 run of 2026-11-26,
#: ../shared/gpu-runs, doubled or so; cpu: this project's 2-core CI machine); a load row's
#: is per sample; ``checkpoint`` per GB to make it, ``checkpoint-read`` per GB to read it
PRIORS = {
    "cuda": {"wheels": 15, "build": 75, "build-fresh": 10, "engine": 20, "checkpoint": 5, "checkpoint-read": 2,
             "sample": 10, "limit": 8, "per-key": 12, "onload": 15, "sweep": 45, "compare": 20,
             "pytest -m cuda": 40, "pytest device-kernel modules": 100, "emulated": 15, "driver": 30},
    "cpu": {"wheels": 15, "build": 120, "build-fresh": 10, "engine": 10, "checkpoint": 60, "checkpoint-read": 5,
            "sample": 6, "limit": 6, "per-key": 6, "onload": 25, "sweep": 20, "compare": 12,
            "pytest -m cuda": 90, "pytest device-kernel modules": 90, "emulated": 10, "driver": 15},
}
#: the reference's dtypes (torch attribute names); a torch without one leaves it out
DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64", "U64": "uint64", "U32": "uint32",
    "U16": "uint16",
}


class Budget:
    """The command's seconds: what is left, what a row will cost, whether it may start.

    ``seconds`` from ``start`` (``clock()`` time), :data:`RESERVE` of them kept for the last
    write.  A row's estimate: 1.2 times its slowest run so far plus half a second; before it
    has run, its prior, scaled for load samples by how the samples so far compared with
    their priors (between 0.5 and 2 times, with a quarter added)."""

    def __init__(self, seconds: float, start: float | None = None, clock: Callable[[], float] = time.monotonic,
                 reserve: float = RESERVE) -> None:
        self.seconds = seconds
        self.clock = clock
        self.start = clock() if start is None else start
        self.reserve = reserve
        self.walls: dict[str, list[float]] = {}
        self.ratios: list[float] = []  # a load sample's seconds over its prior

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.seconds - self.reserve - self.elapsed()

    def estimate(self, key: str, prior: float, scaled: bool = False) -> float:
        own = self.walls.get(key)
        if own:
            return 1.2 * max(own) + 0.5
        if scaled and self.ratios:
            return prior * min(2.0, max(0.5, 1.25 * statistics.median(self.ratios)))
        return prior

    def note(self, key: str, seconds: float, prior: float | None = None) -> None:
        """What a run of ``key`` took; with ``prior``, it also scales the load samples' priors."""
        self.walls.setdefault(key, []).append(seconds)
        if prior:
            self.ratios.append(seconds / prior)

    def refuse(self, need: float) -> str | None:
        """Why a row that needs ``need`` seconds may not start (None: it may)."""
        left = self.left()
        if need <= left:
            return None
        return f"budget: needs ~{need:.0f}s, {max(0.0, left):.0f}s left"


class Report:
    """Rows as they come: each printed, and the JSON and markdown files rewritten after it
    (through a temporary file and a rename: a run stopped at any moment leaves whole files)."""

    def __init__(self, base: str | None = None, meta: dict | None = None) -> None:
        self.rows: list[dict] = []
        self.phases: list[dict] = []
        self.base = base
        self.meta: dict = meta or {}
        #: rows planned and not reported yet, in order (named in the files as not reached)
        self.pending: list[str] = []

    def plan(self, names: list[str]) -> None:
        self.pending = [n for n in names if n not in self.pending] + [n for n in self.pending if n not in names]

    def done(self, names: list[str]) -> None:
        """A step has run: the rows it stood for are no longer pending (it reported its own)."""
        self.pending = [n for n in self.pending if n not in names]

    def add(self, phase: str, row: str, status: str, reason: str | None = None, **fields) -> dict:
        record = {"phase": phase, "row": row, "status": status, "reason": reason, **fields}
        self.rows.append(record)
        if row in self.pending:
            self.pending.remove(row)
        figure = f" {fields['gbps']:.2f} GB/s" if fields.get("gbps") is not None else ""
        text = f"  {status:7s} {row}{figure}{': ' + reason if reason else ''}"
        print(text if len(text) <= 150 else text[:147] + "...", flush=True)
        self.write()
        return record

    def write(self) -> None:
        if not self.base:
            return
        meta = {**self.meta, "elapsed_s": round(time.monotonic() - START, 1)}
        body = {"meta": meta, "phases": self.phases, "rows": self.rows, "pending": self.pending}
        for suffix, text in ((".json", json.dumps(body, indent=1, default=str)), (".md", markdown(meta, self))):
            tmp = f"{self.base}{suffix}.tmp"
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
            os.replace(tmp, self.base + suffix)


def _tail(text: str, n: int = 300) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][:n] if lines else "no output"


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str, str]:
    """(exit code or None on timeout, stdout, stderr) of a command run in the checkout.

    On timeout its whole process group is killed: a test's own children would otherwise
    keep the pipes open and the wait would outlast the budget."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = p.communicate()
        return None, out, err
    return p.returncode, out, err


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def built_fresh() -> bool:
    """Whether every extension is built in place and newer than its Cython sources (its own
    ``.pyx`` and ``.pxd``, and the ``.pxd`` files it cimports): the build is then a quick no-op."""
    sources = glob.glob(os.path.join(ROOT, "engine", "**", "*.pyx"), recursive=True)
    if not sources:
        return False
    for pyx in sources:
        stem = pyx[: -len(".pyx")]
        with open(pyx) as f:
            text = f.read()
        cimports = " ".join(line for line in text.splitlines() if "cimport" in line)
        deps = [pyx, *glob.glob(stem + ".pxd")]
        deps += [p for p in glob.glob(os.path.join(ROOT, "engine", "**", "*.pxd"), recursive=True)
                 if os.path.basename(p)[: -len(".pxd")] in cimports]
        # C headers it includes (``cdef extern from "x.h"``), beside it
        deps += [p for p in glob.glob(os.path.join(os.path.dirname(pyx), "*.h")) if os.path.basename(p) in text]
        built = glob.glob(stem + ".*.so")
        if not built or min(os.path.getmtime(p) for p in built) < max(os.path.getmtime(p) for p in deps):
            return False
    return True


# -- the check's state and its rows ----------------------------------------------------------------


class Check:
    """One run: the options, the budget, the report, and what the rows leave for later ones."""

    def __init__(self, args, budget: Budget, rep: Report, scratch: str) -> None:
        self.args = args
        self.budget = budget
        self.rep = rep
        self.scratch = scratch
        self.dev = args.device
        self.cuda = args.device.startswith("cuda")
        self.priors = PRIORS["cuda" if self.cuda else "cpu"]
        self.path: list[str] = []  # the peers' site folder, for the children
        self.files: list[str] | None = None
        self.nbytes = 0
        self.skip = {p.strip() for p in args.skip.split(",") if p.strip()}
        self.samples: dict[str, list[dict]] = {}

    def env(self) -> dict:
        return {**{k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"},
                "PYTHONPATH": checkout_path.pythonpath(*self.path)}

    def step(self, phase: str, row: str, key: str, prior: float, fn: Callable[[float], None]) -> None:
        """Run the row ``fn(seconds it may take)`` if the budget holds its estimate, else name
        it as skipped with the reason; an exception is a failed row."""
        if phase in self.skip:
            self.rep.add(phase, row, "skipped", f"--skip {phase}")
            return
        why = self.budget.refuse(self.budget.estimate(key, prior))
        if why:
            self.rep.add(phase, row, "skipped", why)
            return
        t0 = time.monotonic()
        try:
            fn(self.budget.left())
        except Exception as exc:  # a row that breaks is a failed row; the later rows still run
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self.rep.add(phase, row, "failed",
                         f"{type(exc).__name__}: {exc} ({os.path.basename(where.filename)}:{where.lineno})")
        self.budget.note(key, time.monotonic() - t0)


def row_wheels(check: Check) -> None:
    """Install each peer's wheel into the scratch folder the children get on their path."""
    wheels, site = check.args.wheels, os.path.join(check.scratch, "site")
    if not wheels:
        for peer in PEERS:
            check.rep.add("wheels", f"wheel: {peer}", "skipped", "no --wheels folder given")
        return
    for peer, stem in PEERS.items():
        found = sorted(glob.glob(os.path.join(os.path.abspath(wheels), f"{stem}-*.whl")))
        if not found:
            check.rep.add("wheels", f"wheel: {peer}", "skipped", f"no {stem}-*.whl in {wheels}")
            continue

        def install(left: float, peer=peer, wheel=found[-1]) -> None:
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, wheel]
            rc, out, err = _run(cmd, left)
            if rc == 0:
                check.rep.add("wheels", f"wheel: {peer}", "ok", None, wheel=os.path.basename(wheel))
            else:
                why = "timed out at the budget's end" if rc is None else f"pip exit code {rc}: {_tail(err or out)}"
                check.rep.add("wheels", f"wheel: {peer}", "failed", why)

        check.step("wheels", f"wheel: {peer}", "wheel", check.priors["wheels"] / 3, install)
    if os.path.isdir(site):
        check.path = [site]


def row_build(check: Check) -> None:
    fresh = built_fresh()

    def build(left: float) -> None:
        t0 = time.monotonic()
        # the four extensions compiled at once: a fresh checkout's build in a fraction of the time
        cmd = [sys.executable, "setup.py", "-q", "build_ext", "--inplace", "-j", str(min(8, _cores()))]
        rc, out, err = _run(cmd, left)
        seconds = round(time.monotonic() - t0, 1)
        what = "nothing to rebuild" if fresh else "built"
        if rc == 0:
            check.rep.add("build", "build_ext --inplace", "ok", what, seconds=seconds)
        else:
            check.rep.add("build", "build_ext --inplace", "failed",
                          "timed out at the budget's end" if rc is None else f"exit code {rc}: {_tail(err or out)}")

    check.step("build", "build_ext --inplace", "build", check.priors["build-fresh" if fresh else "build"], build)


def row_engine(check: Check) -> None:
    """Which engine the parent and a child import: this checkout's, extensions included (an
    editable install of another checkout would otherwise lend its extensions to a checkout
    that has none built); the child also names torch and the device."""

    def probe(left: float) -> None:
        t0 = time.monotonic()
        got = child_probe(check.env(), left)
        parent = checkout_path.engine_origin()
        where = {"parent": parent, "child": got.get("engine_file"), "child_ring": got.get("ring_file")}
        check.rep.meta.update({"engine_file": where, "torch": got.get("torch", "unknown"),
                               "cuda_available": got.get("cuda", False),
                               "device_name": got.get("name", "unknown") if check.cuda
                               else f"{check.dev} (no GPU used)"})
        text = f"parent {parent}; child {where['child']}; its ring extension {where['child_ring']}"
        seconds = round(time.monotonic() - t0, 1)
        if all(checkout_path.from_checkout(p or "") for p in where.values()):
            check.rep.add("engine", "engine from this checkout", "ok", text, engine_file=where, seconds=seconds)
        else:
            check.rep.add("engine", "engine from this checkout", "failed", f"not all under {ROOT}/engine: {text}",
                          engine_file=where, seconds=seconds)
        if check.cuda and not got.get("cuda"):
            print(f"no CUDA device visible to torch: the device rows will fail ({check.dev})", flush=True)

    check.step("engine", "engine from this checkout", "engine", check.priors["engine"], probe)


def child_probe(env: dict, timeout: float) -> dict:
    """What a child imports (``engine`` and ``engine.gpu._ring``: their files, or why not) and
    sees (torch's version, CUDA, the device's name)."""
    cmd = [sys.executable, os.path.join(HERE, "bench_gpu.py"), "--where"]
    rc, out, err = _run(cmd, timeout, env)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc == 0 and lines:
        return json.loads(lines[-1])
    why = "timed out" if rc is None else f"exit code {rc}: {_tail(err or out)}"
    return {"engine_file": why, "ring_file": why}


def row_checkpoint(check: Check, size: int) -> None:
    """Make (or reuse) the checkpoint in a child, which also counts its tensor bytes (the
    parent imports nothing of the engine for it), then read its pages once."""
    folder = os.path.join(check.args.dir, f"llama3-shapes-{size}")
    exists = os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    gb = size / 1e9
    prior = 5 + gb * (check.priors["checkpoint-read"] + (0 if exists else check.priors["checkpoint"]))

    def make(left: float) -> None:
        code = ("import sys, json; sys.path.insert(0, sys.argv[1]); import bench_gpu;"
                " files = bench_gpu.make_checkpoint(sys.argv[2], int(sys.argv[3]));"
                " print(json.dumps({'files': files, 'bytes': bench_gpu.tensor_bytes(files)}))")
        t0 = time.monotonic()
        rc, out, err = _run([sys.executable, "-c", code, HERE, folder, str(size)], left, check.env())
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if rc != 0 or not lines:
            check.rep.add("checkpoint", "checkpoint", "failed",
                          "timed out at the budget's end" if rc is None else f"exit code {rc}: {_tail(err)}")
            return
        got = json.loads(lines[-1])
        made = time.monotonic() - t0
        if check.args.modes == "warm":
            bench_gpu.warm(got["files"])
        check.files, check.nbytes = got["files"], got["bytes"]
        check.rep.add("checkpoint", "checkpoint", "ok",
                      f"{len(check.files)} shards, {check.nbytes / 1e9:.2f} GB of tensors in {folder}"
                      f" ({'reused' if exists else 'made'} in {made:.1f} s, then read once)",
                      seconds=round(time.monotonic() - t0, 1), bytes=check.nbytes, made=not exists)

    check.step("checkpoint", "checkpoint", "checkpoint", prior, make)


def row_loads(check: Check, phase: str, impl: str, runs: int, prior_key: str) -> None:
    """One load row: ``runs`` fresh-process samples, each started only if the budget holds it
    (:meth:`Budget.estimate`); a row cut short keeps the samples it has and says why."""
    rep, budget = check.rep, check.budget
    if phase in check.skip:
        rep.add(phase, impl, "skipped", f"--skip {phase}")
        return
    why = bench_gpu.skip_reason(impl, check.dev, check.path)
    if why:
        rep.add(phase, impl, "skipped", why)
        return
    if check.files is None:
        rep.add(phase, impl, "skipped", "no checkpoint (its row did not run or failed)")
        return
    prior = check.priors[prior_key]
    samples: list[dict] = []
    cut = None
    cache = check.args.modes
    for _ in range(runs):
        cut = budget.refuse(budget.estimate(impl, prior, scaled=True))
        if cut:
            break
        if check.args.modes == "cold":
            cache = bench_gpu.drop_cache(check.files)
        t0 = time.monotonic()
        # a hung child is stopped well before it could take every later row's time
        limit = max(1.0, min(SAMPLE_LIMIT, budget.left()))
        s = bench_gpu.sample(impl, check.files, check.dev, limit, check.env())
        budget.note(impl, time.monotonic() - t0, prior)
        if "error" in s and str(s["error"]).startswith("timed out") and limit < SAMPLE_LIMIT:
            # stopped by the budget's end, not by the sample limit: not run, rather than failed
            cut = f"budget: its sample was stopped at the {limit:.0f} s the budget had left"
            break
        samples.append(s)
        if "error" in s:
            break
    check.samples[impl] = samples
    if not samples:
        rep.add(phase, impl, "skipped", cut)
        return
    add_load_row(check, phase, impl, samples, runs, cache, cut)


def add_load_row(check: Check, phase: str, impl: str, samples: list[dict], runs: int, cache: str,
                 cut: str | None, note: str = "") -> None:
    r = bench_gpu.summarise(samples, cache)
    status, reason = r.pop("status"), r.pop("reason")
    if status == "ok":
        where = "" if check.cuda else f"device={check.dev}: a host load (no GPU); "
        reason = f"{where}{note}{len(samples)} of {runs} sample(s)" + (f" ({cut})" if cut else "")
        if impl.startswith("limit:"):
            reason += "; one process, the median of its repetitions inside it"
        if r.get("prepare_s") is not None:
            reason += f"; engine.prepare_device took {r['prepare_s']:.3f} s before the clock"
        # a host load's destination is anonymous memory itself: the bound is a device load's
        if check.cuda and r.get("anon_locked_growth_bytes") is not None:
            r["host_bound_bytes"] = HOST_BOUND
            r["host_bounded"] = r["anon_locked_growth_bytes"] <= HOST_BOUND
            if not r["host_bounded"]:
                reason += (f"; over bound: anonymous + page-locked memory grew"
                           f" {r['anon_locked_growth_bytes'] / 2**20:.0f} MiB")
    if status == "ok" and impl in bench_gpu.HOOKED:
        plain = next((row for row in check.rep.rows if row["row"] == ONLOAD_PLAIN and row["status"] == "ok"), None)
        if plain and plain.get("gbps") and r.get("gbps"):
            r["vs_plain"] = r["gbps"] / plain["gbps"]
            reason += f"; {r['vs_plain']:.2f}x {ONLOAD_PLAIN!r} in this run"
        cpu = r.get("cpu_kernels")
        if cpu is not None:
            reason += (f"; {cpu['checked']} tensors against the CPU kernels: "
                       + ("equal" if not cpu["mismatched"] else f"DIFFER {sorted(cpu['mismatched'])[:3]}"))
            if cpu["mismatched"]:
                status = "failed"
    # the JSON keeps each sample's figures; a second load is its own row's sample
    r["samples"] = [{k: v for k, v in s.items() if k != "second"} for s in r.get("samples", [])]
    check.rep.add(phase, impl, status, reason, **r)


def row_second_load(check: Check) -> None:
    """The second loads of :data:`FIRST_ROW`'s samples (made in the same processes, timed
    after the first): a row of their own beside the first loads."""
    first = check.samples.get(FIRST_ROW) or []
    seconds = bench_gpu.second_loads(first)
    if not seconds:
        why = "no sample of its first load ran" if not first else "its samples made no second load"
        check.rep.add("warm-start", SECOND_ROW, "skipped", f"{why} (row {FIRST_ROW!r})")
        return
    add_load_row(check, "warm-start", SECOND_ROW, seconds, len(first), check.args.modes, None,
                 note=f"the second load of each sample of {FIRST_ROW!r} (its first loads are that row); ")


def row_sweep(check: Check) -> None:
    """The short sweep (scripts/ring_sweep.py ``--short``) in one child: a row per
    configuration, in the order timed, and one for the fastest's bytes."""
    if check.files is None:
        check.rep.add("sweep", "ring sweep", "skipped", "no checkpoint (its row did not run or failed)")
        return
    prior = check.priors["sweep"]

    def sweep(left: float) -> None:
        # the child stops starting configurations when what is left would not hold one
        events, error = ring_sweep.run_child(check.dev, check.files, min(left, 2 * prior), _run, check.env(),
                                             short=True)
        result = ring_sweep.summarize(events)
        start = result["start"] or {}
        timed = [e for e in events if e.get("event") == "config"]
        rank = {id(c): i for i, c in enumerate(result["configs"], 1)}
        for c in timed:
            name = sweep_name(c)
            if c.get("error") or c.get("bytes_ok") is False:
                check.rep.add("sweep", name, "failed", c.get("error") or "bytes differ from the files", config=c)
                continue
            first, second = c["gbps"]
            check.rep.add("sweep", name, "ok",
                          f"rank {rank.get(id(c))} of {len(timed)}; first load {first:.2f} GB/s (sets its ring up),"
                          f" second {second:.2f} GB/s (reuses it)",
                          gbps=c["median_gbps"], seconds=statistics.median(c["seconds"]), config=c,
                          records=(c.get("records") or [None])[0], records_second=(c.get("records") or [None, None])[1])
        if start.get("default") and start.get("cores"):
            done = {sweep_name(c) for c in timed}
            for cfg in ring_sweep.short_configs(tuple(start["default"]), start["cores"]):
                name = sweep_name(dict(zip(("chunk_mib", "chunks", "threads", "source", "stores", "unmap"), cfg,
                                           strict=True)))
                if name not in done:
                    check.rep.add("sweep", name, "skipped",
                                  error or f"budget: the sweep's child had no time left for it ({min(left, 2 * prior):.0f}s)")
        best, verdict = result["best"], result["check"] or {}
        if best:
            ok = bool(verdict.get("bytes_ok"))
            check.rep.add("sweep", "sweep: the fastest configuration's bytes", "ok" if ok else "failed",
                          f"{ring_sweep.env_line(best)}: {best['median_gbps']:.2f} GB/s;"
                          f" {'bytes checked' if ok else 'bytes differ from the first load or were not checked'}",
                          best=ring_sweep.env_line(best), gbps=best["median_gbps"], seconds=verdict.get("seconds"))
        if error or not timed:
            check.rep.add("sweep", "ring sweep", "failed", error or "no configuration ran",
                          engine_file=start.get("engine_file"))

    check.step("sweep", "ring sweep", "sweep", prior, sweep)


def sweep_name(c: dict) -> str:
    """A sweep row's name: the ring's shape, the source and unmap mode ("default": the
    engine's, the variable left unset)."""

    def knob(key: str) -> str:
        value = c.get(key, "-")
        return "default" if value == "-" else value

    return (f"sweep: {c['chunk_mib']} MiB x {c['chunks']}, threads {c['threads']}, source {knob('source')},"
            f" unmap {knob('unmap')}")


def row_compare(check: Check) -> None:
    def compare(left: float) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--child-compare", "--device", check.dev,
               "--out", check.scratch]
        rc, out, err = _run(cmd, left, check.env())
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if rc != 0 or not lines:
            why = "timed out at the budget's end" if rc is None else f"exit code {rc}: {_tail(err or out)}"
            check.rep.add("compare", "compare with the reference", "failed", why)
            return
        got = json.loads(lines[-1])
        note = "" if check.cuda else f" (device={check.dev}: host destinations; gpu_path has no effect)"
        for entry, r in got["entries"].items():
            if r["mismatched"]:
                bad = ", ".join(f"{k} ({v})" for k, v in r["mismatched"].items())
                check.rep.add("compare", f"compare: {entry}", "failed", f"differ: {bad}{note}", matched=r["matched"],
                              mismatched=r["mismatched"])
            else:
                check.rep.add("compare", f"compare: {entry}", "ok",
                              f"{len(r['matched'])} matched: {' '.join(r['matched'])}{note}",
                              matched=r["matched"], mismatched={})

    check.step("compare", "compare with the reference", "compare", check.priors["compare"], compare)


def _junit_counts(path: str) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failing = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failing.append(f"{case.get('classname')}::{case.get('name')}")
    skips = sorted({(s.get("message") or "")[:120] for s in root.iter("skipped")})
    return {**counts, "failing": failing[:10], "skip_reasons": skips[:5]}


def row_pytest(check: Check, name: str) -> None:
    if "pytest" in check.skip:
        check.rep.add("pytest", name, "skipped", "--skip pytest")
        return
    if not check.cuda:  # the suite runs these on the CPU itself (the simulator, the emulated runtime)
        check.rep.add("pytest", name, "skipped", f"no CUDA device (--device {check.dev})")
        return
    selection = PYTEST_RUNS[name]

    def run(left: float) -> None:
        xml = os.path.join(check.scratch, f"pytest-{list(PYTEST_RUNS).index(name)}.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={xml}", *selection]
        t0 = time.monotonic()
        rc, out, err = _run(cmd, left, check.env())  # Numba's simulator off: the real CUDA target
        seconds = round(time.monotonic() - t0, 1)
        if rc is None:
            check.rep.add("pytest", name, "failed", f"stopped at the budget's end ({left:.0f} s): last line {_tail(out)!r}")
            return
        if not os.path.exists(xml):
            check.rep.add("pytest", name, "failed", f"exit code {rc}: {_tail(err or out)}")
            return
        c = _junit_counts(xml)
        text = f"{c['passed']} passed, {c['failures'] + c['errors']} failed, {c['skipped']} skipped"
        fields = {"counts": c, "seconds": seconds, "command": " ".join(cmd[1:])}
        if rc == 0 and c["passed"] == 0 and c["skipped"]:
            check.rep.add("pytest", name, "skipped",
                          f"{text}; every test skipped itself: {'; '.join(c['skip_reasons'])}", **fields)
        elif rc == 0:
            check.rep.add("pytest", name, "ok", text, **fields)
        else:
            check.rep.add("pytest", name, "failed", f"exit code {rc}: {text}: {', '.join(c['failing'][:3])}", **fields)

    check.step("pytest", name, name, check.priors[name], run)


#: the emulated row: the chunk ring (the one device path, local and remote files, with or
#: without hooks); ``--child-emulated`` names it by the key
EMULATED = {
    "ring": "emulated runtime: chunk ring, every shard in one load",
}


def row_emulated(check: Check, kind: str) -> None:
    row = EMULATED[kind]
    if check.files is None:
        check.rep.add("emulated", row, "skipped", "no checkpoint (its row did not run or failed)")
        return
    files = check.files

    def run(left: float) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--child-emulated", kind, "--files", *files]
        rc, out, err = _run(cmd, left, check.env())
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if rc != 0 or not lines:
            check.rep.add("emulated", row, "failed",
                          "timed out at the budget's end" if rc is None else f"exit code {rc}: {_tail(err or out)}")
            return
        r = json.loads(lines[-1])
        check.rep.add("emulated", row, "ok", "bytes identical to the files; tests/emucudart's runtime "
                      "(memcpy on a stream thread), not a GPU rate",
                      gbps=r["bytes"] / r["seconds"] / 1e9, seconds=r["seconds"], bytes=r["bytes"],
                      copies=r["copies"], records=r.get("records"))

    check.step("emulated", row, f"emulated {kind}", check.priors["emulated"] / 2, run)


def row_driver(check: Check) -> None:
    """scripts/driver_check.py in a child of its own (a fresh process: no context made before
    it): what a load leaves behind as the driver sees it, one row each."""

    def run(left: float) -> None:
        cmd = [sys.executable, os.path.join(HERE, "driver_check.py"), "--device", check.dev,
               "--dir", os.path.join(check.scratch, "driver")]
        rc, out, err = _run(cmd, left, check.env())
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if rc != 0 or not lines:
            why = "timed out at the budget's end" if rc is None else f"exit code {rc}: {_tail(err or out)}"
            for name in driver_check.ROWS:
                check.rep.add("driver", name, "failed", why)
            return
        for r in json.loads(lines[-1])["rows"]:
            check.rep.add("driver", r["row"], r["status"], r["reason"], seconds=r["seconds"])

    check.step("driver", "driver rows", "driver", check.priors["driver"], run)


Step = tuple[str, list[str], Callable[[], None]]  # phase, the rows it reports, what runs it


def plan(check: Check, size: int, inject: str | None) -> list[Step]:
    """The rows in the order they run, the most decisive first."""

    def loads(phase: str, rows: list[str], key: str | None = None) -> list[Step]:
        out: list[Step] = []
        for impl in rows:
            limit = impl.startswith("limit:")
            runs = check.args.runs or ((LIMIT_RUNS if limit else RUNS) if check.cuda else 1)
            prior = key or ("limit" if limit else "sample")
            out.append((phase, [impl],
                        lambda impl=impl, runs=runs, prior=prior: row_loads(check, phase, impl, runs, prior)))
        return out

    steps: list[Step] = [
        ("wheels", [f"wheel: {p}" for p in PEERS], lambda: row_wheels(check)),
        ("build", ["build_ext --inplace"], lambda: row_build(check)),
        ("engine", ["engine from this checkout"], lambda: row_engine(check)),
        ("driver", list(driver_check.ROWS), lambda: row_driver(check)),
        ("checkpoint", ["checkpoint"], lambda: row_checkpoint(check, size)),
        *loads("loads", ([inject] if inject else []) + DECISIVE),
        *loads("per-key", PER_KEY, "per-key"),
        ("warm-start", [SECOND_ROW], lambda: row_second_load(check)),
        *loads("warm-start", [PREPARED_ROW]),
        ("sweep", ["ring sweep"], lambda: row_sweep(check)),
        ("compare", ["compare with the reference"], lambda: row_compare(check)),
    ]
    if not check.cuda:
        steps += [("emulated", [row], lambda kind=kind: row_emulated(check, kind)) for kind, row in EMULATED.items()]
    steps += [
        ("pytest", ["pytest -m cuda"], lambda: row_pytest(check, "pytest -m cuda")),
        *loads("reference", REFERENCE_ROWS),
        *loads("onload", ONLOAD_ROWS, "onload"),
        ("pytest", ["pytest device-kernel modules"], lambda: row_pytest(check, "pytest device-kernel modules")),
    ]
    if check.args.long:
        steps += loads("long", LONG_ROWS)
    return steps


# -- children -------------------------------------------------------------------------------------------


def _as_bytes(t):
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def compare_child(dev: str, scratch: str) -> dict:
    """Each engine entry point's tensors against the reference's, byte for byte, per dtype."""
    import torch
    from safetensors import safe_open as ref_open
    from safetensors.torch import load_file as ref_load
    from safetensors.torch import save_file as ref_save

    import engine
    import engine.torch

    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, attr in DTYPES.items():
        dtype = getattr(torch, attr, None)
        if dtype is None:
            continue
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 2 if name == "BOOL" else 256, (37 * 129 * size,), dtype=torch.uint8, generator=g)
        sd[name] = raw.view(dtype).reshape(37, 129)
    sd["F32 scalar"] = torch.tensor(3.5)
    sd["BF16 empty"] = torch.zeros((0, 5), dtype=torch.bfloat16)
    path = os.path.join(scratch, "every-dtype.safetensors")
    ref_save(sd, path)
    try:
        expected = ref_load(path, device=dev)
    except Exception:  # the reference cannot place every dtype on this device: compare its CPU load
        expected = ref_load(path)
    subset = sorted(sd)[::3]

    def check(got: dict, names, expected: dict) -> dict:
        matched, mismatched = [], {}
        for n in names:
            if n not in got:
                mismatched[n] = "missing"
                continue
            t, e = got[n], expected[n]
            if t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
                mismatched[n] = f"{t.dtype}{tuple(t.shape)} vs {e.dtype}{tuple(e.shape)}"
            elif str(t.device) != str(torch.device(dev)) and not (dev == "cpu" and t.device.type == "cpu"):
                mismatched[n] = f"on {t.device}, not {dev}"
            elif not torch.equal(_as_bytes(t), _as_bytes(e)):
                mismatched[n] = "bytes differ"
            else:
                matched.append(n)
        return {"matched": matched, "mismatched": mismatched}

    def load_into(names, gpu_path):
        dst = {n: torch.empty(sd[n].shape, dtype=sd[n].dtype, device=dev) for n in names}
        engine.load_into(path, dst, gpu_path=gpu_path)
        return dst

    def safe_open_get(names):
        with engine.safe_open(path, framework="pt", device=dev) as f:
            return {n: f.get_tensor(n) for n in names}

    def stream(names, gpu_path="auto"):
        return dict(engine.stream(path, framework="pt", device=dev, names=names, gpu_path=gpu_path))

    two_d = [n for n in subset if sd[n].dim() == 2]

    def slices(names):
        # rows 1:3 of each 2-D tensor, by get_slice
        with engine.safe_open(path, framework="pt", device=dev) as f:
            return {n: f.get_slice(n)[1:3] for n in names}

    def reference_slices():
        with ref_open(path, framework="pt", device=dev) as r:
            return {n: r.get_slice(n)[1:3] for n in two_d}

    every = list(sd)
    # the same file over HTTP (the tests' Range server, keep-alive, on 127.0.0.1): the remote
    # loads' device path, connections filling the chunk ring's page-locked chunks
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from rangeserver import serve

    server = serve(scratch)
    server.keepalive = True
    url = server.url(os.path.basename(path))

    def remote_load_into(names):
        dst = {n: torch.empty(sd[n].shape, dtype=sd[n].dtype, device=dev) for n in names}
        engine.load_into(url, dst)
        return dst

    entries = {  # entry -> (load(names) -> {name: tensor}, names)
        "remote: engine.torch.load_file(url)": (
            lambda names: {n: t for n, t in engine.torch.load_file(url, device=dev).items() if n in names}, every),
        "remote: engine.load_into(url)": (remote_load_into, every),
        "remote: engine.stream(url, names=every third)": (
            lambda names: dict(engine.stream(url, framework="pt", device=dev, names=names)), subset),
        "engine.torch.load_file": (
            lambda names: {n: t for n, t in engine.torch.load_file(path, device=dev).items() if n in names}, every),
        "engine.safe_open get_tensor": (safe_open_get, every),
        **{f"engine.stream gpu_path={gp}": (lambda names, gp=gp: stream(names, gp), every) for gp in GPU_PATHS},
        **{f"engine.load_into gpu_path={gp}": (lambda names, gp=gp: load_into(names, gp), every)
           for gp in GPU_PATHS},
        "selective: engine.stream(names=every third)": (stream, subset),
        "selective: engine.load_into(every third)": (lambda names: load_into(names, "auto"), subset),
        "selective: safe_open get_slice rows 1:3": (slices, two_d),
    }
    out = {}
    for entry, (load, names) in entries.items():
        reference = reference_slices() if load is slices else expected
        try:
            got = load(names)
        except Exception as exc:  # which tensors it fails on: one at a time
            first = f"{type(exc).__name__}: {str(exc)[:200]}"
            got, errors = {}, {}
            for n in names:
                try:
                    got.update(load([n]))
                except Exception as e:
                    errors[n] = f"{type(e).__name__}: {str(e)[:120]}"
            out[entry] = check(got, [n for n in names if n not in errors], reference)
            out[entry]["mismatched"].update(errors)
            out[entry]["mismatched"].setdefault("(whole load)", first)
            continue
        out[entry] = check(got, names, reference)
        extra = set(got) - set(names)
        if extra:  # a selective load that loaded more than it was asked for
            out[entry]["mismatched"]["(selection)"] = f"also loaded {sorted(extra)[:3]}"
    server.stop()
    return {"entries": out, "dtypes": list(sd)}


def emulated_child(kind: str, files: list[str]) -> dict:
    """The checkpoint's shards through the engine's device pipeline (one pipeline over every
    shard): ``kind`` ``"ring"``, the chunk ring on the emulated CUDA runtime of
    tests/emucudart.  Every byte checked against the files, nothing left page-locked."""
    import mmap

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import engine
    from engine.gpu import rings
    from engine.loading import pipeline
    from engine.planning.plan import plan_reads

    fds, sources, dst, base = [], [], {}, 0
    headers = [engine.read_header(f) for f in files]
    if kind != "ring":
        raise ValueError(f"no emulated row {kind!r}: the chunk ring is the one device path")
    from emucudart import EmulatedRingOps, Emulator

    emulator = Emulator()
    ops = EmulatedRingOps(emulator)
    try:
        for f, h in zip(files, headers, strict=True):
            fd = os.open(f, os.O_RDONLY)
            fds.append(fd)
            t = h.table
            rows = list(range(len(t.names)))
            sources.append(pipeline.Source(fd, f, plan_reads(t.begins, t.ends, rows, h.data_start, 16 << 20), base))
            for r in rows:
                dst[base + r] = bytearray(int(t.ends[r]) - int(t.begins[r]))
            base += len(rows)
        collect, on = bench_gpu.ring_records()
        t0 = time.perf_counter()
        with collect as got:
            nbytes = pipeline.run_sources(sources, pipeline.Destination(device_targets=dst, device_ops=ops),
                                          slot_bytes=8 << 20)
        seconds = time.perf_counter() - t0  # the ring has synchronized its stream
        rings.release_rings()
        ops.close()
        st = emulator.stats()
        if st["registered"] or st["pageable"] or st["wrong_device"] or st["events"]:
            raise AssertionError(f"the ring left the emulated runtime unclean: {st}")
        copies = st["copies"]
    finally:
        for fd in fds:
            os.close(fd)
    base = 0
    for f, h in zip(files, headers, strict=True):
        t = h.table
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
            for r in range(len(t.names)):
                b, e = h.data_start + int(t.begins[r]), h.data_start + int(t.ends[r])
                if m[b:e] != dst[base + r]:
                    raise AssertionError(f"{f}: tensor {t.names[r]}: bytes differ")
        base += len(t.names)
    records = bench_gpu.sum_records(bench_gpu.record_dicts(got)) if on else None
    return {"seconds": seconds, "bytes": nbytes, "copies": copies, "records": records}


# -- output ---------------------------------------------------------------------------------------------


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def _kinds(r: dict) -> str:
    """A row's host memory by kind: peak growth of anonymous + page-locked (the bound's
    quantity), anonymous, page-locked (the engine's count), mapped file pages; MiB."""
    if r.get("anon_locked_growth_bytes") is None:
        return "-"
    return (f"{_mib(r['anon_locked_growth_bytes'])} = {_mib(r.get('anon_growth_bytes'))} +"
            f" {_mib(r.get('locked_growth_bytes'))}; file {_mib(r.get('file_growth_bytes'))}")


def _records(r: dict) -> str:
    if "records" not in r:
        return "-"
    if r["records"] is None and r["row"].startswith(("engine", "sweep")):
        return "none kept (no engine.load_records here)" if r.get("status") == "ok" else "-"
    return ring_sweep.records_text(r["records"])


def markdown(meta: dict, rep: Report) -> str:
    eng = meta.get("engine_file") or {}
    lines = [f"gpu_check ({meta.get('mode')}) on {meta.get('device_name')}; {meta.get('date')}; torch"
             f" {meta.get('torch')}; python {meta.get('python')}; {meta.get('cores')} cores; checkpoint"
             f" {meta.get('size')} bytes; engine {eng.get('parent')} (a child's: {eng.get('child')});"
             f" budget {meta.get('budget_s')} s, {meta.get('elapsed_s')} s elapsed"
             f"{'' if meta.get('finished') else ' (still running, or stopped from outside)'}", "",
             "Host memory growth during the load, MiB, peaks sampled every 10 ms: anonymous + page-locked"
             f" (bound {HOST_BOUND >> 20} MiB on a GPU) = anonymous (RssAnon) + page-locked (the engine's count);"
             " file: mapped file pages (RssFile); after: mapped file pages left after the load.  Ring records:"
             " the chunk ring's own account of the row's loads (engine.load_records(), the median over the"
             " samples): loads (how many set the ring up), seconds the issuing thread waited for fills and the"
             " copy threads for slots, page-locking seconds, GB per source, the ring's shape.", "",
             "| phase | row | status | GB/s | s | peak host GiB (before) | host growth MiB (anon+locked = anon"
             " + locked; file) | file after MiB | peak device GiB | ring records | detail |",
             "|---|---|---|---:|---:|---:|---|---:|---:|---|---|"]
    for r in rep.rows:
        gbps = f"{r['gbps']:.2f}" if r.get("gbps") is not None else "-"
        sec = f"{r['seconds']:.3f}" if r.get("seconds") is not None else "-"
        host = "-" if r.get("host_peak_bytes") is None else \
            f"{_gib(r['host_peak_bytes'])} ({_gib(r.get('host_before_bytes'))})"
        detail = (r.get("reason") or "").replace("|", "/")
        if r.get("checksums"):
            detail += f" checksum {','.join(r['checksums'])}"
        lines.append(f"| {r['phase']} | {r['row']} | {r['status']} | {gbps} | {sec} | {host} | {_kinds(r)} |"
                     f" {_mib(r.get('file_after_bytes'))} | {_gib(r.get('device_peak_bytes'))} |"
                     f" {_records(r).replace('|', '/')} | {detail.strip()} |")
    if rep.pending:
        lines += ["", "Not reached (the run ended, or was stopped, before them): " + "; ".join(rep.pending)]
    if rep.phases:
        lines += ["", "| phase | elapsed s |", "|---|---:|"]
        lines += [f"| {p['phase']} | {p['elapsed_s']:.1f} |" for p in rep.phases]
    return "\n".join(lines) + "\n"


def summary(meta: dict, rep: Report, total: float) -> str:
    counts = {s: sum(r["status"] == s for r in rep.rows) for s in ("ok", "failed", "skipped")}
    eng = meta.get("engine_file") or {}
    out = [f"== gpu_check {meta['mode']} on {meta.get('device_name')}: {counts['ok']} ok, {counts['failed']} failed,"
           f" {counts['skipped']} skipped in {total:.0f} s (budget {meta['budget_s']:.0f} s)",
           f"engine: parent {eng.get('parent')}; child {eng.get('child')}",
           "phases: " + ", ".join(f"{p['phase']} {p['elapsed_s']:.0f} s" for p in rep.phases)]
    for r in rep.rows:
        if r["phase"] == "pytest" and r.get("counts"):
            out.append(f"{r['row']}: {r['reason']}")
    ref = next((r for r in rep.rows if r["row"] == "InstantTensor Backend.MMAP" and r.get("gbps")), None)
    for r in rep.rows:
        if r.get("gbps") is not None and r["phase"] in ("loads", "per-key", "warm-start", "reference", "onload",
                                                        "long"):
            ratio = f" {r['gbps'] / ref['gbps']:.2f}x IT-MMAP" if ref else ""
            n = len(r.get("samples", []))
            out.append(f"  {r['row'][:52]:52s} {r['gbps']:7.2f} GB/s{ratio} n={n} host MiB {_kinds(r)}"
                       f" device {_gib(r.get('device_peak_bytes'))} GiB")
    best = next((r for r in rep.rows if r["row"] == "sweep: the fastest configuration's bytes"), None)
    if best:
        out.append(f"  sweep: fastest {best['reason']}")
    over = [r["row"] for r in rep.rows if r.get("host_bounded") is False]
    if over:
        out.append(f"  over the host bound (anonymous + page-locked growth > {HOST_BOUND >> 20} MiB):"
                   f" {'; '.join(over)}")
    sums = {c for r in rep.rows if r["phase"] in ("loads", "per-key", "warm-start", "reference")
            for c in r.get("checksums", [])}
    if len(sums) > 1:
        out.append(f"  checksums differ between rows: {sorted(sums)}")
    budget = [r["row"] for r in rep.rows if r["status"] == "skipped" and (r["reason"] or "").startswith("budget")]
    if budget:
        out.append(f"  not run for the budget: {'; '.join(budget)}")
    for r in rep.rows:
        if r["status"] == "failed":
            out.append(f"FAILED {r['phase']}: {r['row']}: {(r['reason'] or '')[:150]}")
    return "\n".join(out)


def run_sweep(args) -> int:
    """``--sweep``: the extensions built in place if they are not, the checkpoint made or
    reused, then scripts/ring_sweep.py's whole grid within the budget."""
    cpu = not args.device.startswith("cuda")
    budget = args.budget or SWEEP_BUDGET
    size = bench_gpu.parse_size(args.size or SIZE["cpu" if cpu else "long"])
    folder = os.path.join(args.dir, f"llama3-shapes-{size}")
    env = {**{k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"},
           "PYTHONPATH": checkout_path.pythonpath()}
    meta = {"device": args.device, "size": size, "python": platform.python_version(), "cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:],
            "device_name": args.device if not cpu else f"{args.device} (the emulated CUDA runtime, no GPU)"}
    failed: list[str] = []

    def files_for(deadline: float) -> list[str] | None:
        # a fresh checkout on a GPU host has no extensions until they are built in place
        if not built_fresh():
            print("== build (the extensions are not built in this checkout)", flush=True)
            rc, out, err = _run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "-j",
                                 str(min(8, _cores()))], min(150.0, deadline - time.monotonic() - 90), env)
            if rc != 0:
                failed.append(f"build: {'timed out' if rc is None else _tail(err or out)}")
        print(f"== checkpoint ({size} bytes in {folder})", flush=True)
        code = ("import sys, json; sys.path.insert(0, sys.argv[1]); import bench_gpu;"
                " print(json.dumps(bench_gpu.make_checkpoint(sys.argv[2], int(sys.argv[3]))))")
        # the sweep needs about a minute of the budget after the checkpoint to say anything
        rc, out, err = _run([sys.executable, "-c", code, HERE, folder, str(size)], deadline - time.monotonic() - 60,
                            env)
        if rc != 0 or not out.strip():
            failed.append(f"checkpoint: {'timed out' if rc is None else _tail(err or out)}")
            return None
        return json.loads(out.strip().splitlines()[-1])

    rc = ring_sweep.run(args.out, args.device, files_for, budget, START, _run, env, meta)
    for why in failed:
        print(f"FAILED {why}")
    return 1 if failed else rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for gpu_check-<mode>.json and .md (required)")
    ap.add_argument("--device", default="cuda:0", help="cuda:0, or cpu for the dry run")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds the whole command may take, from its start (default {BUDGET:.0f};"
                         f" {LONG_BUDGET:.0f} with --long, {SWEEP_BUDGET:.0f} with --sweep)")
    ap.add_argument("--size", default=None,
                    help=f"checkpoint size (default {SIZE['check']}; {SIZE['long']} with --long;"
                         f" {SIZE['cpu']} with --device cpu)")
    ap.add_argument("--long", action="store_true",
                    help="the longer check: a 16.06 GB checkpoint and more rows (its own command)")
    ap.add_argument("--modes", default="warm", choices=["warm", "cold"])
    ap.add_argument("--wheels", default=None, help="folder of the peers' wheels, installed in a scratch folder")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "engine-bench-gpu"),
                    help="where the checkpoint is made (and reused)")
    ap.add_argument("--runs", type=int, default=None,
                    help=f"samples per load row (default {RUNS} on a GPU, a limit {LIMIT_RUNS}; 1 on cpu)")
    ap.add_argument("--skip", default="", help="phases to leave out, comma-separated (e.g. build,pytest)")
    ap.add_argument("--sweep", action="store_true",
                    help="instead of the check: time the chunk ring's whole geometry grid (scripts/ring_sweep.py)"
                         " and write gpu_check-sweep.json and .md; with --device cpu, a dry run on the emulated"
                         " runtime")
    # a row whose implementation does not exist, run first among the load rows: checks that a
    # failing row is reported and the rest still run
    ap.add_argument("--inject-row", default=os.environ.get("GPU_CHECK_INJECT"), help=argparse.SUPPRESS)
    ap.add_argument("--child-compare", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-emulated", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--files", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child_compare:
        print(json.dumps(compare_child(args.device, args.out)))
        return 0
    if args.child_emulated:
        print(json.dumps(emulated_child(args.child_emulated, args.files)))
        return 0
    if not args.out:
        ap.error("--out DIR is required")
    os.makedirs(args.out, exist_ok=True)
    if args.sweep:
        return run_sweep(args)
    return run_check(args)


def run_check(args) -> int:
    cpu = not args.device.startswith("cuda")
    budget = Budget(args.budget or (LONG_BUDGET if args.long else BUDGET), start=START)
    size = bench_gpu.parse_size(args.size or SIZE["cpu" if cpu else "long" if args.long else "check"])
    mode = args.modes
    meta = {"mode": mode, "device": args.device, "device_name": args.device, "size": size,
            "python": platform.python_version(), "cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:],
            "budget_s": budget.seconds, "long": args.long, "finished": False}
    base = os.path.join(args.out, f"gpu_check-{mode}")
    rep = Report(base, meta)
    # pytest's reports, the compare file and the installed wheels: not under --out, which the
    # device tool copies back
    scratch = tempfile.mkdtemp(prefix="gpu-check-")
    check = Check(args, budget, rep, scratch)
    steps = plan(check, size, args.inject_row)
    rep.plan([name for _, names, _ in steps for name in names])
    rep.write()
    print(f"gpu_check {mode} on {args.device}: budget {budget.seconds:.0f} s, checkpoint {size} bytes", flush=True)
    phase_t0, current = time.monotonic(), None
    for phase, names, run in steps:
        if phase != current:
            if current is not None:
                rep.phases.append({"phase": current, "elapsed_s": round(time.monotonic() - phase_t0, 1)})
            print(f"== {phase} ({budget.left():.0f} s of the budget left)", flush=True)
            phase_t0, current = time.monotonic(), phase
        run()
        rep.done(names)
    if current is not None:
        rep.phases.append({"phase": current, "elapsed_s": round(time.monotonic() - phase_t0, 1)})
    total = time.monotonic() - START
    for r in rep.rows:  # the JSON keeps each sample's figures, not its child's wall time
        for s in r.get("samples", []):
            s.pop("wall", None)
    rep.meta.update(total_s=round(total, 1), finished=True)
    rep.write()
    shutil.rmtree(scratch, ignore_errors=True)
    print(summary(rep.meta, rep, total))
    print(f"wrote {base}.json and {base}.md")
    return 1 if any(r["status"] == "failed" for r in rep.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
