"""Everything that decides the engine's device path, in one budgeted GPU command (7 minutes by default).

Most decisive first: the peers' wheels installed in a scratch folder, the extensions built in place, the
engine a child imports checked to be this checkout's, driver_check.py's rows, bench_gpu.py's checkpoint
and load rows (fresh-process samples), warm start, ring_sweep.py's short sweep, every dtype byte for byte
against the reference (and over HTTP), ``pytest -m cuda``, the loads with device kernels and the
device-kernel tests.  No row starts that the rest of ``--budget`` cannot hold (its cost from its own runs,
else :data:`PRIORS`); ``gpu_check-warm.json`` and ``.md`` in ``--out`` are rewritten after every row,
naming what did not run and why.  Exit status 1 when a row failed.  On a lent GPU host (carry ``.whl``)::

    python3 scripts/gpu_check.py --wheels .whl --out $OUT/gpu-check

``--long`` (16.06 GB, more rows) and ``--sweep`` (the ring's whole grid) are commands of their own.  The
dry run (CI's): ``python scripts/gpu_check.py --device cpu --budget 60 --out DIR``: host loads, and the
device pipeline on the emulated CUDA runtime (tests/emucudart).
"""

from __future__ import annotations

import time

#: the check's clock starts with the script
START = time.monotonic()

import argparse  # noqa: E402
import contextlib  # noqa: E402
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
from functools import partial  # noqa: E402

import harness  # noqa: E402

# isort: split
import bench_gpu  # noqa: E402
import checkout_path  # noqa: E402
import driver_check  # noqa: E402
import ring_sweep  # noqa: E402

ROOT = harness.ROOT
#: seconds of the command (by default: a lent GPU host's 15 minutes include its start-up; ``--long``;
#: ``--sweep``), and those kept for the last write
BUDGET, LONG_BUDGET, SWEEP_BUDGET, RESERVE = 420.0, 540.0, 210.0, 3.0
SIZE = {"check": "8GB", "long": "16.06GB", "cpu": "64MB"}
PEERS = ("instanttensor", "fastsafetensors", "runai_model_streamer")
#: the rows that decide the device path, first
DECISIVE = ["limit: pinned host-to-device 1 GiB", "limit: page cache to pinned, split read, 16 threads",
            "InstantTensor Backend.MMAP", "engine load_file(f) per shard", "engine load_file(directory)",
            "engine safe_open(directory).get_tensors()", "engine stream(shards) auto",
            "engine stream(shards) per_tensor=False", "engine load_into(directory)",
            "fastsafetensors (nogds, buffered)"]
PER_KEY = ["engine safe_open(f, device) get_tensor per key", "reference safe_open(f, device) get_tensor per key"]
#: the second loads of FIRST_ROW's samples are a row of their own
FIRST_ROW = "engine load_into(directory)"
SECOND_ROW = "engine load_into(directory) second load in the same process"
PREPARED_ROW = "engine load_into(directory) first load after engine.prepare_device"
REFERENCE_ROWS = ["reference load_file(f, device) per shard"]
#: loads with device kernels beside the plain load of the same entry point, and the validator
ONLOAD_PLAIN = "engine stream(f) per shard"
ONLOAD_ROWS = [ONLOAD_PLAIN, "engine stream(f) stats=True per shard", "engine stream(f) quantize=int8 per shard",
               "engine stream(f) stats=True quantize=int8 per shard",
               "engine WeightValidator(config).validate(directory)"]
LONG_ROWS = ["engine load_into(directory) reload, staging and mappings kept", "engine load_into(f) per shard",
             "engine safe_open(index).get_tensors()", "reference load_file(f) then .to(device)", "InstantTensor default",
             "limit: pageable host-to-device 1 GiB", "limit: page cache to pinned, split read, 8 threads"]
EMULATED_ROW = "emulated runtime: chunk ring, every shard in one load"
#: seconds one load sample may take at most; samples per load row (a limit: one process)
SAMPLE_LIMIT, RUNS, LIMIT_RUNS = 120.0, 3, 1
#: what a device load may add to the host's anonymous and page-locked memory together
HOST_BOUND = 512 << 20
PYTEST_RUNS = {"pytest -m cuda": ["-m", "cuda", "tests"],
               "pytest device-kernel modules": ["tests/test_device.py", "tests/test_cuda_kernels.py",
                                                "tests/test_cudart.py", "tests/test_load_hooks.py"]}
#: conservative seconds before a row has run (a load row's per sample; ``checkpoint`` per GB to make,
#: ``-read`` to read)
PRIORS = {
    "cuda": {"wheels": 15, "build": 75, "build-fresh": 10, "engine": 20, "checkpoint": 5, "checkpoint-read": 2,
             "sample": 10, "limit": 8, "per-key": 12, "onload": 15, "sweep": 45, "compare": 20,
             "pytest -m cuda": 40, "pytest device-kernel modules": 100, "emulated": 15, "driver": 80},
    "cpu": {"wheels": 15, "build": 120, "build-fresh": 10, "engine": 10, "checkpoint": 60, "checkpoint-read": 5,
            "sample": 6, "limit": 6, "per-key": 6, "onload": 25, "sweep": 20, "compare": 12,
            "pytest -m cuda": 90, "pytest device-kernel modules": 90, "emulated": 10, "driver": 15},
}
#: the reference's dtypes (torch attribute names); a torch without one leaves it out
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
          "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
          "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz",
          "C64": "complex64", "U64": "uint64", "U32": "uint32", "U16": "uint16"}


