"""docs/configuration.md is generated from the settings models and CI fails while it is stale; every
MMSERVE_* name the docs, the deployment files and the sources use exists (issue 43, item 8)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mmserve import config_docs
from shared.cache_dir import DEPRECATED_VAR
from shared.env_check import env_names, env_prefix, known_names, service_settings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"MMSERVE_[A-Z0-9_]+")
PAGE = ROOT / "docs" / "configuration.md"
# the page and the modules that explain the check name a typo on purpose
EXPLAINS_TYPOS = {PAGE, ROOT / "shared" / "env_check.py", ROOT / "mmserve" / "config_docs.py"}


def names_in(path: Path) -> list[tuple[int, str]]:
    return [(i, m.group(0)) for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            for m in NAME.finditer(line)]


def prefixes() -> set[str]:
    """``MMSERVE_LLM_`` as in ``MMSERVE_LLM_<NAME>``."""
    return {env_prefix(c) for c in service_settings().values()}


def test_the_page_is_current():
    assert PAGE.read_text() == config_docs.render(), \
        "docs/configuration.md is stale: run python -m mmserve.config_docs --write"
    assert config_docs.main(["--check"]) == 0


def test_the_page_has_every_variable_with_a_description():
    page = PAGE.read_text()
    for cls in service_settings().values():
        for name, field in env_names(cls).items():
            assert f"`{name}`" in page
            assert cls.model_fields[field].description, f"{cls.__name__}.{field} has no description"


def test_check_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(config_docs.render().replace("| `health_fail_threshold` |", "| `fail_threshold` |"))
    monkeypatch.setattr(config_docs, "PAGE", stale)
    assert config_docs.main(["--check"]) == 1
    assert "stale: run python -m mmserve.config_docs --write" in capsys.readouterr().err


def deployment_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("compose*.yaml")),
             ROOT / ".env.example", ROOT / "Dockerfile"]
    files += sorted(p for p in (ROOT / "deploy").rglob("*") if p.is_file())
    return [p for p in files if p.is_file()]


def test_the_docs_and_deployment_files_name_real_variables():
    known = known_names() | prefixes()
    assert len(deployment_files()) > 10
    unknown = [f"{p.relative_to(ROOT)}:{i}: {n}" for p in deployment_files() if p not in EXPLAINS_TYPOS
               for i, n in names_in(p) if n not in known]
    assert unknown == [], "names no setting nor a variable of shared.env_check.OTHER_VARS"
    deprecated = [f"{p.relative_to(ROOT)}:{i}" for p in deployment_files() if p != PAGE
                  for i, n in names_in(p) if n == DEPRECATED_VAR]
    assert deprecated == [], f"{DEPRECATED_VAR} is deprecated: name MMSERVE_CACHE_DIR"


def test_every_variable_the_sources_read_is_known():
    """A variable read by name (``os.environ.get("MMSERVE_...")``) belongs in OTHER_VARS, or the
    services would call it unknown; a prefix a source matches on (``startswith``) is fine."""
    known = known_names() | prefixes()
    files = [p for d in ("gateway", "encoder_svc", "llm_svc", "shared", "mmserve", "benchmarks", "scripts")
             for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".sh") and p not in EXPLAINS_TYPOS]
    unknown = [f"{p.relative_to(ROOT)}:{i}: {n}" for p in files for i, n in names_in(p)
               if n not in known and not any(k.startswith(n) for k in known)]
    assert unknown == []
