"""scripts/gpu_check.py in its dry mode (``--device cpu``): every row runs or says why not.

The script is the one command that checks the engine on a lent GPU; this runs it end to end
on the CPU so that it cannot rot between the rare GPU runs.  Its build and pytest phases
are left out here (rebuilding the extensions under a running suite, and a suite inside the
suite); CI's dry-mode step runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
    "engine stream(shards) gpu_path=copy",
    "engine stream(shards) gpu_path=register",
    "engine load_into(directory)",
    "engine load_into(directory) gpu_path=copy",
    "engine load_into(directory) gpu_path=register",
    "reference load_file(f, device) per shard",
    "InstantTensor Backend.MMAP",
    "fastsafetensors (nogds, buffered)",
    "engine stream(f) stats=True per shard",
    "engine stream(f) quantize=int8 per shard",
    "compare: engine.torch.load_file",
    "compare: engine.stream gpu_path=register",
    "compare: engine.load_into gpu_path=copy",
    "compare: selective: engine.stream(names=every third)",
    "emulated device: stream pipeline gpu_path=copy",
    "emulated device: stream pipeline gpu_path=register",
    "phase build",
    "phase pytest",
]
DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "C64"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    out = tmp / "out"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["GPU_CHECK_INJECT"] = BAD  # a row that fails, first in its phase
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--size", "16MB", "--out", str(out),
           "--dir", str(tmp / "checkpoint"), "--skip", "build,pytest"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
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
    assert rows["phase pytest"]["reason"] == "--skip pytest"
    assert rows["wheel: instanttensor"]["reason"] == "no --wheels folder given"
    # the loads ran, on the CPU, and say so; the memory peaks are there
    for name in ("engine stream(shards) gpu_path=register", "engine load_into(directory) gpu_path=copy",
                 "engine stream(f) quantize=int8 per shard", "reference load_file(f, device) per shard"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["gbps"] > 0 and rows[name]["host_peak_bytes"] > 0
        assert "device=cpu" in rows[name]["reason"]
    # every load of the same bytes has the reference's checksum
    ref = rows["reference load_file(f, device) per shard"]["checksums"]
    assert rows["engine stream(shards) gpu_path=copy"]["checksums"] == ref
    assert rows["engine stream(f) stats=True per shard"]["stats"] > 0
    # phase timings
    assert [p["phase"] for p in report["phases"]][:3] == ["wheels", "build", "pytest"]
    assert all(p["budget_s"] > 0 and p["elapsed_s"] >= 0 for p in report["phases"])


def test_every_dtype_matches_the_reference(dry_run):
    _, report, _ = dry_run
    compared = [r for r in report["rows"] if r["phase"] == "compare"]
    assert len(compared) >= 11
    for r in compared:
        assert r["status"] == "ok", r
    full = {r["row"]: r for r in compared}["compare: engine.load_into gpu_path=register"]
    assert set(DTYPES) <= set(full["matched"])
    assert "F32 scalar" in full["matched"] and "BF16 empty" in full["matched"]


def test_a_failing_row_is_reported_and_the_rest_still_run(dry_run):
    proc, report, md = dry_run
    assert proc.returncode == 1, proc.stdout[-2000:]  # a failed row fails the command
    rows = report["rows"]
    i = next(k for k, r in enumerate(rows) if r["row"] == BAD)
    assert rows[i]["status"] == "failed" and "KeyError" in rows[i]["reason"], rows[i]
    after = rows[i + 1:]
    assert {r["phase"] for r in after} >= {"warm", "onload", "emulated"}
    assert sum(r["status"] == "ok" for r in after) >= 10
    assert f"FAILED warm: {BAD}" in proc.stdout
    # the markdown table has every row
    assert "| phase | row | status | GB/s |" in md
    for r in rows:
        assert f"| {r['row']} |" in md