class Budget:
    """The command's seconds: what is left, what a row will cost (1.2 times its slowest run so far, else
    its prior, scaled for load samples by how the samples so far compared with theirs), whether it may start."""

    def __init__(self, seconds: float, start: float | None = None, clock: Callable[[], float] = time.monotonic,
                 reserve: float = RESERVE) -> None:
        self.seconds, self.clock, self.reserve = seconds, clock, reserve
        self.start = clock() if start is None else start
        self.walls: dict[str, list[float]] = {}
        self.ratios: list[float] = []  # a load sample's seconds over its prior

    def left(self) -> float:
        return self.seconds - self.reserve - (self.clock() - self.start)

    def estimate(self, key: str, prior: float, scaled: bool = False) -> float:
        if own := self.walls.get(key):
            return 1.2 * max(own) + 0.5
        if scaled and self.ratios:
            return prior * min(2.0, max(0.5, 1.25 * statistics.median(self.ratios)))
        return prior

    def note(self, key: str, seconds: float, prior: float | None = None) -> None:
        self.walls.setdefault(key, []).append(seconds)
        if prior:
            self.ratios.append(seconds / prior)

    def refuse(self, need: float) -> str | None:
        """Why a row that needs ``need`` seconds may not start (None: it may)."""
        left = self.left()
        return None if need <= left else f"budget: needs ~{need:.0f}s, {max(0.0, left):.0f}s left"


class Report:
    """Rows as they come: each printed, the JSON and markdown rewritten after it (through a rename: a run
    stopped at any moment leaves whole files)."""

    def __init__(self, base: str, meta: dict) -> None:
        self.rows: list[dict] = []
        self.phases: list[dict] = []
        self.base, self.meta = base, meta
        self.pending: list[str] = []  # rows planned and not reported yet, in order

    def plan(self, names: list[str]) -> None:
        self.pending = [n for n in names if n not in self.pending] + [n for n in self.pending if n not in names]

    def done(self, names: list[str]) -> None:
        self.pending = [n for n in self.pending if n not in names]

    def add(self, phase: str, row: str, status: str, reason: str | None = None, **fields) -> dict:
        record = {"phase": phase, "row": row, "status": status, "reason": reason, **fields}
        self.rows.append(record)
        self.done([row])
        figure = f" {fields['gbps']:.2f} GB/s" if fields.get("gbps") is not None else ""
        text = f"  {status:7s} {row}{figure}{': ' + reason if reason else ''}"
        print(text if len(text) <= 150 else text[:147] + "...", flush=True)
        self.write()
        return record

    def write(self) -> None:
        meta = {**self.meta, "elapsed_s": round(time.monotonic() - START, 1)}
        body = {"meta": meta, "phases": self.phases, "rows": self.rows, "pending": self.pending}
        for suffix, text in ((".json", json.dumps(body, indent=1, default=str)), (".md", markdown(meta, self))):
            with open(f"{self.base}{suffix}.tmp", "w") as f:
                f.write(text)
            os.replace(f"{self.base}{suffix}.tmp", self.base + suffix)


class Failed(Exception):
    """A row's child or command failed; the text is the row's reason."""


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str, str]:
    """(exit code or None on timeout, stdout, stderr) of a command; on timeout its whole process group is
    killed (a test's own children would keep the pipes open)."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=max(1.0, timeout))
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        return (None, *p.communicate())


def _tail(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"


def built_fresh() -> bool:
    """Whether every extension is built in place and newer than its .pyx, .pxd, the .pxd it cimports and
    the headers it includes: the build is then a no-op."""
    sources = glob.glob(os.path.join(ROOT, "engine", "**", "*.pyx"), recursive=True)
    pxds = glob.glob(os.path.join(ROOT, "engine", "**", "*.pxd"), recursive=True)
    for pyx in sources:
        stem = pyx[: -len(".pyx")]
        with open(pyx) as f:
            text = f.read()
        cimports = " ".join(line for line in text.splitlines() if "cimport" in line)
        deps = [pyx, *glob.glob(stem + ".pxd"), *(p for p in pxds if os.path.basename(p)[:-4] in cimports),
                *(p for p in glob.glob(os.path.join(os.path.dirname(pyx), "*.h")) if os.path.basename(p) in text)]
        built = glob.glob(stem + ".*.so")
        if not built or min(map(os.path.getmtime, built)) < max(map(os.path.getmtime, deps)):
            return False
    return bool(sources)


def _build_command() -> list[str]:  # the extensions compiled at once: a fresh checkout's in a fraction
    return [sys.executable, "setup.py", "-q", "build_ext", "--inplace", "-j", str(min(8, len(os.sched_getaffinity(0))))]


# -- the check's state and its rows ----------------------------------------------------------------


class Check:
    """One run: the options, the budget, the report, and what the rows leave for later ones."""

    def __init__(self, args, budget: Budget, rep: Report, scratch: str) -> None:
        self.args, self.budget, self.rep, self.scratch = args, budget, rep, scratch
        self.dev = args.device
        self.cuda = args.device.startswith("cuda")
        self.priors = PRIORS["cuda" if self.cuda else "cpu"]
        self.path: list[str] = []  # the peers' site folder, for the children
        self.files: list[str] | None = None
        self.skip = {p.strip() for p in args.skip.split(",") if p.strip()}
        self.samples: dict[str, list[dict]] = {}

    def env(self) -> dict:
        return harness.child_env(NUMBA_ENABLE_CUDASIM=None, PYTHONPATH=checkout_path.pythonpath(*self.path))

    def call(self, fn: Callable, *args, left: float):
        """``fn(*args)`` in a fresh process stopped after ``left`` seconds: what it returned, or :class:`Failed`."""
        t0 = time.monotonic()
        got = harness.call(fn, *args, env=self.env(), timeout=max(1.0, left), check=False)
        if isinstance(got, dict) and "error" in got:
            raise Failed("timed out at the budget's end" if time.monotonic() - t0 >= left else got["error"])
        return got

    def run(self, cmd: list[str], left: float) -> str:
        """A command's output, or :class:`Failed`."""
        rc, out, err = _run(cmd, left, self.env())
        if rc != 0:
            raise Failed("timed out at the budget's end" if rc is None else f"exit code {rc}: {_tail(err or out)}")
        return out

    def step(self, phase: str, row: str, key: str, prior: float, fn: Callable[[float], None]) -> None:
        """``fn(seconds it may take)`` if the budget holds its estimate, else the row skipped with the
        reason; an exception is a failed row (the later rows still run)."""
        why = f"--skip {phase}" if phase in self.skip else self.budget.refuse(self.budget.estimate(key, prior))
        if why:
            self.rep.add(phase, row, "skipped", why)
            return
        t0 = time.monotonic()
        try:
            fn(self.budget.left())
        except Failed as exc:
            self.rep.add(phase, row, "failed", str(exc))
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self.rep.add(phase, row, "failed",
                         f"{type(exc).__name__}: {exc} ({os.path.basename(where.filename)}:{where.lineno})")
        self.budget.note(key, time.monotonic() - t0)


