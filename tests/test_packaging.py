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


def test_the_readmes_quick_start_names_no_placeholder():
    """The quick start's Python runs as written (with the network): a real file, not ``host``."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = "\n".join(lines[:25])
    block = start.split("```python", 1)[1].split("```", 1)[0]
    assert "://host" not in block and "model.safetensors\")" not in block.replace("/model.safetensors", ""), block
    assert "https://huggingface.co/" in block


def test_the_readme_starts_with_everything_a_new_user_needs_in_25_lines():
    """What it is, a virtual environment, the demo and test commands, a few lines of API and
    where the rest is: within the first 25 lines; the long reference follows them."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = "\n".join(lines[:25])
    assert "python3 -m venv .venv && . .venv/bin/activate" in start
    demo = next(line for line in lines[:25] if "python -m engine demo" in line)
    tests = next(line for line in lines[:25] if "python -m pytest" in line)
    assert demo.startswith("pip install -e . && python -m engine demo")
    assert "```python" in start and "engine.torch.load_file(" in start and "safe_open(" in start
    assert len(lines) > 200 and "## Development" in lines[25:]
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
