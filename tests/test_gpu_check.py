"""scripts/gpu_check.py in its dry mode (``--device cpu``): every row runs or says why not,
within the budget it is given.

The script is the one command that checks the engine on a lent GPU; this runs it end to end
on the CPU so that it cannot rot between the rare GPU runs.  Its build and pytest rows
are left out here (rebuilding the extensions under a running suite, and a suite inside the
suite); CI's dry run runs the build.  Also: the budget's own logic (a row that cannot fit
is not started and is named with the reason, the files rewritten after every row), the
host memory by kind that each load row reports (scripts/host_memory.py), the ring's records
in the rows, the ring sweep's dry run on the emulated CUDA runtime (``--sweep``), and the
scripts' own checkout first on ``sys.path``, from any folder.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch", reason="torch is an optional extra")
pytest.importorskip("safetensors", reason="the reference is a test dependency")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")
BAD = "no such implementation"

# the rows the GPU check must have, whatever else it grows
REQUIRED = [
    "wheel: instanttensor",
    "wheel: fastsafetensors",
    "engine load_file(f) per shard",
    "engine load_file(directory)",
    "engine safe_open(directory).get_tensors()",
    "engine stream(shards) auto",
    "engine load_into(directory)",
    "engine safe_open(f, device) get_tensor per key",
    "reference safe_open(f, device) get_tensor per key",
    "reference load_file(f, device) per shard",
    "engine load_into(directory) second load in the same process",
    "engine load_into(directory) first load after engine.prepare_device",
    "InstantTensor Backend.MMAP",
    "fastsafetensors (nogds, buffered)",
    "engine stream(f) stats=True per shard",
    "engine stream(f) quantize=int8 per shard",
    "compare: engine.torch.load_file",
    "compare: engine.stream gpu_path=copy",
    "compare: engine.load_into gpu_path=auto",
    "compare: selective: engine.stream(names=every third)",
    "emulated runtime: chunk ring, every shard in one load",
    "engine from this checkout",
    "build_ext --inplace",
    "pytest -m cuda",
    "pytest device-kernel modules",
    "sweep: the fastest configuration's bytes",
    "driver: no stale error after a load",
    "driver: current device unchanged by a load",
    "driver: load_into after a queued zero_()",
    "driver: no context on another GPU",
    "driver: a load in a forked child",
    "driver: windowed int8 on the torch fallback",
    "driver: no context on another GPU after a CuPy load",
    "driver: a CuPy-only process",
    "driver: a load in torch.cuda.stream(s) beside NCCL",
]
#: the dry run's budget here: enough for every row on a 16 MB checkpoint (the stats and int8
#: rows compile their kernels in a fresh checkout), well under it otherwise
DRY_BUDGET = 200  # the onload rows: the plain stream(f), stats, int8, both, the validator
DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "C64"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    out = tmp / "out"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["GPU_CHECK_INJECT"] = BAD  # a row that fails, first in its phase
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--budget", str(DRY_BUDGET), "--size", "16MB", "--out",
           str(out), "--dir", str(tmp / "checkpoint"), "--skip", "build,pytest"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=DRY_BUDGET + 120)
    proc.wall = time.monotonic() - t0  # type: ignore[attr-defined]
    with open(out / "gpu_check-warm.json") as f:
        report = json.load(f)
    return proc, report, (out / "gpu_check-warm.md").read_text()


def test_every_row_has_a_result_or_a_reason(dry_run):
    proc, report, _ = dry_run
    rows = {r["row"]: r for r in report["rows"]}
    missing = [n for n in REQUIRED if n not in rows]
    assert not missing, missing
    for r in report["rows"]:
        assert r["status"] in ("ok", "failed", "skipped"), r
        if r["status"] == "ok":
            assert r.get("gbps") or r.get("matched") or r.get("seconds") is not None, r
        else:
            assert r["reason"], r
    # what cannot run here says why
    assert rows["InstantTensor Backend.MMAP"]["status"] == "skipped"
    assert rows["limit: pinned host-to-device 1 GiB"]["reason"] == "no CUDA device (--device cpu)"
    assert rows["pytest -m cuda"]["reason"] == "--skip pytest"
    assert rows["build_ext --inplace"]["reason"] == "--skip build"
    assert rows["wheel: instanttensor"]["reason"] == "no --wheels folder given"
    assert rows["engine load_into(directory) first load after engine.prepare_device"]["reason"] == \
        "no CUDA device (--device cpu)"
    # the loads ran, on the CPU, and say so; the memory peaks are there, by kind too
    for name in ("engine stream(shards) auto", "engine load_into(directory)",
                 "engine stream(f) quantize=int8 per shard", "reference load_file(f, device) per shard"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["gbps"] > 0 and rows[name]["host_peak_bytes"] > 0
        assert "device=cpu" in rows[name]["reason"]
        for kind in ("anon_growth_bytes", "file_growth_bytes", "locked_growth_bytes", "anon_locked_growth_bytes",
                     "file_after_bytes"):
            assert isinstance(rows[name][kind], int), (name, kind)
        assert rows[name]["memory_samples"] >= 2
    # a host load into tensors made before the clock: they are anonymous memory it fills
    grown = rows["engine load_into(directory)"]["anon_growth_bytes"]
    assert grown >= 0.8 * rows["engine load_into(directory)"]["bytes"], grown
    # no bound on a host load (its destination is anonymous memory): that is for GPU rows
    assert all("host_bounded" not in r for r in report["rows"])
    # every load of the same bytes has the reference's checksum
    ref = rows["reference load_file(f, device) per shard"]["checksums"]
    assert rows["engine stream(shards) auto"]["checksums"] == ref
    assert rows["engine stream(f) stats=True per shard"]["stats"] > 0
    # nothing of the removed register path is left
    assert not [r["row"] for r in report["rows"] if "register" in r["row"]]
    # the most decisive rows first, then the per-key loop, warm start, the sweep, the rest
    phases = [p["phase"] for p in report["phases"]]
    assert phases[:9] == ["wheels", "build", "engine", "driver", "checkpoint", "loads", "per-key", "warm-start",
                          "sweep"]
    assert all(p["elapsed_s"] >= 0 for p in report["phases"])
    # the run finished inside its budget, and every planned row was reached
    assert report["meta"]["finished"] and report["pending"] == []
    assert report["meta"]["total_s"] <= DRY_BUDGET
    assert not [r for r in report["rows"] if (r["reason"] or "").startswith("budget")]


def test_the_driver_rows_run_on_the_emulated_runtime_or_say_where_they_are_checked(dry_run):
    """scripts/driver_check.py: what a load leaves behind (a stale error, the current device, a
    forked child's inherited rings) on the emulated runtime; the rows that need a GPU's
    streams and contexts name the tests that check them here."""
    _, report, _ = dry_run
    rows = {r["row"]: r for r in report["rows"]}
    for name in ("driver: no stale error after a load", "driver: current device unchanged by a load",
                 "driver: a load in a forked child"):
        assert rows[name]["status"] == "ok", rows[name]
    assert "cudaGetLastError 0" in rows["driver: no stale error after a load"]["reason"]
    for name, test in (("driver: load_into after a queued zero_()", "test_device_ring"),
                       ("driver: no context on another GPU", "test_device_ring"),
                       ("driver: windowed int8 on the torch fallback", "test_hooked_ring"),
                       ("driver: no context on another GPU after a CuPy load", "test_load_hooks"),
                       ("driver: a CuPy-only process", "test_cudart"),
                       ("driver: a load in torch.cuda.stream(s) beside NCCL", "test_device_ring")):
        assert rows[name]["status"] == "skipped" and f"tests/{test}.py" in rows[name]["reason"], rows[name]


def test_the_second_load_and_the_ring_records(dry_run):
    _, report, md = dry_run
    rows = {r["row"]: r for r in report["rows"]}
    first, second = rows["engine load_into(directory)"], rows["engine load_into(directory) second load in the same process"]
    assert second["status"] == "ok", second
    assert second["bytes"] == first["bytes"] and second["checksums"] == first["checksums"]
    assert len(second["samples"]) == len(first["samples"])
    # a host load makes no load through the ring; the emulated runtime's does, and says so
    assert first["records"]["loads"] == 0
    ring = rows["emulated runtime: chunk ring, every shard in one load"]["records"]
    assert ring["loads"] == 1 and ring["cold"] == 1 and ring["chunks"] > 0
    assert ring["pread_bytes"] + ring["mmap_bytes"] == ring["bytes"] > 0
    assert ring["unmap"] in ("end", "chunk") and ring["source"]
    assert "1 loads (1 cold); wait fill" in md


def test_the_short_sweep_times_every_source_under_each_unmap_mode(dry_run):
    _, report, md = dry_run
    sweep = [r for r in report["rows"] if r["phase"] == "sweep" and r.get("config")]
    assert len(sweep) == 9 and all(r["status"] == "ok" for r in sweep), sweep
    pairs = {(r["config"]["source"], r["config"]["unmap"]) for r in sweep}
    assert {(s, u) for s in ("pread", "mmap", "auto") for u in ("end", "chunk")} <= pairs
    for r in sweep:
        c = r["config"]
        assert c["bytes_ok"] and len(c["gbps"]) == 2
        # the first load sets the ring up, the second reuses it; each says what it did
        first, second = c["records"]
        assert first["cold"] == 1 and second["cold"] == 0, c
        if c["source"] in ("pread", "mmap"):
            assert first["source"] == c["source"]
        if c["unmap"] != "-":
            assert first["unmap"] == c["unmap"]
    best = {r["row"]: r for r in report["rows"]}["sweep: the fastest configuration's bytes"]
    assert best["status"] == "ok" and "bytes checked" in best["reason"]
    assert "| sweep | sweep: 4 MiB x 32, threads" in md


def test_every_dtype_matches_the_reference(dry_run):
    _, report, _ = dry_run
    compared = [r for r in report["rows"] if r["phase"] == "compare"]
    assert len(compared) >= 11
    for r in compared:
        assert r["status"] == "ok", r
    full = {r["row"]: r for r in compared}["compare: engine.load_into gpu_path=auto"]
    assert set(DTYPES) <= set(full["matched"])
    assert "F32 scalar" in full["matched"] and "BF16 empty" in full["matched"]


def test_a_failing_row_is_reported_and_the_rest_still_run(dry_run):
    proc, report, md = dry_run
    assert proc.returncode == 1, proc.stdout[-2000:]  # a failed row fails the command
    rows = report["rows"]
    i = next(k for k, r in enumerate(rows) if r["row"] == BAD)
    assert rows[i]["status"] == "failed" and "KeyError" in rows[i]["reason"], rows[i]
    after = rows[i + 1:]
    assert {r["phase"] for r in after} >= {"loads", "per-key", "sweep", "onload", "emulated"}
    assert sum(r["status"] == "ok" for r in after) >= 10
    assert f"FAILED loads: {BAD}" in proc.stdout
    # the markdown table has every row
    assert "| phase | row | status | GB/s |" in md
    for r in rows:
        assert f"| {r['row']} |" in md


def test_the_per_key_loop_runs_through_the_engine_and_the_reference(dry_run):
    _, report, md = dry_run
    rows = {r["row"]: r for r in report["rows"]}
    ref = rows["reference load_file(f, device) per shard"]
    for name in ("engine safe_open(f, device) get_tensor per key", "reference safe_open(f, device) get_tensor per key"):
        r = rows[name]
        assert r["status"] == "ok", r
        # every key of every shard, the same bytes as the reference's whole-file load
        assert r["tensors"] == ref["tensors"] and r["bytes"] == ref["bytes"]
        assert r["checksums"] == ref["checksums"]
        assert f"| {name} |" in md


def test_the_children_used_this_checkouts_engine(dry_run):
    proc, report, _ = dry_run
    where = report["meta"]["engine_file"]
    engine_dir = os.path.join(ROOT, "engine") + os.sep
    assert where["parent"].startswith(engine_dir) and where["child"].startswith(engine_dir), where
    assert f"engine: parent {where['parent']}; child {where['child']}" in proc.stdout
    rows = [r for r in report["rows"] if r.get("samples")]
    assert rows and all(s["engine_file"].startswith(engine_dir) for r in rows for s in r["samples"]
                        if "engine_file" in s)


# -- the budget ---------------------------------------------------------------------------------------


class Clock:
    """A clock the test moves: each row "takes" the seconds it is told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _budget(seconds, clock):
    gc = _scripts_module("gpu_check")
    return gc, gc.Budget(seconds, clock=clock, reserve=2.0)


def test_the_budget_estimates_from_a_rows_own_runs_else_its_prior():
    clock = Clock()
    gc, b = _budget(100, clock)
    assert b.left() == 98.0
    assert b.estimate("build", 75) == 75  # nothing ran yet: the prior
    b.note("build", 20.0)
    assert b.estimate("build", 75) == pytest.approx(1.2 * 20 + 0.5)  # its own run, with a margin
    # a load sample's prior follows how the samples so far compared with theirs, within bounds
    assert b.estimate("row a", 10, scaled=True) == 10
    b.note("row b", 4.0, prior=10)
    assert b.estimate("row a", 10, scaled=True) == pytest.approx(10 * 1.25 * 0.4)
    b.note("row c", 100.0, prior=10)
    b.note("row d", 100.0, prior=10)
    assert b.estimate("row a", 10, scaled=True) == 20  # at most twice the prior
    clock.now += 90
    assert b.refuse(7.9) is None
    assert b.refuse(9) == "budget: needs ~9s, 8s left"


def test_a_row_that_cannot_fit_is_not_started_and_the_table_says_why(tmp_path):
    clock = Clock()
    gc, b = _budget(60, clock)
    rep = gc.Report(str(tmp_path / "gpu_check-warm"), {"mode": "warm", "budget_s": 60})
    rep.plan(["first", "too long", "last"])
    args = type("Args", (), {"device": "cpu", "skip": "", "wheels": None, "dir": str(tmp_path), "long": False})()
    check = gc.Check(args, b, rep, str(tmp_path))
    started = []

    def run(name, seconds):
        def fn(left):
            started.append((name, left))
            clock.now += seconds
            rep.add("rest", name, "ok", None, seconds=seconds)
        return fn

    check.step("rest", "first", "first", 20, run("first", 30))  # fits its prior, takes longer
    rep.done(["first"])
    # written after the row: a run stopped now leaves a whole table, the rows not reached named
    with open(tmp_path / "gpu_check-warm.json") as f:
        on_disk = json.load(f)
    assert [r["row"] for r in on_disk["rows"]] == ["first"] and on_disk["pending"] == ["too long", "last"]
    md = (tmp_path / "gpu_check-warm.md").read_text()
    assert "| rest | first | ok |" in md and "Not reached" in md and "too long; last" in md
    check.step("rest", "too long", "too long", 40, run("too long", 1))  # 28 s left
    rep.done(["too long"])
    check.step("rest", "last", "last", 10, run("last", 5))
    rep.done(["last"])
    assert [n for n, _ in started] == ["first", "last"]
    assert started[0][1] == pytest.approx(58.0)  # a row may take what is left, no more
    rows = {r["row"]: r for r in rep.rows}
    assert rows["too long"]["status"] == "skipped"
    assert rows["too long"]["reason"] == "budget: needs ~40s, 28s left"
    with open(tmp_path / "gpu_check-warm.json") as f:
        on_disk = json.load(f)
    assert [r["row"] for r in on_disk["rows"]] == ["first", "too long", "last"] and on_disk["pending"] == []
    assert "| rest | too long | skipped |" in (tmp_path / "gpu_check-warm.md").read_text()
    assert "budget: needs ~40s, 28s left" in (tmp_path / "gpu_check-warm.md").read_text()


def test_a_load_row_keeps_the_samples_the_budget_held(tmp_path, monkeypatch):
    clock = Clock()
    gc, b = _budget(30, clock)
    rep = gc.Report(str(tmp_path / "gpu_check-warm"), {"mode": "warm", "budget_s": 30})
    args = type("Args", (), {"device": "cpu", "skip": "", "wheels": None, "dir": str(tmp_path), "long": False})()
    check = gc.Check(args, b, rep, str(tmp_path))
    check.files = ["f"]
    calls = []

    def sample(impl, files, dev, timeout, env=None):
        calls.append(timeout)
        clock.now += 10  # each sample takes 10 s: the third would need 12.5 with 8 left
        return {"seconds": 1.0, "bytes": 10**9, "checksum": "x"}

    monkeypatch.setattr(gc.bench_gpu, "sample", sample)
    monkeypatch.setattr(gc.time, "monotonic", clock)
    gc.row_loads(check, "loads", "engine load_file(directory)", 3, "sample")
    assert len(calls) == 2
    row = rep.rows[-1]
    assert row["status"] == "ok" and len(row["samples"]) == 2
    assert row["reason"].endswith("2 of 3 sample(s) (budget: needs ~12s, 8s left)"), row["reason"]
    # a row whose first sample does not fit is not started at all
    gc.row_loads(check, "loads", "engine stream(shards) auto", 3, "sample")
    assert len(calls) == 2
    assert rep.rows[-1]["status"] == "skipped" and rep.rows[-1]["reason"].startswith("budget: needs ~")


def test_a_short_budget_ends_the_real_run_in_time_and_names_what_did_not_run(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--budget", "14", "--size", "16MB", "--out", str(out),
           "--dir", str(tmp_path / "checkpoint"), "--skip", "build"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "gpu_check-warm.json") as f:
        report = json.load(f)
    assert report["meta"]["finished"] and report["pending"] == []
    assert wall < 14 + 20, wall  # the budget, the interpreter's start and the last write (no timing assert)
    rows = report["rows"]
    cut = [r for r in rows if r["status"] == "skipped" and r["reason"].startswith("budget: needs ~")]
    assert cut, [(r["row"], r["status"], r["reason"]) for r in rows]
    # the decisive rows come first: whatever the budget held, it held them before the rest
    names = [r["row"] for r in rows]
    assert names.index("engine load_file(f) per shard") < names.index("compare with the reference" if
                                                                     "compare with the reference" in names else
                                                                     "compare: engine.torch.load_file")
    assert "budget: needs ~" in (out / "gpu_check-warm.md").read_text()
    assert "not run for the budget:" in proc.stdout


# -- host memory by kind ------------------------------------------------------------------------------

STATUS = """Name:\tpython3
VmPeak:\t 2097152 kB
VmLck:\t       8 kB
VmHWM:\t  512000 kB
VmRSS:\t  409600 kB
RssAnon:\t  300000 kB
RssFile:\t  109000 kB
RssShmem:\t     600 kB
Threads:\t4
"""


def _scripts_module(name):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))