def row_wheels(check: Check) -> None:
    """Each peer's wheel installed into the scratch folder the children get on their path."""
    wheels, site = check.args.wheels, os.path.join(check.scratch, "site")
    for peer in PEERS:
        found = sorted(glob.glob(os.path.join(os.path.abspath(wheels), f"{peer}-*.whl"))) if wheels else []
        if not found:
            check.rep.add("wheels", f"wheel: {peer}", "skipped",
                          f"no {peer}-*.whl in {wheels}" if wheels else "no --wheels folder given")
            continue

        def install(left: float, peer=peer, wheel=found[-1]) -> None:
            check.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site,
                       wheel], left)
            check.rep.add("wheels", f"wheel: {peer}", "ok", None, wheel=os.path.basename(wheel))

        check.step("wheels", f"wheel: {peer}", "wheel", check.priors["wheels"] / 3, install)
    if os.path.isdir(site):
        check.path = [site]


def row_build(check: Check) -> None:
    fresh = built_fresh()

    def build(left: float) -> None:
        t0 = time.monotonic()
        check.run(_build_command(), left)
        check.rep.add("build", "build_ext --inplace", "ok", "nothing to rebuild" if fresh else "built",
                      seconds=round(time.monotonic() - t0, 1))

    check.step("build", "build_ext --inplace", "build", check.priors["build-fresh" if fresh else "build"], build)


def row_engine(check: Check) -> None:
    """The engine the parent and a child import, extensions included, must be this checkout's (an editable
    install of another checkout would lend its own); the child also names torch and the device."""

    def probe(left: float) -> None:
        t0 = time.monotonic()
        got = check.call(bench_gpu.where, left=left)
        where = {"parent": checkout_path.engine_origin(), "child": got["engine_file"], "child_ring": got["ring_file"]}
        check.rep.meta.update(engine_file=where, torch=got["torch"], cuda_available=got["cuda"],
                              device_name=got["name"] if check.cuda else f"{check.dev} (no GPU used)")
        text = f"parent {where['parent']}; child {where['child']}; its ring extension {where['child_ring']}"
        ok = all(checkout_path.from_checkout(p or "") for p in where.values())
        check.rep.add("engine", "engine from this checkout", "ok" if ok else "failed",
                      text if ok else f"not all under {ROOT}/engine: {text}", engine_file=where,
                      seconds=round(time.monotonic() - t0, 1))
        if check.cuda and not got["cuda"]:
            print(f"no CUDA device visible to torch: the device rows will fail ({check.dev})", flush=True)

    check.step("engine", "engine from this checkout", "engine", check.priors["engine"], probe)


def row_driver(check: Check) -> None:
    """driver_check.py's rows in a fresh process (no context made before it)."""

    def run(left: float) -> None:
        try:
            rows = check.call(driver_check.rows, check.dev, os.path.join(check.scratch, "driver"), left=left)
        except Failed as exc:
            rows = [{"row": name, "status": "failed", "reason": str(exc)} for name in driver_check.ROWS]
        for r in rows:
            check.rep.add("driver", r.pop("row"), r.pop("status"), r.pop("reason"), **r)

    check.step("driver", "driver rows", "driver", check.priors["driver"], run)


