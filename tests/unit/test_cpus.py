"""Thread pools sized by the CPUs a process may use: its affinity, capped by its cgroup quota."""

from __future__ import annotations

import os

from shared.cpus import cgroup_quota, usable_cpus


def test_cgroup_v2_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_quota(tmp_path) == 1.5
    assert usable_cpus(tmp_path) == min(2, len(os.sched_getaffinity(0)))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(tmp_path) is None
    assert usable_cpus(tmp_path) == len(os.sched_getaffinity(0))


def test_cgroup_v1_quota(tmp_path):
    d = tmp_path / "cpu,cpuacct"
    d.mkdir()
    (d / "cpu.cfs_quota_us").write_text("100000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(tmp_path) == 1.0 and usable_cpus(tmp_path) == 1
    (d / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_quota(tmp_path) is None


def test_no_cgroup_files_means_the_affinity_mask(tmp_path):
    assert cgroup_quota(tmp_path) is None
    assert usable_cpus(tmp_path) == len(os.sched_getaffinity(0))