def test_status_fields_are_parsed_by_kind():
    hm = _scripts_module("host_memory")
    assert hm.parse_status(STATUS) == {"anon": 300000 * 1024, "file": 109000 * 1024, "vmlck": 8 * 1024}
    # a kernel without RssAnon / RssFile (before 4.5): the fields are left out, not zero
    assert hm.parse_status("VmRSS:\t 10 kB\nVmLck:\t 0 kB\n") == {"vmlck": 0}
    assert hm.parse_status("RssAnon:\tgarbage\n") == {}


def test_the_sampler_sees_each_kind_grow(tmp_path):
    hm = _scripts_module("host_memory")
    if not hm.read_status():
        pytest.skip("no /proc/self/status here")
    import mmap

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20) * 48)
    locked = [0]
    with hm.Sampler(interval=0.002, locked=lambda: locked[0]) as s:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            anon = b"\x01" * (64 << 20)  # written: 64 MiB of anonymous pages
            total = sum(m[i] for i in range(0, len(m), 4096))  # every page of the mapping touched
            locked[0] = 16 << 20
            start = s.samples
            while s.samples < start + 3:  # the sampler's thread sees them all at once
                time.sleep(0.005)
            del anon
            assert total >= 0
        after = s.file_now()
    r = s.result()
    assert r["anon_growth_bytes"] >= 60 << 20, r
    assert r["file_growth_bytes"] >= 40 << 20, r
    assert r["locked_growth_bytes"] == 16 << 20 and r["locked_peak_bytes"] == 16 << 20, r
    assert r["anon_locked_growth_bytes"] >= r["anon_growth_bytes"], r
    assert r["memory_samples"] >= 2
    # after: the mapping is closed, its pages no longer count
    assert after < 8 << 20


