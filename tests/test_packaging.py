"""The wheel a user installs: every module of the package, and the PEP 561 marker."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_wheel_ships_every_module_and_the_typed_marker(tmp_path: pathlib.Path) -> None:
    # Without balancer/py.typed in the wheel, mypy and pyright treat the installed
    # package as untyped ("missing library stubs or py.typed marker").
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "balancer", src / "balancer", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           str(src), "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("balancer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "balancer/py.typed" in names
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "balancer").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
