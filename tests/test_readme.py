"""Every Python example of README.md runs as written on the demo's checkpoint.

The README's examples read ``demo/gpt2.safetensors``, which ``python -m engine demo --dir demo`` writes;
each runs here in a fresh interpreter, in a directory of its own holding that file (written once by the
demo itself, ``--small``). An example that needs more than the demo's file and the core install says so
in its first line, ``# needs: ...``: an extra's package (torch, numba, transformers) is imported or the
example is skipped naming the extra; a GPU, the network, ``torchrun`` or a model of the reader's own skip
with that reason.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: what a ``# needs:`` line may name that the test cannot provide: (pattern, reason to skip)
_OUTSIDE = (
    (r"\bnetwork\b", "needs the network"),
    (r"\bGPUs?\b|\bCUDA\b", "needs a CUDA GPU"),
    (r"\btorchrun\b", "needs processes started by torchrun"),
    (r"\bof yours\b|\byour own\b", "needs a model of the reader's own"),
)
#: the optional packages a ``# needs:`` line may name: imported, or the example is skipped
_PACKAGES = ("torch", "numba", "transformers")


def readme_examples() -> list[tuple[int, str]]:
    """(line number, source) of every ```python block of README.md."""
    out, lines, block, start = [], (ROOT / "README.md").read_text(encoding="utf-8").splitlines(), None, 0
    for number, line in enumerate(lines, 1):
        if block is None and line.strip() == "```python":
            block, start = [], number + 1
        elif block is not None and line.strip() == "```":
            out.append((start, textwrap.dedent("\n".join(block) + "\n")))  # a block inside a list item
            block = None
        elif block is not None:
            block.append(line)
    return out


EXAMPLES = readme_examples()


def needs(source: str) -> str:
    first = source.lstrip().splitlines()[0]
    return first.partition("# needs:")[2].strip() if first.startswith("# needs:") else ""


@pytest.fixture(scope="module")
def demo_file(tmp_path_factory) -> pathlib.Path:
    """``demo/gpt2.safetensors`` as the README's first command writes it (the small model)."""
    where = tmp_path_factory.mktemp("readme") / "demo"
    out = subprocess.run([sys.executable, "-m", "engine", "demo", "--small", "--dir", str(where)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    path = where / "gpt2.safetensors"
    assert out.stdout.splitlines()[-1] == f"kept {path}", out.stdout
    return path


def test_the_readme_has_examples_that_run_here():
    """The table is not empty, and examples are not moved out of reach: as many as today run
    with the demo's file and the test extras (the rest need a GPU, the network, a process group
    or a model of the reader's)."""
    outside = [line for line, src in EXAMPLES if any(re.search(p, needs(src)) for p, _ in _OUTSIDE)]
    assert len(EXAMPLES) >= 15 and len(EXAMPLES) - len(outside) >= 7, outside


@pytest.mark.parametrize("line, source", EXAMPLES, ids=[f"README.md:{line}" for line, _ in EXAMPLES])
def test_a_readme_example_runs_as_written(line, source, demo_file, tmp_path):
    wanted = needs(source)
    for pattern, reason in _OUTSIDE:
        if re.search(pattern, wanted):
            pytest.skip(f"README.md:{line} {reason} ({wanted})")
    for package in _PACKAGES:
        if re.search(rf"\b{package}\b", wanted):
            pytest.importorskip(package, reason=f"README.md:{line} needs {package}, an optional extra")
    (tmp_path / "demo").mkdir()
    shutil.copy(demo_file, tmp_path / "demo" / "gpt2.safetensors")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, f"README.md:{line} failed:\n{source}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def test_the_quick_start_needs_nothing_but_the_core():
    """The first example comes right after the core install and the demo: it must run with them."""
    line, source = EXAMPLES[0]
    assert line < 30 and needs(source) == "", source