# -- the ring sweep -----------------------------------------------------------------------------------


def test_the_sweep_order_times_every_configuration_once_best_geometries_first():
    rs = _scripts_module("ring_sweep")
    geoms = rs.geometries(dry=False)
    assert geoms and all(m * n * rs.MIB <= rs.MAX_PINNED for m, n in geoms)
    assert rs.thread_counts(16) == [8, 10, 12, 14, 16] and rs.thread_counts(2) == [1, 2]
    threads, rates = rs.thread_counts(16), {}
    seen = []
    for stage, cfg in rs.order(geoms, threads, 12, rates, first=(4, 32)):
        if stage == "A":
            # the first pass: every geometry at the default threads, source and stores, the default first
            assert cfg[2:] == (12, "auto", "stream", "end")
            rates[cfg] = float(cfg[0] == 8 and cfg[1] == 16)  # one geometry measures fastest
        seen.append((stage, cfg))
    configs = [c for _, c in seen]
    assert len(configs) == len(set(configs)) == len(geoms) * len(threads) * len(rs.VARIANTS)
    assert configs[0] == (4, 32, 12, "auto", "stream", "end")
    first_b = next(c for s, c in seen if s == "B")
    assert first_b[:2] == (8, 16)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    out = tmp / "out"
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--sweep", "--size", "16MB", "--out", str(out),
           "--dir", str(tmp / "checkpoint")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc, out


