"""Every GPU check of the engine in one command, within 9 minutes on a 16-core H100 host;
``--sweep``, a second command of at most 4 minutes, measures the chunk ring's geometry.

Phases, each with its own time budget and all of them within the whole check's (elapsed
time printed per phase), none stopping the next; every row ends ``ok``, ``failed`` (with the
exception text, exit code or timeout) or ``skipped`` (with the reason):

1. ``wheels``: the peers' wheels of ``--wheels DIR`` installed with ``pip install --no-index
   --no-deps --target OUT/site`` (one call per wheel), put on the children's PYTHONPATH;
2. ``build``: ``python setup.py -q build_ext --inplace``;
3. ``engine``: the engine the parent and a child import, and the child's ring extension,
   must be this checkout's (the script puts its checkout first on ``sys.path`` and on the
   children's PYTHONPATH: nothing needs to be installed);
4. ``pytest``: ``pytest -m cuda`` over the suite, then the device-kernel modules on the real
   GPU (Numba's simulator switched off); pass / fail / skip counts;
5. ``compare``: byte for byte against the reference (``safetensors``) for every dtype it
   loads, then a selective load, through each engine entry point, on the device; also the
   same file over HTTP (the tests' Range server on 127.0.0.1, keep-alive) through
   ``load_file``, ``load_into`` and ``stream``: the remote loads' own copy path;
6. ``checkpoint``: a Llama-3-8B-shaped checkpoint of ``--size`` (16.06 GB, 4 shards; made
   once, reused from ``--dir``);
7. ``warm`` (or ``cold`` with ``--modes cold``): the file->GPU rows of scripts/bench_gpu.py,
   each sample a fresh process, rounds interleaved while the budget lasts (the phase takes
   what the earlier ones left of the whole check's): the limits (pinned host-to-device, page
   cache to pinned), every engine entry point, the per-key loop of accelerate's
   ``load_state_dict`` (``safe_open(f, device=...)``, ``get_tensor(k)`` for every key)
   through the engine and the reference, the reference's ``load_file``, InstantTensor
   ``Backend.MMAP`` and fastsafetensors; in the warm phase, once those have their samples,
   a reload (``load_into`` with rings and file mappings kept, the second load in a process
   timed).  Each row reports the host memory peak and, by kind, the growth of anonymous,
   page-locked (the engine's count) and mapped file memory during the load
   (scripts/host_memory.py) and the mapped file memory left after it, and the device
   memory peak; on a GPU a row whose anonymous + page-locked growth passes
   :data:`HOST_BOUND` is marked over bound;
8. ``onload``: the ``stats=True`` and ``quantize="int8"`` load rates, same measurements;
9. ``emulated`` (``--device cpu`` only): the engine's device pipeline over every shard, bytes
   checked: the chunk ring on the emulated CUDA runtime (tests/emucudart), and the slot
   path on tests/emulated.py's device.

Writes ``gpu_check-<mode>.json`` and ``gpu_check-<mode>.md`` to ``--out DIR`` and prints a
one-screen summary.  Exit status 0 when no row failed, 1 otherwise.

``--sweep`` (scripts/ring_sweep.py): the checkpoint made or reused, then one process times a
grid of the ring's chunk size, chunks in flight, copy threads, copy source and stores within
``--sweep-budget`` seconds (210 by default), each configuration loaded twice; writes
``gpu_check-sweep.json`` and ``gpu_check-sweep.md`` and prints the best geometry as an
``ENGINE_RING=chunk_mib,chunks,threads`` line.  The extensions are built in place first if
the checkout has none.

On a lent GPU host (the device tool runs in the checkout; ``.whl/`` is git-ignored, so it is
carried only when named)::

    mkdir -p .whl && cp /work/shared/wheels/*.whl .whl/
    # device tool: carry [".whl"], timeout_s 600, command:
    python3 scripts/gpu_check.py --wheels .whl --out $OUT/gpu-check
    # the sweep, a second command on the same machine (it reuses the checkpoint and the
    # build), timeout_s 270:
    python3 scripts/gpu_check.py --sweep --out $OUT/gpu-check

Dry mode, on a machine without a GPU (well under 2 minutes; CI runs it so that the script
cannot rot): ``python scripts/gpu_check.py --device cpu --size 64MB --out DIR``.  Device rows
load to ``device="cpu"`` there and say so; rows that need CUDA or a missing package say why
they were skipped.  ``--skip build,pytest`` leaves phases out (their rows say so).
``--device cpu --sweep`` is the sweep's dry run: the emulated CUDA runtime, a small grid, a
64 MB checkpoint, every configuration's bytes checked, in seconds.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # imported from elsewhere (a test): its sibling modules
    sys.path.insert(0, HERE)
import checkout_path  # noqa: E402

# this checkout's engine in this process and in every child: on a GPU host it is built in
# place by the build phase and installed nowhere (the parent imports it only after that phase)
ROOT = checkout_path.use_checkout()
import bench_gpu  # noqa: E402
import ring_sweep  # noqa: E402

#: the whole check on a GPU host, seconds: each phase also ends when what is left of this
#: would not leave the later phases their :data:`RESERVE` (9 minutes less the start and the writing)
TOTAL_BUDGET = 525
#: seconds per phase at most; the load phase takes what the earlier phases left
BUDGETS = {"wheels": 20, "build": 75, "engine": 20, "pytest": 115, "compare": 40, "checkpoint": 90,
           "warm": 260, "cold": 260, "onload": 40, "emulated": 30}
#: seconds kept for a phase while the phases before it run
RESERVE = {"onload": 40, "emulated": 15}
#: the peers and the name their wheel starts with
PEERS = {"instanttensor": "instanttensor", "fastsafetensors": "fastsafetensors",
         "runai_model_streamer": "runai_model_streamer"}
#: the load rows: each engine entry point once (``gpu_path`` auto and copy are the same ring,
#: so one of them), the per-key loop of accelerate, the reference, the peers; three fresh-process
#: samples each fit the warm phase's budget on an H100 host
LOAD_ROWS = [
    "limit: pinned host-to-device 1 GiB",
    "limit: page cache to pinned, split read, 16 threads",
    "engine load_file(f) per shard",
    "engine load_file(directory)",
    "engine safe_open(directory).get_tensors()",
    "engine stream(shards) auto",
    "engine load_into(directory)",
    "engine safe_open(f, device) get_tensor per key",
    "reference safe_open(f, device) get_tensor per key",
    "reference load_file(f, device) per shard",
    "InstantTensor Backend.MMAP",
    "fastsafetensors (nogds, buffered)",
]
#: rows of the warm phase only, sampled after every load row has its samples: a reload reads
#: the file in with its untimed first load
RELOAD_ROWS = ["engine load_into(directory) reload, staging and mappings kept"]
ONLOAD_ROWS = ["engine stream(f) stats=True per shard", "engine stream(f) quantize=int8 per shard"]
#: what a device load may add to the host's anonymous and page-locked memory together, whatever
#: the model's size (the ring's chunks, counted in both, and everything else)
HOST_BOUND = 512 << 20
GPU_PATHS = ("auto", "copy")
PYTEST_RUNS = {
    "pytest -m cuda": ["-m", "cuda", "tests"],
    "pytest device-kernel modules": ["tests/test_device.py", "tests/test_cuda_kernels.py",
                                     "tests/test_cudart.py", "tests/test_load_hooks.py"],
}
#: the reference's dtypes (torch attribute names); a torch without one leaves it out
DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64", "U64": "uint64", "U32": "uint32",
    "U16": "uint16",
}


class Report:
    """Rows and phase timings, printed as they come and written at the end."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.phases: list[dict] = []

    def add(self, phase: str, row: str, status: str, reason: str | None = None, **fields) -> dict:
        record = {"phase": phase, "row": row, "status": status, "reason": reason, **fields}
        self.rows.append(record)
        figure = f" {fields['gbps']:.2f} GB/s" if fields.get("gbps") is not None else ""
        text = f"  {status:7s} {row}{figure}{': ' + reason if reason else ''}"
        print(text if len(text) <= 150 else text[:147] + "...", flush=True)
        return record


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