def row_checkpoint(check: Check, size: int) -> None:
    """The checkpoint made (or reused) in a child, which counts its tensor bytes, then read once."""
    folder = os.path.join(check.args.dir, f"llama3-shapes-{size}")
    exists = os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    prior = 5 + size / 1e9 * (check.priors["checkpoint-read"] + (0 if exists else check.priors["checkpoint"]))

    def make(left: float) -> None:
        t0 = time.monotonic()
        got = check.call(bench_gpu.made, folder, size, left=left)
        made = time.monotonic() - t0
        bench_gpu.warm(got["files"])
        check.files = got["files"]
        check.rep.add("checkpoint", "checkpoint", "ok",
                      f"{len(check.files)} shards, {got['bytes'] / 1e9:.2f} GB of tensors in {folder}"
                      f" ({'reused' if exists else 'made'} in {made:.1f} s, then read once)",
                      seconds=round(time.monotonic() - t0, 1), bytes=got["bytes"], made=not exists)

    check.step("checkpoint", "checkpoint", "checkpoint", prior, make)


def _files(check: Check, phase: str, row: str) -> list[str] | None:
    """The checkpoint's shards, or None and the row skipped for want of them."""
    if check.files is None:
        check.rep.add(phase, row, "skipped", "no checkpoint (its row did not run or failed)")
    return check.files


def row_loads(check: Check, phase: str, impl: str, runs: int, prior_key: str) -> None:
    """One load row: ``runs`` fresh-process samples, each started only if the budget holds it; a row cut
    short keeps the samples it has and says why."""
    rep, budget = check.rep, check.budget
    why = f"--skip {phase}" if phase in check.skip else bench_gpu.skip_reason(impl, check.dev, check.path)
    if why:
        rep.add(phase, impl, "skipped", why)
        return
    if (files := _files(check, phase, impl)) is None:
        return
    prior, samples, cut = check.priors[prior_key], [], None
    for _ in range(runs):
        if cut := budget.refuse(budget.estimate(impl, prior, scaled=True)):
            break
        t0 = time.monotonic()
        limit = max(1.0, min(SAMPLE_LIMIT, budget.left()))  # a hung child is stopped before it takes every row's time
        s = bench_gpu.sample(impl, files, check.dev, limit, check.env())
        budget.note(impl, time.monotonic() - t0, prior)
        if str(s.get("error")).startswith("timed out") and limit < SAMPLE_LIMIT:
            cut = f"budget: its sample was stopped at the {limit:.0f} s the budget had left"  # not run, not failed
            break
        samples.append(s)
        if "error" in s:
            break
    check.samples[impl] = samples
    if samples:
        add_load_row(check, phase, impl, samples, runs, cut)
    else:
        rep.add(phase, impl, "skipped", cut)


def add_load_row(check: Check, phase: str, impl: str, samples: list[dict], runs: int, cut: str | None,
                 note: str = "") -> None:
    r = bench_gpu.summarise(samples, "warm")
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
            r.update(host_bound_bytes=HOST_BOUND, host_bounded=r["anon_locked_growth_bytes"] <= HOST_BOUND)
            if not r["host_bounded"]:
                reason += f"; over bound: anonymous + page-locked memory grew {r['anon_locked_growth_bytes'] >> 20} MiB"
    if status == "ok" and impl in bench_gpu.HOOKED:
        plain = next((row for row in check.rep.rows if row["row"] == ONLOAD_PLAIN and row["status"] == "ok"), None)
        if plain and plain.get("gbps") and r.get("gbps"):
            r["vs_plain"] = r["gbps"] / plain["gbps"]
            reason += f"; {r['vs_plain']:.2f}x {ONLOAD_PLAIN!r} in this run"
        if (cpu := r.get("cpu_kernels")) is not None:
            reason += (f"; {cpu['checked']} tensors against the CPU kernels: "
                       + (f"DIFFER {sorted(cpu['mismatched'])[:3]}" if cpu["mismatched"] else "equal"))
            status = "failed" if cpu["mismatched"] else status
    # a second load is its own row's sample
    r["samples"] = [{k: v for k, v in s.items() if k != "second"} for s in r.get("samples", [])]
    check.rep.add(phase, impl, status, reason, **r)


def row_second_load(check: Check) -> None:
    """The second loads of :data:`FIRST_ROW`'s samples (the same processes): a row of their own."""
    first = check.samples.get(FIRST_ROW) or []
    seconds = [{**s["second"], "second_of": i} for i, s in enumerate(first) if isinstance(s.get("second"), dict)]
    if not seconds:
        why = "no sample of its first load ran" if not first else "its samples made no second load"
        check.rep.add("warm-start", SECOND_ROW, "skipped", f"{why} (row {FIRST_ROW!r})")
        return
    add_load_row(check, "warm-start", SECOND_ROW, seconds, len(first), None,
                 note=f"the second load of each sample of {FIRST_ROW!r} (its first loads are that row); ")


