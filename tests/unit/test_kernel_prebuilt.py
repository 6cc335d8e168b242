"""Prebuilt kernels (llm_svc.kernels.prebuild, the image's build stage): where no compiler runs,
the highest x86-64 level this CPU runs is loaded from $MMSERVE_KERNEL_PREBUILT, and
kernel_report says which build loaded, which fell back and why no native build was made."""

from __future__ import annotations

import pytest

from llm_svc.kernels import ckernels
from llm_svc.kernels.ckernels import CKernel, cpu_runs, kernel_report
from llm_svc.models import cpu_gemv

pytestmark = pytest.mark.unit


def gemv_kernel() -> CKernel:
    """A fresh kernel object of cpu_gemv's source (the module's own one may be loaded already)."""
    k = cpu_gemv.KERNEL
    return CKernel(k.source, k.name, k.bind, what=k.what, fallback=k.fallback, flags=k.flags,
                   link_flags=k.link_flags, libs=k.libs, headers=k.headers)


def test_a_level_build_is_keyed_by_the_level_not_the_cpu():
    k = gemv_kernel()
    assert "-march=x86-64-v2" in k.level_flags("x86-64-v2") and "-march=native" not in k.level_flags("x86-64-v2")
    assert k.library_path("x86-64-v2") != k.library_path() != k.library_path("x86-64-v3")
    assert k.library_path("x86-64-v2", ckernels.Path("/x")).parent == ckernels.Path("/x/kernels")


def test_without_a_compiler_the_best_prebuilt_level_loads(tmp_path, monkeypatch):
    levels = [lv for lv in ("x86-64-v3", "x86-64-v2") if cpu_runs(lv)]
    assert levels, "this CPU runs neither x86-64-v2 nor v3"
    builder = gemv_kernel()
    for lv in levels:
        builder._build(builder.library_path(lv, tmp_path / "prebuilt" / lv), lv)
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "cache"))  # nothing native built there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(ckernels.PREBUILT_VAR, str(tmp_path / "prebuilt"))
    k = gemv_kernel()
    assert k.load() is not None
    assert k.build == f"{levels[0]} (prebuilt)" and "no-such-cc" in k.native_error
    report = kernel_report([k])
    assert report["loaded"] == {"cpu_gemv": f"{levels[0]} (prebuilt)"} and report["fallback"] == {}
    assert "no-such-cc" in report["native_unavailable"]


def test_without_a_compiler_or_prebuilt_builds_the_report_names_the_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(ckernels.PREBUILT_VAR, str(tmp_path / "empty"))
    k = gemv_kernel()
    report = kernel_report([k])
    assert report["loaded"] == {} and "no-such-cc" in report["fallback"]["cpu_gemv"]


def test_with_a_compiler_the_native_build_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    k = gemv_kernel()
    assert kernel_report([k])["loaded"] == {"cpu_gemv": "native"}
    assert k.library_path().exists()


def test_prebuild_knows_every_kernel_the_engine_defines():
    from llm_svc.kernels.prebuild import all_kernels

    names = [k.name for k in all_kernels()]
    assert len(names) == len(set(names)) >= 19
    assert {"cpu_paged", "cpu_prefill", "cpu_fused", "cpu_gemv", "cpu_packed"} <= set(names)