# -- phases ---------------------------------------------------------------------------------------------


def phase_wheels(rep: Report, wheels: str | None, site: str, deadline: float) -> list[str]:
    """Install each peer's wheel; returns the folders to put on the children's PYTHONPATH."""
    if not wheels:
        for peer in PEERS:
            rep.add("wheels", f"wheel: {peer}", "skipped", "no --wheels folder given")
        return []
    for peer, stem in PEERS.items():
        found = sorted(glob.glob(os.path.join(os.path.abspath(wheels), f"{stem}-*.whl")))
        if not found:
            rep.add("wheels", f"wheel: {peer}", "skipped", f"no {stem}-*.whl in {wheels}")
            continue
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, found[-1]]
        rc, out, err = _run(cmd, deadline - time.monotonic())
        if rc == 0:
            rep.add("wheels", f"wheel: {peer}", "ok", None, wheel=os.path.basename(found[-1]))
        else:
            why = f"timed out after {BUDGETS['wheels']} s" if rc is None else f"pip exit code {rc}: {_tail(err or out)}"
            rep.add("wheels", f"wheel: {peer}", "failed", why)
    return [site] if os.path.isdir(site) else []


def phase_build(rep: Report, deadline: float) -> None:
    t0 = time.monotonic()
    rc, out, err = _run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], deadline - t0)
    if rc == 0:
        rep.add("build", "build_ext --inplace", "ok", None, seconds=round(time.monotonic() - t0, 1))
    else:
        rep.add("build", "build_ext --inplace", "failed",
                "timed out" if rc is None else f"exit code {rc}: {_tail(err or out)}")


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