def test_the_dry_sweep_writes_its_curve_and_the_best_geometry(sweep):
    proc, out = sweep
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "gpu_check-sweep.json") as f:
        report = json.load(f)
    md = (out / "gpu_check-sweep.md").read_text()
    # the harness's common shape: a row per configuration, the sweep's own keys beside them
    assert {"script", "commit", "machine", "rows"} <= set(report)
    configs = report["rows"]
    start = report["start"]
    assert len(configs) == start["configs"] == len(start["geometries"]) * len(start["threads"]) * 6
    assert {(c["source"], c["stores"], c["unmap"]) for c in configs} == {
        ("auto", "stream", "end"), ("auto", "cached", "end"), ("pread", "-", "-"), ("mmap", "stream", "end"),
        ("auto", "stream", "chunk"), ("mmap", "stream", "chunk")}
    assert report["end"]["not_run"] == 0 and report["end"]["clean"], report["end"]
    # every configuration loaded twice, its bytes checked against the files
    for c in configs:
        assert len(c["load_gbps"]) == 2 and len(c["samples"]) == 2 and c["gbps"] > 0 and c["bytes_ok"], c
        # the whole grid sets the ring up for each load; the records say which unmap mode ran
        assert [r["cold"] for r in c["records"]] == [1, 1], c
        if c["unmap"] != "-":
            assert c["records"][0]["unmap"] == c["unmap"], c
    # fastest first; the best is the first, its bytes checked again, printed as a line to paste
    rates = [c["gbps"] for c in configs]
    assert rates == sorted(rates, reverse=True)
    best = report["best"]
    assert best["median_gbps"] == configs[0]["gbps"] and best["chunk_mib"] == configs[0]["chunk_mib"]
    assert report["check"]["bytes_ok"]
    line = f"ENGINE_RING={best['chunk_mib']},{best['chunks']},{best['threads']}"
    assert "| unmap | best GB/s |" in md
    assert report["ring"] == line
    assert line in proc.stdout.splitlines()
    assert f"best: `{line}`" in md
    assert "| case | stage | median | GB/s |" in md and "| threads | best GB/s |" in md
    assert report["meta"]["engine_file"]["child"].startswith(os.path.join(ROOT, "engine") + os.sep)


