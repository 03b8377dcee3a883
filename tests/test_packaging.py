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