def phase_pytest(rep: Report, scratch: str, deadline: float, pythonpath: list[str]) -> None:
    # the real CUDA target: Numba's simulator off (it must be chosen before Numba is imported)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *pythonpath, *filter(None, [os.environ.get("PYTHONPATH")])])
    for i, (name, selection) in enumerate(PYTEST_RUNS.items()):
        left = deadline - time.monotonic()
        if left < 5:
            rep.add("pytest", name, "skipped", "the pytest phase's time budget was spent")
            continue
        xml = os.path.join(scratch, f"pytest-{i}.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={xml}",
               *selection]
        t0 = time.monotonic()
        rc, out, err = _run(cmd, left, env)
        seconds = round(time.monotonic() - t0, 1)
        if rc is None:
            rep.add("pytest", name, "failed", f"timed out after {left:.0f} s: last line {_tail(out)!r}")
            continue
        if not os.path.exists(xml):
            rep.add("pytest", name, "failed", f"exit code {rc}: {_tail(err or out)}")
            continue
        c = _junit_counts(xml)
        text = f"{c['passed']} passed, {c['failures'] + c['errors']} failed, {c['skipped']} skipped"
        fields = {"counts": c, "seconds": seconds, "command": " ".join(cmd[1:])}
        if rc == 0 and c["passed"] == 0 and c["skipped"]:
            rep.add("pytest", name, "skipped", f"{text}; every test skipped itself: {'; '.join(c['skip_reasons'])}",
                    **fields)
        elif rc == 0:
            rep.add("pytest", name, "ok", text, **fields)
        else:
            rep.add("pytest", name, "failed", f"exit code {rc}: {text}: {', '.join(c['failing'][:3])}", **fields)


def phase_compare(rep: Report, dev: str, scratch: str, deadline: float, env: dict) -> None:
    cmd = [sys.executable, os.path.abspath(__file__), "--child-compare", "--device", dev, "--out", scratch]
    rc, out, err = _run(cmd, deadline - time.monotonic(), env)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        why = "timed out" if rc is None else f"exit code {rc}: {_tail(err or out)}"
        rep.add("compare", "compare with the reference", "failed", why)
        return
    got = json.loads(lines[-1])
    note = "" if dev.startswith("cuda") else f" (device={dev}: host destinations; gpu_path has no effect)"
    for entry, r in got["entries"].items():
        if r["mismatched"]:
            bad = ", ".join(f"{k} ({v})" for k, v in r["mismatched"].items())
            rep.add("compare", f"compare: {entry}", "failed", f"differ: {bad}{note}", matched=r["matched"],
                    mismatched=r["mismatched"])
        else:
            rep.add("compare", f"compare: {entry}", "ok", f"{len(r['matched'])} matched: {' '.join(r['matched'])}{note}",
                    matched=r["matched"], mismatched={})


