"""Settings that cannot be mistyped (issue 43, item 8): an MMSERVE_* variable that names no setting
of the service is a warning naming the nearest real one, or with strict a start-up error (exit 2);
another service's variable passes. And the one cache root, MMSERVE_CACHE_DIR."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mmserve import cli
from shared import cache_dir
from shared.env_check import OTHER_VARS, check_env, check_service_env, env_names, service_settings
from shared.settings import EncoderSettings, GatewaySettings, LLMSettings

pytestmark = pytest.mark.unit


def test_a_typo_is_a_warning_naming_the_nearest_setting(caplog):
    env = {"MMSERVE_GATEWAY_FAIL_THRESHOLD": "5", "MMSERVE_GATEWAY_PORT": "8001", "PATH": "/bin"}
    with caplog.at_level(logging.WARNING, logger="mmserve.env"):
        problems = check_env("gateway", [GatewaySettings], env, strict=False)
    assert len(problems) == 1
    assert "MMSERVE_GATEWAY_FAIL_THRESHOLD" in problems[0]
    assert "nearest: MMSERVE_GATEWAY_HEALTH_FAIL_THRESHOLD (--health-fail-threshold)" in problems[0]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == problems


def test_a_setting_no_service_of_that_prefix_has_says_who_has_it():
    (msg,) = check_env("llm", [LLMSettings], {"MMSERVE_LLM_MAX_QUEUE": "8"}, strict=False)
    assert msg.startswith("MMSERVE_LLM_MAX_QUEUE names no setting of the LLM service; nearest: MMSERVE_LLM_")
    assert "max_queue is a setting of the gateway and the encoder" in msg


def test_strict_is_exit_code_2_with_the_same_message(caplog):
    env = {"MMSERVE_ENCODER_MAX_BATCH": "4"}
    with caplog.at_level(logging.ERROR, logger="mmserve.env"), pytest.raises(SystemExit) as exc:
        check_env("encoder", [EncoderSettings], env, strict=True)
    assert exc.value.code == 2
    assert "MMSERVE_ENCODER_MAX_BATCH names no setting of the encoder; nearest: MMSERVE_ENCODER_MAX_BATCH_SIZE" \
        in caplog.text


def test_another_services_variables_and_the_named_ones_pass(caplog):
    env = {"MMSERVE_LLM_THREADS": "2", "MMSERVE_ENCODER_VIDEO_FPS": "2",  # settings of the others
           "MMSERVE_LLM_NO_SUCH": "1",  # another service's prefix: that service reports it
           "MMSERVE_PEER_KEY": "k" * 32, "MMSERVE_CACHE_DIR": "/tmp/c", "MMSERVE_STRICT_ENV": "0",
           "mmserve_gateway_api_keys": "k1"}  # read case-insensitively, as pydantic-settings does
    with caplog.at_level(logging.DEBUG, logger="mmserve.env"):
        assert check_env("gateway", [GatewaySettings], env, strict=True) == []
    assert "MMSERVE_LLM_THREADS is a setting of another service" in caplog.text


def test_up_checks_every_services_prefix():
    env = {"MMSERVE_LLM_THREADS": "2", "MMSERVE_LLM_NO_SUCH": "1", "MMSERVE_GATEWAY_LLM_URL": "http://x"}
    problems = check_service_env("up", strict=False, environ=env)
    assert [p.split()[0] for p in problems] == ["MMSERVE_GATEWAY_LLM_URL", "MMSERVE_LLM_NO_SUCH"]
    assert "nearest: MMSERVE_GATEWAY_LLM_URLS" in problems[0]


def test_strict_from_the_environment():
    with pytest.raises(SystemExit) as exc:
        check_service_env("gateway", strict=False, environ={"MMSERVE_STRICT_ENV": "1", "MMSERVE_GATEWAY_PROT": "1"})
    assert exc.value.code == 2


def test_the_known_names_are_the_models_fields():
    assert env_names(LLMSettings)["MMSERVE_LLM_MAX_MODEL_LEN"] == "max_model_len"
    assert env_names(GatewaySettings)["MMSERVE_GATEWAY_MALLOC_MMAP_THRESHOLD"] == "malloc_mmap_threshold"
    every = set().union(*(env_names(c) for c in service_settings().values()))
    assert not every & set(OTHER_VARS), "a variable read by name shadows a setting"


@pytest.mark.parametrize("argv", [["llm", "--strict-env"], ["up", "--strict-env"], ["gateway", "--strict-env"]])
def test_the_commands_stop_before_loading_anything(monkeypatch, argv):
    monkeypatch.setenv("MMSERVE_LLM_MAX_QUEUE", "8")
    monkeypatch.setenv("MMSERVE_GATEWAY_MAX_QUEUE_", "8")
    monkeypatch.setattr(cli, "ensure_default_model", lambda _: pytest.fail("started despite --strict-env"))
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2


def test_the_cache_root_and_its_deprecated_name(monkeypatch, caplog):
    monkeypatch.setattr(cache_dir, "_warned", set())
    assert cache_dir.cache_root({}) == Path.home() / ".cache" / "mmserve"
    assert cache_dir.cache_path("kernels", {"MMSERVE_CACHE_DIR": "/c"}) == Path("/c/kernels")
    with caplog.at_level(logging.WARNING, logger="shared.cache_dir"):
        assert cache_dir.cache_root({"MMSERVE_CACHE": "/old"}) == Path("/old")
    assert "MMSERVE_CACHE is deprecated: set MMSERVE_CACHE_DIR=/old" in caplog.text
    monkeypatch.setattr(cache_dir, "_warned", set())
    assert cache_dir.cache_root({"MMSERVE_CACHE": "/old", "MMSERVE_CACHE_DIR": "/new"}) == Path("/new")
    assert "deprecated and ignored" in caplog.text


def test_the_default_model_is_under_the_root():
    assert cli.DEFAULT_MODEL_DIR == cli.CACHE_DIR / cache_dir.DEFAULT_MODEL
