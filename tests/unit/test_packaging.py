"""The install a newcomer runs first: pyproject.toml applies without setuptools' deprecation warnings,
and `make install` shows pip's progress (no -q) instead of minutes of silence."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_applies_without_setuptools_warnings() -> None:
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("the SPDX license string needs setuptools 77")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message) for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"


def test_make_install_shows_pip_progress() -> None:
    recipes = [line.strip() for line in (ROOT / "Makefile").read_text().splitlines()
               if line.startswith("\t") and "pip install" in line]
    assert recipes
    for recipe in recipes:
        assert not re.search(r"\s(-q|--quiet)\b", recipe), recipe