def phase_checkpoint(rep: Report, folder: str, size: int, deadline: float, env: dict) -> list[str] | None:
    """Make (or reuse) the checkpoint in a child, which also counts its tensor bytes: the
    parent imports nothing of the engine for it."""
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); import bench_gpu;"
            " files = bench_gpu.make_checkpoint(sys.argv[2], int(sys.argv[3]));"
            " print(json.dumps({'files': files, 'bytes': bench_gpu.tensor_bytes(files)}))")
    t0 = time.monotonic()
    rc, out, err = _run([sys.executable, "-c", code, HERE, folder, str(size)], deadline - t0, env)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        rep.add("checkpoint", "checkpoint", "failed", "timed out" if rc is None else f"exit code {rc}: {_tail(err)}")
        return None
    got = json.loads(lines[-1])
    files, nbytes = got["files"], got["bytes"]
    rep.add("checkpoint", "checkpoint", "ok", f"{len(files)} shards, {nbytes / 1e9:.2f} GB of tensors in {folder}",
            seconds=round(time.monotonic() - t0, 1), bytes=nbytes)
    return files


def phase_loads(rep: Report, phase: str, rows: list[str], files: list[str] | None, dev: str, mode: str,
                runs: int, deadline: float, env: dict, path: list[str], later: list[str] | None = None) -> None:
    """Samples in rounds (every row once, then again, ``runs`` rounds while the budget
    lasts); the rows of ``later`` only once every row of ``rows`` has had its rounds."""
    later = later or []
    every = rows + later
    if files is None:
        for impl in every:
            rep.add(phase, impl, "skipped", "no checkpoint (its phase failed)")
        return
    if mode == "warm":
        bench_gpu.warm(files)
    samples: dict[str, list[dict]] = {impl: [] for impl in every}
    skipped: dict[str, str] = {}
    for impl in every:
        why = bench_gpu.skip_reason(impl, dev, path)
        if why:
            skipped[impl] = why
    cache = mode
    # on a GPU one sample at a time (they are timed); a dry run on CPU times nothing that
    # matters and runs a few at once
    parallel = 1 if dev.startswith("cuda") else 3

    def one(impl: str) -> None:
        nonlocal cache
        left = min(300.0, deadline - time.monotonic())
        # a sample that would not end inside the budget is not started: a row keeps the
        # samples it has, and a row with none says the budget ran out
        if left < 1 or (samples[impl] and left < 1.5 * max(s.get("wall", 0) for s in samples[impl])):
            return
        if mode == "cold":
            cache = bench_gpu.drop_cache(files)
        t0 = time.monotonic()
        s = bench_gpu.sample(impl, files, dev, left, env)
        s["wall"] = time.monotonic() - t0
        samples[impl].append(s)

    for group in (rows, later):
        for _ in range(runs):
            todo = [i for i in group if i not in skipped and not any("error" in s for s in samples[i])]
            if parallel == 1:
                for impl in todo:
                    one(impl)
            else:
                with ThreadPoolExecutor(parallel) as pool:
                    list(pool.map(one, todo))
    note = "" if dev.startswith("cuda") else f"device={dev}: a host load (no GPU), {parallel} samples at once; "
    for impl in every:
        if impl in skipped:
            rep.add(phase, impl, "skipped", skipped[impl])
            continue
        if not samples[impl]:
            rep.add(phase, impl, "skipped", f"the {phase} phase's time budget was spent")
            continue
        r = bench_gpu.summarise(samples[impl], cache)
        status, reason = r.pop("status"), r.pop("reason")
        if status == "ok":
            reason = f"{note}{len(samples[impl])} sample(s)"
            # a host load's destination is anonymous memory itself: the bound is a device load's
            if dev.startswith("cuda") and r.get("anon_locked_growth_bytes") is not None:
                r["host_bound_bytes"] = HOST_BOUND
                r["host_bounded"] = r["anon_locked_growth_bytes"] <= HOST_BOUND
                if not r["host_bounded"]:
                    reason += (f"; over bound: anonymous + page-locked memory grew"
                               f" {r['anon_locked_growth_bytes'] / 2**20:.0f} MiB")
        rep.add(phase, impl, status, reason, **r)


