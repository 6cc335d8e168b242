"""The engine core's torch threads (the setting when given, else every allowed CPU) and its
OpenMP wait policy (passive unless the user chose one)."""

import os

import pytest

from llm_svc.core.process import core_env, core_threads
from shared.settings import LLMSettings

pytestmark = pytest.mark.unit


def test_explicit_threads_win():
    assert core_threads(LLMSettings(model_dir="m", threads=3)) == 3


def test_default_uses_every_allowed_cpu():
    assert core_threads(LLMSettings(model_dir="m")) == len(os.sched_getaffinity(0))


def test_core_env_makes_openmp_threads_sleep_at_barriers_unless_the_user_chose():
    assert core_env({"PATH": "/bin"}) == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    assert core_env({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"