def row_sweep(check: Check) -> None:
    """The short sweep in one child: a row per configuration, in the order timed, and one for the
    fastest's bytes."""
    if (files := _files(check, "sweep", "ring sweep")) is None:
        return
    prior = check.priors["sweep"]

    def sweep(left: float) -> None:
        # the child stops starting configurations when what is left would not hold one
        events, error = ring_sweep.run_child(check.dev, files, min(left, 2 * prior), check.env(), short=True)
        result = ring_sweep.summarize(events)
        start = result["start"] or {}
        timed = [e for e in events if e["event"] == "config"]
        rank = {id(c): i for i, c in enumerate(result["configs"], 1)}
        for c in timed:
            if c.get("error") or c.get("bytes_ok") is False:
                check.rep.add("sweep", f"sweep: {ring_sweep.name(c)}", "failed",
                              c.get("error") or "bytes differ from the files", config=c)
                continue
            check.rep.add("sweep", f"sweep: {ring_sweep.name(c)}", "ok",
                          f"rank {rank[id(c)]} of {len(timed)}; first load {c['gbps'][0]:.2f} GB/s (sets its ring"
                          f" up), second {c['gbps'][1]:.2f} GB/s (reuses it)", gbps=c["median_gbps"],
                          seconds=statistics.median(c["seconds"]), config=c, records=c["records"][0],
                          records_second=c["records"][1])
        done = {ring_sweep.name(c) for c in timed}
        for cfg in ring_sweep.short_configs(tuple(start["default"]), start["cores"]) if start else []:
            if (name := ring_sweep.name(dict(zip(ring_sweep.KEYS, cfg, strict=True)))) not in done:
                check.rep.add("sweep", f"sweep: {name}", "skipped", error or "budget: the sweep's child had no"
                              f" time left for it ({min(left, 2 * prior):.0f}s)")
        best, verdict = result["best"], result["check"] or {}
        if best:
            ok = bool(verdict.get("bytes_ok"))
            check.rep.add("sweep", "sweep: the fastest configuration's bytes", "ok" if ok else "failed",
                          f"{ring_sweep.env_line(best)}: {best['median_gbps']:.2f} GB/s; "
                          + ("bytes checked" if ok else "bytes differ from the first load or were not checked"),
                          best=ring_sweep.env_line(best), gbps=best["median_gbps"], seconds=verdict.get("seconds"))
        if error or not timed:
            check.rep.add("sweep", "ring sweep", "failed", error or "no configuration ran",
                          engine_file=start.get("engine_file"))

    check.step("sweep", "ring sweep", "sweep", prior, sweep)


def row_compare(check: Check) -> None:
    def compare(left: float) -> None:
        for r in check.call(compare_child, check.dev, check.scratch, left=left):
            check.rep.add("compare", r.pop("row"), r.pop("status"), r.pop("reason"), **r)

    check.step("compare", "compare with the reference", "compare", check.priors["compare"], compare)


def row_pytest(check: Check, name: str) -> None:
    if not check.cuda and "pytest" not in check.skip:  # the suite runs these on the CPU itself
        check.rep.add("pytest", name, "skipped", f"no CUDA device (--device {check.dev})")
        return

    def run(left: float) -> None:
        xml = os.path.join(check.scratch, f"pytest-{list(PYTEST_RUNS).index(name)}.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={xml}",
               *PYTEST_RUNS[name]]
        t0 = time.monotonic()
        rc, out, err = _run(cmd, left, check.env())  # Numba's simulator off: the real CUDA target
        if rc is None:
            raise Failed(f"stopped at the budget's end ({left:.0f} s): last line {_tail(out)!r}")
        if not os.path.exists(xml):
            raise Failed(f"exit code {rc}: {_tail(err or out)}")
        root = ET.parse(xml).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        c: dict = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
        c["passed"] = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
        c["failing"] = [f"{t.get('classname')}::{t.get('name')}" for t in root.iter("testcase")
                        if t.find("failure") is not None or t.find("error") is not None][:10]
        c["skip_reasons"] = sorted({(s.get("message") or "")[:120] for s in root.iter("skipped")})[:5]
        text = f"{c['passed']} passed, {c['failures'] + c['errors']} failed, {c['skipped']} skipped"
        fields = {"counts": c, "seconds": round(time.monotonic() - t0, 1), "command": " ".join(cmd[1:])}
        if rc == 0 and c["passed"] == 0 and c["skipped"]:
            check.rep.add("pytest", name, "skipped", f"{text}; every test skipped itself: "
                          f"{'; '.join(c['skip_reasons'])}", **fields)
        else:
            check.rep.add("pytest", name, "ok" if rc == 0 else "failed",
                          text if rc == 0 else f"exit code {rc}: {text}: {', '.join(c['failing'][:3])}", **fields)

    check.step("pytest", name, name, check.priors[name], run)


def row_emulated(check: Check) -> None:
    """Every shard through the chunk ring on the emulated runtime (ring_sweep.emulated_load)."""
    if (files := _files(check, "emulated", EMULATED_ROW)) is None:
        return

    def run(left: float) -> None:
        r = check.call(ring_sweep.emulated_load, files, left=left)
        check.rep.add("emulated", EMULATED_ROW, "ok", "bytes identical to the files; tests/emucudart's runtime"
                      " (memcpy on a stream thread), not a GPU rate", gbps=r["bytes"] / r["seconds"] / 1e9, **r)

    check.step("emulated", EMULATED_ROW, "emulated ring", check.priors["emulated"] / 2, run)


Step = tuple[str, list[str], Callable[[], None]]  # phase, the rows it reports, what runs it