#: the emulated phase's rows: the chunk ring (device loads of local files) and the slot path
#: (loads with a hook, remote files, device operations without a CUDA runtime for a ring);
#: ``--child-emulated`` names them by the key
EMULATED = {
    "ring": "emulated runtime: chunk ring, every shard in one load",
    "slots": "emulated device: slot path, every shard in one load",
}


def phase_emulated(rep: Report, files: list[str] | None, deadline: float, env: dict) -> None:
    for kind, row in EMULATED.items():
        if files is None:
            rep.add("emulated", row, "skipped", "no checkpoint (its phase failed)")
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--child-emulated", kind, "--files", *files]
        rc, out, err = _run(cmd, deadline - time.monotonic(), env)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if rc != 0 or not lines:
            rep.add("emulated", row, "failed", "timed out" if rc is None else f"exit code {rc}: {_tail(err or out)}")
            continue
        r = json.loads(lines[-1])
        what = ("tests/emucudart's runtime (memcpy on a stream thread)" if kind == "ring" else
                "tests/emulated.py's device (Python-thread copies)")
        rep.add("emulated", row, "ok", f"bytes identical to the files; {what}, not a GPU rate",
                gbps=r["bytes"] / r["seconds"] / 1e9, seconds=r["seconds"], bytes=r["bytes"], copies=r["copies"])


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
    # loads' own device copy path, connections filling the pinned slots
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
    tests/emucudart; ``"slots"``, the slot path on tests/emulated.py's device (which has no
    runtime for a ring).  Every byte checked against the files, nothing left page-locked."""
    import mmap

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import engine
    from engine import device_ring, pipeline
    from engine.plan import plan_reads

    fds, sources, dst, base = [], [], {}, 0
    headers = [engine.read_header(f) for f in files]
    if kind == "ring":
        from emucudart import EmulatedRingOps, Emulator

        emulator = Emulator()
        ops = EmulatedRingOps(emulator)
    else:
        from emulated import EmulatedDevice

        ops = EmulatedDevice(delay=0)
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
        t0 = time.perf_counter()
        nbytes = pipeline.run_sources(sources, pipeline.Destination(device_targets=dst, device_ops=ops),
                                      slot_bytes=8 << 20)
        if kind == "ring":
            seconds = time.perf_counter() - t0  # the ring has synchronized its stream
            device_ring.release_rings()
            ops.close()
            st = emulator.stats()
            if st["registered"] or st["pageable"] or st["wrong_device"] or st["events"]:
                raise AssertionError(f"the ring left the emulated runtime unclean: {st}")
            copies = st["copies"]
        else:
            ops.close()  # every queued copy has run
            seconds = time.perf_counter() - t0
            ops.assert_clean()
            copies = ops.copies
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
    return {"seconds": seconds, "bytes": nbytes, "copies": copies}


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


def markdown(meta: dict, rep: Report) -> str:
    eng = meta.get("engine_file") or {}
    lines = [f"gpu_check ({meta['mode']}) on {meta['device_name']}; {meta['date']}; torch {meta['torch']};"
             f" python {meta['python']}; {meta['cores']} cores; checkpoint {meta['size']} bytes;"
             f" engine {eng.get('parent')} (a child's: {eng.get('child')})", "",
             "Host memory growth during the load, MiB, peaks sampled every 10 ms: anonymous + page-locked"
             f" (bound {HOST_BOUND >> 20} MiB on a GPU) = anonymous (RssAnon) + page-locked (the engine's count);"
             " file: mapped file pages (RssFile); after: mapped file pages left after the load.", "",
             "| phase | row | status | GB/s | s | peak host GiB (before) | host growth MiB (anon+locked = anon"
             " + locked; file) | file after MiB | peak device GiB | detail |",
             "|---|---|---|---:|---:|---:|---|---:|---:|---|"]
    for r in rep.rows:
        gbps = f"{r['gbps']:.2f}" if r.get("gbps") is not None else "-"
        sec = f"{r['seconds']:.3f}" if r.get("seconds") is not None else "-"
        host = "-" if r.get("host_peak_bytes") is None else \
            f"{_gib(r['host_peak_bytes'])} ({_gib(r.get('host_before_bytes'))})"
        detail = (r.get("reason") or "").replace("|", "/")
        if r.get("checksums"):
            detail += f" checksum {','.join(r['checksums'])}"
        lines.append(f"| {r['phase']} | {r['row']} | {r['status']} | {gbps} | {sec} | {host} | {_kinds(r)} |"
                     f" {_mib(r.get('file_after_bytes'))} | {_gib(r.get('device_peak_bytes'))} | {detail.strip()} |")
    lines += ["", "| phase | budget s | elapsed s |", "|---|---:|---:|"]
    lines += [f"| {p['phase']} | {p['budget_s']} | {p['elapsed_s']:.1f} |" for p in rep.phases]
    return "\n".join(lines) + "\n"


def summary(meta: dict, rep: Report, total: float) -> str:
    counts = {s: sum(r["status"] == s for r in rep.rows) for s in ("ok", "failed", "skipped")}
    eng = meta.get("engine_file") or {}
    out = [f"== gpu_check {meta['mode']} on {meta['device_name']}: {counts['ok']} ok, {counts['failed']} failed,"
           f" {counts['skipped']} skipped in {total:.0f} s",
           f"engine: parent {eng.get('parent')}; child {eng.get('child')}",
           "phases: " + ", ".join(f"{p['phase']} {p['elapsed_s']:.0f}/{p['budget_s']} s" for p in rep.phases)]
    for r in rep.rows:
        if r["phase"] == "pytest" and r.get("counts"):
            out.append(f"{r['row']}: {r['reason']}")
    ref = next((r for r in rep.rows if r["row"] == "InstantTensor Backend.MMAP" and r.get("gbps")), None)
    for r in rep.rows:
        if r.get("gbps") is not None and r["phase"] in ("warm", "cold", "onload"):
            ratio = f" {r['gbps'] / ref['gbps']:.2f}x IT-MMAP" if ref else ""
            n = len(r.get("samples", []))
            out.append(f"  {r['row'][:52]:52s} {r['gbps']:7.2f} GB/s{ratio} n={n} host MiB {_kinds(r)}"
                       f" device {_gib(r.get('device_peak_bytes'))} GiB")
    over = [r["row"] for r in rep.rows if r.get("host_bounded") is False]
    if over:
        out.append(f"  over the host bound (anonymous + page-locked growth > {HOST_BOUND >> 20} MiB):"
                   f" {'; '.join(over)}")
    sums = {c for r in rep.rows if r["phase"] in ("warm", "cold") for c in r.get("checksums", [])}
    if len(sums) > 1:
        out.append(f"  checksums differ between rows: {sorted(sums)}")
    for r in rep.rows:
        if r["status"] == "failed":
            out.append(f"FAILED {r['phase']}: {r['row']}: {(r['reason'] or '')[:150]}")
    return "\n".join(out)


def _meta(dev: str, env: dict) -> dict:
    code = ("import json, torch; c = torch.cuda.is_available();"
            " print(json.dumps({'torch': torch.__version__, 'cuda': c,"
            " 'name': torch.cuda.get_device_name(0) if c else 'no CUDA device'}))")
    rc, out, err = _run([sys.executable, "-c", code], 120, env)
    info = json.loads(out.splitlines()[-1]) if rc == 0 and out.strip() else \
        {"torch": f"unavailable ({_tail(err)})", "cuda": False, "name": "no CUDA device"}
    return {"device": dev, "device_name": info["name"] if dev.startswith("cuda") else f"{dev} (no GPU used)",
            "cuda_available": info["cuda"], "torch": info["torch"], "python": platform.python_version(),
            "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def child_engine(env: dict, timeout: float) -> tuple[str, str]:
    """The files of ``engine`` and ``engine._ring`` that a child imports (or why not)."""
    cmd = [sys.executable, os.path.join(HERE, "bench_gpu.py"), "--where"]
    rc, out, err = _run(cmd, timeout, env)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    got = json.loads(lines[-1]) if rc == 0 and lines else {}
    why = "timed out" if rc is None else f"exit code {rc}: {_tail(err or out)}"
    return got.get("engine_file") or why, got.get("ring_file") or why


def phase_engine(rep: Report, deadline: float, env: dict) -> dict:
    """Which engine the parent and a child import: this checkout's, extensions included (an
    editable install of another checkout would otherwise lend its extensions to a checkout
    that has none built)."""
    t0 = time.monotonic()
    parent = checkout_path.engine_origin()
    child, ring = child_engine(env, deadline - time.monotonic())
    where = {"parent": parent, "child": child, "child_ring": ring}
    text = f"parent {parent}; child {child}; its ring extension {ring}"
    seconds = round(time.monotonic() - t0, 1)
    if all(checkout_path.from_checkout(p) for p in where.values()):
        rep.add("engine", "engine from this checkout", "ok", text, engine_file=where, seconds=seconds)
    else:
        rep.add("engine", "engine from this checkout", "failed", f"not all under {ROOT}/engine: {text}",
                engine_file=where, seconds=seconds)
    return where


def run_sweep(args) -> int:
    """``--sweep``: the extensions built in place if they are not, the checkpoint made or
    reused, then scripts/ring_sweep.py within ``--sweep-budget`` seconds of the start."""
    start = time.monotonic()
    cpu = not args.device.startswith("cuda")
    size = bench_gpu.parse_size(args.size or ("64MB" if cpu else "16.06GB"))
    folder = os.path.join(args.dir, f"llama3-shapes-{size}")
    env = {**{k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"},
           "PYTHONPATH": checkout_path.pythonpath()}
    rep = Report()
    meta = {"device": args.device, "size": size, "python": platform.python_version(), "cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:],
            "device_name": args.device if not cpu else f"{args.device} (the emulated CUDA runtime, no GPU)"}

    def files_for(deadline: float) -> list[str] | None:
        # a fresh checkout on a GPU host has no extensions until they are built in place
        if not checkout_path.from_checkout(child_engine(env, 60)[1]):
            print("== build (the extensions are not built in this checkout)", flush=True)
            phase_build(rep, min(time.monotonic() + 2 * BUDGETS["build"], deadline - 90))
        print(f"== checkpoint ({size} bytes in {folder})", flush=True)
        # the sweep needs about a minute of the budget after the checkpoint to say anything
        return phase_checkpoint(rep, folder, size, deadline - 60, env)

    rc = ring_sweep.run(args.out, args.device, files_for, args.sweep_budget, start, _run, env, meta)
    failed = [r for r in rep.rows if r["status"] == "failed"]
    return 1 if failed else rc


def _deadline(phase: str, phases: list[str], t0: float, start: float, budgets: dict) -> float:
    """When ``phase`` (started at ``t0``) must end: its own budget, and what the whole check
    has left once the later phases' :data:`RESERVE` is kept."""
    later = phases[phases.index(phase) + 1 :]
    return min(t0 + budgets[phase], start + TOTAL_BUDGET - sum(RESERVE.get(p, 0) for p in later))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for gpu_check-<mode>.json and .md (required)")
    ap.add_argument("--device", default="cuda:0", help="cuda:0, or cpu for the dry mode")
    ap.add_argument("--size", default=None, help="checkpoint size (default 16.06GB; 64MB with --device cpu)")
    ap.add_argument("--modes", default="warm", choices=["warm", "cold"])
    ap.add_argument("--wheels", default=None, help="folder of the peers' wheels, installed in a scratch folder")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "engine-bench-gpu"),
                    help="where the checkpoint is made (and reused)")
    ap.add_argument("--runs", type=int, default=None, help="samples per load row (default 3 on a GPU, 1 on cpu)")
    ap.add_argument("--skip", default="", help="phases to leave out, comma-separated (e.g. build,pytest)")
    ap.add_argument("--sweep", action="store_true",
                    help="instead of the check: time the chunk ring's geometry grid (scripts/ring_sweep.py) and"
                         " write gpu_check-sweep.json and .md; with --device cpu, a dry run on the emulated runtime")
    ap.add_argument("--sweep-budget", type=float, default=210.0,
                    help="seconds the whole --sweep may take, the checkpoint included (default 210)")
    # a row whose implementation does not exist, run first in the load phase: checks that a failing
    # row is reported and the rest still run
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
    if args.sweep:
        return run_sweep(args)

    start = time.monotonic()
    cpu = not args.device.startswith("cuda")
    size = bench_gpu.parse_size(args.size or ("64MB" if cpu else "16.06GB"))
    runs = args.runs or (1 if cpu else 3)
    skip = {p.strip() for p in args.skip.split(",") if p.strip()}
    os.makedirs(args.out, exist_ok=True)
    # pytest's reports, the compare file and the installed wheels: not under --out, which the
    # device tool copies back
    scratch = tempfile.mkdtemp(prefix="gpu-check-")
    site = os.path.join(scratch, "site")
    rep = Report()
    mode = args.modes
    # a dry run's machine (CI's) may have two cores: a build from nothing takes longer there
    budgets = {**BUDGETS, "build": 2 * BUDGETS["build"]} if cpu else BUDGETS

    phases = ["wheels", "build", "engine"] + (["pytest", "compare"] if mode == "warm" else []) + \
        ["checkpoint", mode, "onload"] + (["emulated"] if cpu else [])
    state: dict = {"path": [], "files": None, "meta": None, "engine": {}}

    def env() -> dict:
        return {**{k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"},
                "PYTHONPATH": checkout_path.pythonpath(*state["path"])}

    state["meta"] = _meta(args.device, env())  # before the phases: outside their budgets
    print(f"device {state['meta']['device_name']}; torch {state['meta']['torch']}", flush=True)
    if not cpu and not state["meta"]["cuda_available"]:
        print(f"no CUDA device visible to torch: the device rows will fail ({args.device})", flush=True)
    folder = os.path.join(args.dir, f"llama3-shapes-{size}")
    load_rows = ([args.inject_row] if args.inject_row else []) + LOAD_ROWS
    for phase in phases:
        t0 = time.monotonic()
        deadline = _deadline(phase, phases, t0, start, budgets)
        budget = max(0, round(deadline - t0))
        print(f"== {phase} (budget {budget} s)", flush=True)
        try:
            if phase in skip:
                rep.add(phase, f"phase {phase}", "skipped", f"--skip {phase}")
            elif phase == "wheels":
                state["path"] = phase_wheels(rep, args.wheels, site, deadline)
            elif phase == "build":
                phase_build(rep, deadline)
            elif phase == "engine":
                state["engine"] = phase_engine(rep, deadline, env())
            elif phase == "pytest":
                phase_pytest(rep, scratch, deadline, state["path"])
            elif phase == "compare":
                phase_compare(rep, args.device, scratch, deadline, env())
            elif phase == "checkpoint":
                state["files"] = phase_checkpoint(rep, folder, size, deadline, env())
            elif phase in ("warm", "cold"):
                phase_loads(rep, phase, load_rows, state["files"], args.device, mode, runs, deadline, env(),
                            state["path"], later=RELOAD_ROWS if phase == "warm" else [])
            elif phase == "onload":
                phase_loads(rep, phase, ONLOAD_ROWS, state["files"], args.device, mode, runs, deadline, env(),
                            state["path"])
            elif phase == "emulated":
                phase_emulated(rep, state["files"], deadline, env())
        except Exception as exc:  # a phase that breaks is a failed row; the later phases still run
            where = traceback.extract_tb(exc.__traceback__)[-1]
            rep.add(phase, f"phase {phase}", "failed",
                    f"{type(exc).__name__}: {exc} ({os.path.basename(where.filename)}:{where.lineno})")
        elapsed = time.monotonic() - t0
        rep.phases.append({"phase": phase, "budget_s": budget, "elapsed_s": round(elapsed, 1)})
        print(f"   {phase}: {elapsed:.1f} s (total {time.monotonic() - start:.0f} s)", flush=True)

    total = time.monotonic() - start
    meta = {**state["meta"], "mode": mode, "size": size, "runs": runs, "argv": sys.argv[1:],
            "total_s": round(total, 1), "engine_file": state["engine"]}
    for r in rep.rows:  # the JSON keeps each sample's figures, not its child's wall time
        for s in r.get("samples", []):
            s.pop("wall", None)
    base = os.path.join(args.out, f"gpu_check-{mode}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "phases": rep.phases, "rows": rep.rows}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(meta, rep))
    shutil.rmtree(scratch, ignore_errors=True)
    print(summary(meta, rep, total))
    print(f"wrote {base}.json and {base}.md")
    return 1 if any(r["status"] == "failed" for r in rep.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
