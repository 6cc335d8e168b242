"""What a non-editable install (the Dockerfile's ``pip install .``) carries: every C kernel source
the services build at run time must be package data, or an installed service silently falls back
to the slower torch paths."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_source_is_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for package in ("llm_svc", "encoder_svc", "shared", "gateway"):
        globs = data.get(package, [])
        sources = sorted(p.relative_to(ROOT / package) for p in (ROOT / package).rglob("*")
                         if p.suffix in (".c", ".h"))
        missing = [str(s) for s in sources if not any(s.match(g) for g in globs)]
        assert not missing, f"{package}: C sources not in pyproject's package-data: {missing}"
    assert any(Path("models/cpu_packed.c").match(g) for g in data["llm_svc"])  # the check sees models/
