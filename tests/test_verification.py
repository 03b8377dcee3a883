"""engine.format.verification: the per-context flag that says whether loads check the
checksums their files record, and what a first open of a file imports for it."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import engine
from engine.format.verification import verification, verifying

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_flag_nests_and_none_keeps_the_surrounding_choice():
    assert verifying()
    with verification(False):
        assert not verifying()
        with verification(None):
            assert not verifying()
        with verification(True):
            assert verifying()
        assert not verifying()
    assert verifying()


def test_a_first_open_imports_none_of_the_checksum_code(tmp_path):
    """The header path's first open: a handle and every shape and dtype, without the CRC-32C
    code, the entry's parser or the atomic writer (they cost about 1 ms of imports)."""
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file({f"w{i}": np.zeros(3, np.float32) for i in range(5)}, str(path))
    code = ("import sys, engine\n"
            f"with engine.safe_open({str(path)!r}, framework='np') as f:\n"
            "    shapes = [(f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()]\n"
            "print(len(shapes), sorted(m for m in ('engine.format.checksums', 'engine.base._crc32c',\n"
            "                                      'engine.base._atomic') if m in sys.modules))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split("\n")[0] == "5 []", out.stdout + out.stderr