def plan(check: Check, size: int, inject: str | None) -> list[Step]:
    """The rows in the order they run, the most decisive first."""

    def loads(phase: str, rows: list[str], key: str | None = None) -> list[Step]:
        out: list[Step] = []
        for impl in rows:
            limit = impl.startswith("limit:")
            runs = (LIMIT_RUNS if limit else RUNS) if check.cuda else 1
            prior = key or ("limit" if limit else "sample")
            out.append((phase, [impl], partial(row_loads, check, phase, impl, runs, prior)))
        return out

    pytest_step: list[Step] = [("pytest", [name], partial(row_pytest, check, name)) for name in PYTEST_RUNS]
    return [
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
        *([] if check.cuda else [("emulated", [EMULATED_ROW], lambda: row_emulated(check))]),
        pytest_step[0],
        *loads("reference", REFERENCE_ROWS),
        *loads("onload", ONLOAD_ROWS, "onload"),
        pytest_step[1],
        *(loads("long", LONG_ROWS) if check.args.long else []),
    ]


# -- the byte comparison (a child) ----------------------------------------------------------------------


def compare_child(dev: str, scratch: str) -> list[dict]:
    """Each engine entry point's tensors against the reference's, byte for byte, every dtype: a row each."""
    import torch
    from rangeserver import serve
    from safetensors import safe_open as ref_open
    from safetensors.torch import load_file as ref_load
    from safetensors.torch import save_file as ref_save

    import engine
    import engine.torch

    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, attr in DTYPES.items():
        if (dtype := getattr(torch, attr, None)) is not None:
            size = torch.empty((), dtype=dtype).element_size()
            raw = torch.randint(0, 2 if name == "BOOL" else 256, (37 * 129 * size,), dtype=torch.uint8, generator=g)
            sd[name] = raw.view(dtype).reshape(37, 129)
    sd["F32 scalar"], sd["BF16 empty"] = torch.tensor(3.5), torch.zeros((0, 5), dtype=torch.bfloat16)
    path = os.path.join(scratch, "every-dtype.safetensors")
    ref_save(sd, path)
    try:
        expected = ref_load(path, device=dev)
    except Exception:  # the reference cannot place every dtype on this device: its CPU load
        expected = ref_load(path)
    subset, every = sorted(sd)[::3], list(sd)
    two_d = [n for n in subset if sd[n].dim() == 2]
    with ref_open(path, framework="pt", device=dev) as r:
        sliced = {n: r.get_slice(n)[1:3] for n in two_d}

    def check(got: dict, names, expected: dict) -> tuple[list, dict]:
        matched, mismatched = [], {}
        for n in names:
            t, e = got.get(n), expected[n]
            if t is None:
                mismatched[n] = "missing"
            elif t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
                mismatched[n] = f"{t.dtype}{tuple(t.shape)} vs {e.dtype}{tuple(e.shape)}"
            elif str(t.device) != str(torch.device(dev)) and not (dev == "cpu" and t.device.type == "cpu"):
                mismatched[n] = f"on {t.device}, not {dev}"
            elif not torch.equal(*(x.detach().contiguous().reshape(-1).view(torch.uint8).cpu() for x in (t, e))):
                mismatched[n] = "bytes differ"
            else:
                matched.append(n)
        return matched, mismatched

    def load_into(where, names, gpu_path="auto"):
        dst = {n: torch.empty(sd[n].shape, dtype=sd[n].dtype, device=dev) for n in names}
        engine.load_into(where, dst, gpu_path=gpu_path)
        return dst

    def stream(where, names, gpu_path="auto"):
        return dict(engine.stream(where, framework="pt", device=dev, names=names, gpu_path=gpu_path))

    def get(names, slices=False):
        with engine.safe_open(path, framework="pt", device=dev) as f:
            return {n: f.get_slice(n)[1:3] if slices else f.get_tensor(n) for n in names}

    # the same file over HTTP (the tests' Range server): connections filling the ring's page-locked chunks
    server = serve(scratch)
    server.keepalive = True
    url = server.url(os.path.basename(path))
    entries: dict[str, tuple[Callable, list]] = {  # entry -> (load(names) -> {name: tensor}, names)
        "remote: engine.torch.load_file(url)": (lambda names: engine.torch.load_file(url, device=dev), every),
        "remote: engine.load_into(url)": (lambda names: load_into(url, names), every),
        "remote: engine.stream(url, names=every third)": (lambda names: stream(url, names), subset),
        "engine.torch.load_file": (lambda names: engine.torch.load_file(path, device=dev), every),
        "engine.safe_open get_tensor": (get, every),
        **{f"engine.stream gpu_path={gp}": (partial(stream, path, gpu_path=gp), every) for gp in ("auto", "copy")},
        **{f"engine.load_into gpu_path={gp}": (partial(load_into, path, gpu_path=gp), every) for gp in ("auto", "copy")},
        "selective: engine.stream(names=every third)": (lambda names: stream(path, names), subset),
        "selective: engine.load_into(every third)": (lambda names: load_into(path, names), subset),
        "selective: safe_open get_slice rows 1:3": (lambda names: get(names, slices=True), two_d),
    }
    note = "" if dev.startswith("cuda") else f" (device={dev}: host destinations; gpu_path has no effect)"
    rows = []
    for entry, (load, names) in entries.items():
        reference = sliced if entry.endswith("rows 1:3") else expected
        errors: dict = {}
        try:
            got = load(names)
            if extra := set(got) - set(names):  # a selective load that loaded more than it was asked for
                errors["(selection)"] = f"also loaded {sorted(extra)[:3]}"
        except Exception as exc:  # which tensors it fails on: one at a time
            errors["(whole load)"], got = f"{type(exc).__name__}: {str(exc)[:200]}", {}
            for n in names:
                try:
                    got.update(load([n]))
                except Exception as e:
                    errors[n] = f"{type(e).__name__}: {str(e)[:120]}"
        matched, mismatched = check(got, [n for n in names if n not in errors], reference)
        mismatched.update(errors)
        bad = ", ".join(f"{k} ({v})" for k, v in mismatched.items())
        rows.append({"row": f"compare: {entry}", "status": "failed" if mismatched else "ok",
                     "reason": f"differ: {bad}{note}" if mismatched else f"{len(matched)} matched: {' '.join(matched)}"
                     f"{note}", "matched": matched, "mismatched": mismatched})
    server.stop()
    return rows