def test_the_benchmark_scripts_write_the_common_shape_on_their_dry_runs(tmp_path):
    """bench_gpu.py and ring_sweep.py on the CPU (CI's smoke runs): the table printed, ``--json``
    in the harness's shape."""
    runs = {"bench_gpu.py": ["--modes", "warm", "--runs", "1", "--only", "load_file(directory)"],
            "ring_sweep.py": ["--short"]}
    for script, extra in runs.items():
        out = tmp_path / f"{script}.json"
        cmd = [sys.executable, os.path.join(ROOT, "scripts", script), "--device", "cpu", "--size", "16MB",
               "--dir", str(tmp_path / "checkpoint"), "--json", str(out), *extra]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = json.loads(out.read_text())
        assert report["script"] == script and report["rows"], report
        for r in report["rows"]:
            assert r["median_s"] > 0 and r["gbps"] > 0 and r["bytes"] > 0 and r["runs"] >= 1, r
        assert "| case |" in proc.stdout


# -- the checkout's own engine, from anywhere --------------------------------------------------------


def test_the_scripts_import_the_engine_of_their_own_checkout(tmp_path):
    """A copy of the checkout with nothing installed from it: the scripts, run from another
    folder and without PYTHONPATH, still import the copy's engine (not the one installed
    from this checkout)."""
    import shutil

    copy = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.c", "*.html")
    shutil.copytree(os.path.join(ROOT, "engine"), copy / "engine", ignore=ignore)
    shutil.copytree(os.path.join(ROOT, "scripts"), copy / "scripts", ignore=ignore)
    shutil.copytree(os.path.join(ROOT, "asv_benchmarks", "benchmarks"), copy / "asv_benchmarks" / "benchmarks",
                    ignore=ignore)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import gpu_check, checkout_path;"
            " print(json.dumps({'root': gpu_check.ROOT, 'engine': checkout_path.engine_origin(),"
            " 'first': sys.path[0], 'pythonpath': checkout_path.pythonpath()}))")
    got = subprocess.run([sys.executable, "-c", code, str(copy / "scripts")], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    where = json.loads(got.stdout.splitlines()[-1])
    assert where["root"] == str(copy) and where["first"] == str(copy)
    assert where["engine"] == str(copy / "engine" / "__init__.py")
    assert where["pythonpath"].split(os.pathsep)[0] == str(copy)
    # a child as gpu_check starts them (harness.call: a fresh interpreter that imports the script)
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import harness, bench_gpu;"
            " print(json.dumps(harness.call(bench_gpu.where)))")
    child = subprocess.run([sys.executable, "-c", code, str(copy / "scripts")], cwd=elsewhere, env=env,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    where = json.loads(child.stdout.splitlines()[-1])
    assert where["engine_file"] == str(copy / "engine" / "__init__.py")
    if glob.glob(os.path.join(ROOT, "engine", "_ring*.so")):  # built in place here: the copy has it too
        assert where["ring_file"].startswith(str(copy / "engine") + os.sep), where
