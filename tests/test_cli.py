"""The command line, through its entry point in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import engine.numpy


def run(*args, check=False):
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, check=check)


def test_demo_small(tmp_path):
    out = run("demo", "--small", "--dir", str(tmp_path), check=True)
    assert "demo: all checks passed" in out.stdout
    assert "identical" in out.stdout and "MISMATCH" not in out.stdout
    assert (tmp_path / "gpt2.safetensors").exists()


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file(
        {"a.weight": np.zeros((3, 4), np.float32), "b": np.ones(5, np.int64)}, path, metadata={"format": "np"}
    )
    return path


def test_inspect_table(model):
    out = run("inspect", str(model), check=True)
    assert "a.weight" in out.stdout and "F32" in out.stdout and "[3, 4]" in out.stdout
    assert "17 parameters" in out.stdout


def test_inspect_json_round_trips(model):
    out = run("inspect", str(model), "--json", check=True)
    data = json.loads(out.stdout)
    assert data["a.weight"]["shape"] == [3, 4]
    assert data["__metadata__"] == {"format": "np"}


def test_broken_file_is_one_line_and_nonzero_exit(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 8 + b"{}")
    out = run("inspect", str(bad))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and "HeaderTooLarge" in out.stderr and str(bad) in out.stderr


def test_missing_file(tmp_path):
    out = run("inspect", str(tmp_path / "nope.safetensors"))
    assert out.returncode == 2 and "Traceback" not in out.stderr and "nope.safetensors" in out.stderr