# -- output ---------------------------------------------------------------------------------------------


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def _kinds(r: dict) -> str:
    """Host memory growth by kind, MiB: anonymous + page-locked = anonymous + page-locked; file."""
    if r.get("anon_locked_growth_bytes") is None:
        return "-"
    return (f"{_mib(r['anon_locked_growth_bytes'])} = {_mib(r.get('anon_growth_bytes'))} +"
            f" {_mib(r.get('locked_growth_bytes'))}; file {_mib(r.get('file_growth_bytes'))}")


def markdown(meta: dict, rep: Report) -> str:
    eng = meta.get("engine_file") or {}
    lines = [f"gpu_check ({meta.get('mode')}) on {meta.get('device_name')}; {meta.get('date')}; torch"
             f" {meta.get('torch')}; python {meta.get('python')}; {meta.get('cores')} cores; checkpoint"
             f" {meta.get('size')} bytes; engine {eng.get('parent')} (a child's: {eng.get('child')});"
             f" budget {meta.get('budget_s')} s, {meta.get('elapsed_s')} s elapsed"
             f"{'' if meta.get('finished') else ' (still running, or stopped from outside)'}", "",
             f"Host memory growth during the load, peaks every 10 ms (bound {HOST_BOUND >> 20} MiB on a GPU):"
             " RssAnon + the engine's page-locked count; file: RssFile.  Ring records: the samples' median.", "",
             "| phase | row | status | GB/s | s | peak host GiB (before) | host growth MiB (anon+locked = anon"
             " + locked; file) | file after MiB | peak device GiB | ring records | detail |",
             "|---|---|---|---:|---:|---:|---|---:|---:|---|---|"]
    for r in rep.rows:
        cells = ["-" if r.get("gbps") is None else f"{r['gbps']:.2f}",
                 "-" if r.get("seconds") is None else f"{r['seconds']:.3f}",
                 "-" if r.get("host_peak_bytes") is None else
                 f"{_gib(r['host_peak_bytes'])} ({_gib(r.get('host_before_bytes'))})",
                 _kinds(r), _mib(r.get("file_after_bytes")), _gib(r.get("device_peak_bytes")),
                 ring_sweep.records_text(r.get("records")) if "records" in r else "-",
                 (r.get("reason") or "") + (f" checksum {','.join(r['checksums'])}" if r.get("checksums") else "")]
        lines.append(f"| {r['phase']} | {r['row']} | {r['status']} | "
                     + " | ".join(c.replace("|", "/").strip() for c in cells) + " |")
    if rep.pending:
        lines += ["", "Not reached (the run ended, or was stopped, before them): " + "; ".join(rep.pending)]
    if rep.phases:
        lines += ["", "| phase | elapsed s |", "|---|---:|", *(f"| {p['phase']} | {p['elapsed_s']:.1f} |"
                                                              for p in rep.phases)]
    return "\n".join(lines) + "\n"


def summary(meta: dict, rep: Report, total: float) -> str:
    """The counts, the engine, the phases, each load row's rate against InstantTensor's MMAP backend, what
    differs or was left out, and every failure."""
    counts = {s: sum(r["status"] == s for r in rep.rows) for s in ("ok", "failed", "skipped")}
    eng = meta.get("engine_file") or {}
    out = [f"== gpu_check {meta['mode']} on {meta.get('device_name')}: {counts['ok']} ok, {counts['failed']} failed,"
           f" {counts['skipped']} skipped in {total:.0f} s (budget {meta['budget_s']:.0f} s)",
           f"engine: parent {eng.get('parent')}; child {eng.get('child')}",
           "phases: " + ", ".join(f"{p['phase']} {p['elapsed_s']:.0f} s" for p in rep.phases),
           *(f"{r['row']}: {r['reason']}" for r in rep.rows if r["phase"] == "pytest" and r.get("counts"))]
    ref = next((r for r in rep.rows if r["row"] == "InstantTensor Backend.MMAP" and r.get("gbps")), None)
    loads = ("loads", "per-key", "warm-start", "reference", "onload", "long")
    for r in rep.rows:
        if r.get("gbps") is not None and r["phase"] in loads:
            ratio = f" {r['gbps'] / ref['gbps']:.2f}x IT-MMAP" if ref else ""
            out.append(f"  {r['row'][:52]:52s} {r['gbps']:7.2f} GB/s{ratio} n={len(r.get('samples', []))} host MiB"
                       f" {_kinds(r)} device {_gib(r.get('device_peak_bytes'))} GiB")
    if best := next((r for r in rep.rows if r["row"] == "sweep: the fastest configuration's bytes"), None):
        out.append(f"  sweep: fastest {best['reason']}")
    if over := [r["row"] for r in rep.rows if r.get("host_bounded") is False]:
        out.append(f"  over the host bound (anonymous + page-locked growth > {HOST_BOUND >> 20} MiB): {'; '.join(over)}")
    sums = {c for r in rep.rows if r["phase"] in loads[:4] for c in r.get("checksums", [])}
    if len(sums) > 1:
        out.append(f"  checksums differ between rows: {sorted(sums)}")
    if budget := [r["row"] for r in rep.rows if r["status"] == "skipped" and (r["reason"] or "").startswith("budget")]:
        out.append(f"  not run for the budget: {'; '.join(budget)}")
    out += [f"FAILED {r['phase']}: {r['row']}: {(r['reason'] or '')[:150]}" for r in rep.rows if r["status"] == "failed"]
    return "\n".join(out)


