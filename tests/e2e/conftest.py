"""The whole local stack (gateway + encoder + LLM as processes), started once per module."""

from __future__ import annotations

import pytest

from shared.launcher import LocalStack, StackSpec


@pytest.fixture(scope="module")
def stack(mimo_bundle, tmp_path_factory):
    spec = StackSpec(model_dir=str(mimo_bundle), gateway_port=0)  # default backend: swa
    with LocalStack(spec, log_dir=tmp_path_factory.mktemp("stack-logs")) as s:
        s.wait_ready(timeout=240)
        yield s
