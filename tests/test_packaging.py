"""The project's metadata, as the build reads it: ``pyproject.toml`` through setuptools."""

from __future__ import annotations

import pathlib
import warnings

import pytest

import engine

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_setuptools_reads_the_metadata_without_a_deprecation_warning():
    """``project.license`` as a TOML table printed SetuptoolsDeprecationWarning on every build
    (it stops building after 2027-02-18): an SPDX string is the form setuptools keeps."""
    setuptools = pytest.importorskip("setuptools", reason="the build backend (a test extra)")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SetuptoolsDeprecationWarning, and any other
        dist = apply_configuration(Distribution(), str(ROOT / "pyproject.toml"))
    assert dist.metadata.license_expression == "Apache-2.0"
    assert dist.get_version() == engine.__version__  # `engine --version` says what was built
    assert int(setuptools.__version__.split(".")[0]) >= 77  # what build-system.requires asks for


def test_the_readmes_quick_start_runs_on_the_demos_file_with_the_core():
    """The quick start read a URL with torch while the install above it gave the core only; it
    names the demo's file now, needs no extra (no ``# needs:`` line) and uses GPT-2's names, which
    the demo writes (tests/test_readme.py runs it)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = "\n".join(lines[:30])
    block = start.split("```python", 1)[1].split("```", 1)[0]
    assert "://host" not in block and "# needs:" not in block and "engine.torch" not in block.split("#")[0], block
    assert '"demo/gpt2.safetensors"' in block and '"wte.weight"' in block, block
    assert "python -m engine demo --dir demo" in start


def test_the_readme_starts_with_everything_a_new_user_needs_in_30_lines():
    """What it is, a virtual environment, the demo and test commands, a few lines of API and
    where the rest is: within the first 30 lines; the long reference follows them."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = "\n".join(lines[:30])
    assert "python3 -m venv .venv && . .venv/bin/activate" in start
    demo = next(line for line in lines[:25] if "python -m engine demo" in line)
    tests = next(line for line in lines[:25] if "python -m pytest" in line)
    assert demo.startswith("pip install -e . && python -m engine demo")
    assert "```python" in start and "load_file(" in start and "safe_open(" in start
    assert len(lines) > 200 and "## Development" in lines[30:]
    # the test command is the one CI runs from a fresh clone: its install line, then python -m pytest
    install = tests.split("&&")[0].strip().removeprefix("pip install ")
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"python -m pip install -q {install}\n" in ci
    assert tests.split("&&")[1].split("#")[0].strip() == "python -m pytest"
    assert "run_pytest -q\n" in ci


def test_the_linters_are_a_dev_extra_that_ci_installs_and_runs():
    toml = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")
    extras = toml.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {e: {r.split(">")[0].split("=")[0].split("[")[0] for r in reqs} for e, reqs in extras.items()}
    assert {"ruff", "mypy"} <= names["dev"] and not {"ruff", "mypy"} & names["test"]
    ci = (ROOT / ".ci" / "run").read_text()
    linters = ci.index("ruff check engine tests scripts asv_benchmarks")
    assert '["optional-dependencies"]["dev"]' in ci[:linters] and "\nmypy\n" in ci[linters:]


def test_the_readmes_development_section_speaks_to_any_contributor():
    """It spoke of a "lent GPU host", ``../shared/wheels`` and carrying ``.whl`` "with the device
    tool": how the project was built in one place, not steps a contributor elsewhere can follow.
    Now: the GPU check on any machine with a GPU, the peers' wheels from PyPI by name, the test
    install's size and a quick core-only command."""
    text = (ROOT / "README.md").read_text()
    dev = text[text.index("## Development"):]
    for words in ("lent", "../shared", "device tool", "$OUT"):
        assert words not in dev, words
    assert "any machine with an NVIDIA GPU" in dev
    assert "pip download --no-deps -d .whl instanttensor fastsafetensors runai-model-streamer" in dev
    source = (ROOT / "scripts" / "gpu_check.py").read_text()
    for peer in ("instanttensor", "fastsafetensors", "runai_model_streamer"):  # the script's PEERS
        assert f'"{peer}"' in source and peer.replace("_", "-") in dev, peer
    quick = next(line for line in dev.splitlines() if "quick check" in line)
    assert quick.startswith("python -m pytest tests/") and "1.5 GB" in dev and "12 minutes" in dev
