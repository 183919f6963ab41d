"""Packaging: the license, the PEP 561 markers, the console script and the changelog ship as stated."""

from __future__ import annotations

import hashlib
import importlib
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

import tqkern

ROOT = pathlib.Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11+")

# md5 of the Apache License 2.0 text as the ASF publishes it (LICENSE-2.0.txt).
APACHE_2_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_the_full_apache_2_text():
    head, blank, body = (ROOT / "LICENSE").read_text().partition("\n\n")
    assert head == "Copyright 2026 The tqkern authors"
    assert hashlib.md5(body.encode()).hexdigest() == APACHE_2_MD5


def test_pyproject_declares_license_and_markers(project):
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    data = project["tool"]["setuptools"]["package-data"]
    for pkg in ("tqkern", "tqkern_torch"):
        assert data[pkg] == ["py.typed"]
        assert (ROOT / pkg / "py.typed").is_file()


def test_console_script_is_the_numpy_only_cli(project):
    assert project["project"]["scripts"] == {"tqkern": "tqkern.cli:main"}
    module, _, attr = project["project"]["scripts"]["tqkern"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_changelog_has_unreleased_and_the_current_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert versions[0] == "Unreleased"
    assert versions[1] == tqkern.__version__  # the newest release is the package's version


def test_wheel_ships_license_markers_and_script(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"building needs setuptools>=77 (PEP 639 license), found {setuptools.__version__}")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    for pkg in ("tqkern", "tqkern_torch"):
        for f in (ROOT / pkg).rglob("*"):
            if f.is_file() and "__pycache__" not in f.parts:
                (src / f.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
                (src / f.relative_to(ROOT)).write_bytes(f.read_bytes())
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_wheel({str(out)!r})"],
                   cwd=src, check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = f"tqkern-{tqkern.__version__}.dist-info"
        assert {"tqkern/py.typed", "tqkern_torch/py.typed", "tqkern/cli.py", f"{info}/licenses/LICENSE"} <= names
        assert "tqkern = tqkern.cli:main" in z.read(f"{info}/entry_points.txt").decode()
        assert "License-Expression: Apache-2.0" in z.read(f"{info}/METADATA").decode().splitlines()
