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


def _extras() -> dict[str, list[str]]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {"": project["dependencies"], **project["optional-dependencies"]}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_make_install_takes_xgrammar_without_its_gpu_compiler() -> None:
    """`make install` puts xgrammar in with --no-deps at structured's pin; structured-cpu holds the rest of
    what it requires, all but triton (the 1 GB GPU compiler its CPU path never imports)."""
    extras = _extras()
    makefile = (ROOT / "Makefile").read_text()
    [pin] = extras["structured"]
    assert f"XGRAMMAR := {pin}" in makefile and "--no-deps $(XGRAMMAR)" in makefile
    assert "structured-cpu" in makefile and "'.[server,structured]'" not in makefile
    assert not any(_name(r) in ("xgrammar", "triton") for r in extras["structured-cpu"] + extras["test"])
    metadata = pytest.importorskip("importlib.metadata")
    try:
        required = metadata.requires("xgrammar") or []
    except metadata.PackageNotFoundError:
        pytest.skip("xgrammar is not installed here")
    needed = {_name(r) for r in required if "extra ==" not in r} - {"triton"}
    provided = {_name(r) for r in extras[""] + extras["server"] + extras["structured-cpu"]}
    assert needed <= provided, needed - provided