# -- the commands ---------------------------------------------------------------------------------------


def run_sweep(args) -> int:
    """``--sweep``: the extensions built in place if they are not, then ring_sweep.py's whole grid."""
    budget, failed = args.budget or SWEEP_BUDGET, None
    if not built_fresh():  # a fresh checkout on a GPU host has no extensions until they are built
        print("== build (the extensions are not built in this checkout)", flush=True)
        rc, out, err = _run(_build_command(), min(150.0, START + budget - time.monotonic() - 90),
                            harness.child_env(NUMBA_ENABLE_CUDASIM=None))
        failed = None if rc == 0 else f"build: {'timed out' if rc is None else _tail(err or out)}"
    base = os.path.join(args.out, "gpu_check-sweep")
    size = args.size or SIZE["long" if args.device.startswith("cuda") else "cpu"]
    rc = ring_sweep.main(["--device", args.device, "--size", size, "--dir", args.dir, "--budget", str(budget),
                          "--json", base + ".json", "--md", base + ".md"], start=START)
    if failed:
        print(f"FAILED {failed}")
    return 1 if failed else rc


def run_check(args) -> int:
    cpu = not args.device.startswith("cuda")
    budget = Budget(args.budget or (LONG_BUDGET if args.long else BUDGET), start=START)
    size = harness.parse_size(args.size or SIZE["cpu" if cpu else "long" if args.long else "check"])
    meta = {"mode": "warm", "device": args.device, "device_name": args.device, "size": size, "budget_s": budget.seconds,
            "python": platform.python_version(), "cores": os.cpu_count(), "long": args.long, "finished": False,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:]}
    base = os.path.join(args.out, "gpu_check-warm")
    rep = Report(base, meta)
    # pytest's reports, the compare file and the wheels: not under --out, which the device tool copies back
    scratch = tempfile.mkdtemp(prefix="gpu-check-")
    steps = plan(Check(args, budget, rep, scratch), size, args.inject_row)
    rep.plan([name for _, names, _ in steps for name in names])
    rep.write()
    print(f"gpu_check warm on {args.device}: budget {budget.seconds:.0f} s, checkpoint {size} bytes", flush=True)
    phase_t0, current = time.monotonic(), None
    for phase, names, run in [*steps, ("", [], lambda: None)]:
        if phase != current:
            if current is not None:
                rep.phases.append({"phase": current, "elapsed_s": round(time.monotonic() - phase_t0, 1)})
            if phase:
                print(f"== {phase} ({budget.left():.0f} s of the budget left)", flush=True)
            phase_t0, current = time.monotonic(), phase
        run()
        rep.done(names)
    total = time.monotonic() - START
    rep.meta.update(total_s=round(total, 1), finished=True)
    rep.write()
    shutil.rmtree(scratch, ignore_errors=True)
    print(summary(rep.meta, rep, total))
    print(f"wrote {base}.json and {base}.md")
    return 1 if any(r["status"] == "failed" for r in rep.rows) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu_check-warm.json and .md")
    ap.add_argument("--device", default="cuda:0", help="cuda:0, or cpu for the dry run")
    ap.add_argument("--budget", type=float, default=None, help=f"seconds from the start (default {BUDGET:.0f};"
                    f" {LONG_BUDGET:.0f} with --long, {SWEEP_BUDGET:.0f} with --sweep)")
    ap.add_argument("--size", default=None, help=f"checkpoint size (default {SIZE})")
    ap.add_argument("--long", action="store_true", help="a 16.06 GB checkpoint and more rows")
    ap.add_argument("--wheels", default=None, help="folder of the peers' wheels")
    ap.add_argument("--dir", default=bench_gpu.DIR, help="where the checkpoint is made (and reused)")
    ap.add_argument("--skip", default="", help="phases to leave out, e.g. build,pytest")
    ap.add_argument("--sweep", action="store_true", help="the ring's whole grid instead (gpu_check-sweep.json, .md)")
    # a row with no implementation, first among the load rows: a failing row is reported, the rest run
    ap.add_argument("--inject-row", default=os.environ.get("GPU_CHECK_INJECT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    return run_sweep(args) if args.sweep else run_check(args)


if __name__ == "__main__":
    sys.exit(main())
