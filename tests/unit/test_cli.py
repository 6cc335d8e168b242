"""``mmserve encoder|llm|gateway``: every setting is a flag of its command, generated from the
settings model, with vLLM's names where they mean the same; flags win over the environment."""

from __future__ import annotations

import pytest

from mmserve import cli
from shared.settings import EncoderSettings, GatewaySettings, LLMSettings

pytestmark = pytest.mark.unit

SERVICES = {"encoder": EncoderSettings, "llm": LLMSettings, "gateway": GatewaySettings}


def settings(argv: list[str]):
    return cli._settings(cli.build_parser().parse_args(argv))


def subparser(name: str):
    ap = cli.build_parser()
    return next(a for a in ap._subparsers._group_actions if a.dest == "cmd").choices[name]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_setting_is_a_flag(name):
    flags = set(subparser(name)._option_string_actions)
    missing = [f for f in SERVICES[name].model_fields if "--" + f.replace("_", "-") not in flags]
    assert not missing


def test_vllm_names_mean_the_same_settings():
    s = settings(["llm", "--model", "/m", "--max-model-len", "1000", "--served-model-name", "served",
                  "--max-num-seqs", "3", "--max-num-batched-tokens", "256", "--dtype", "bfloat16",
                  "--no-enable-prefix-caching"])
    assert (s.model_dir, s.max_model_len, s.model_name, s.max_running, s.max_batch_tokens, s.dtype,
            s.enable_prefix_cache) == ("/m", 1000, "served", 3, 256, "bfloat16", False)
    assert settings(["gateway", "--served-model-name", "g"]).model_name == "g"
    assert settings(["encoder", "--model", "/m", "--served-model-name", "e"]).model_name == "e"


def test_flags_win_over_the_environment_which_wins_over_defaults(monkeypatch):
    monkeypatch.setenv("MMSERVE_LLM_MAX_RUNNING", "7")
    monkeypatch.setenv("MMSERVE_LLM_KV_BYTES", "123456789")
    s = settings(["llm", "--model", "/m", "--max-num-seqs", "9"])
    assert (s.max_running, s.kv_bytes, s.max_batch_tokens) == (9, 123456789, 2048)


def test_the_bundle_directory_flag_then_the_environment_then_the_tiny_model(monkeypatch):
    monkeypatch.setattr(cli, "ensure_default_model", lambda d: d or "/tiny")
    assert settings(["llm"]).model_dir == "/tiny"
    monkeypatch.setenv("MMSERVE_LLM_MODEL_DIR", "/from-env")  # compose sets it, with no flag
    assert settings(["llm"]).model_dir == "/from-env"
    assert settings(["llm", "--model", "/flag"]).model_dir == "/flag"
    assert settings(["encoder", "--model-dir", "/enc"]).model_dir == "/enc"


def test_the_launchers_flags_still_parse():
    """What ``mmserve up`` (mmserve/launcher.py), the README and the benchmarks pass."""
    e = settings(["encoder", "--model", "/m", "--host", "0.0.0.0", "--port", "8101", "--redis-url", "redis://r",
                  "--max-batch-size", "4", "--device", "cpu"])
    assert (e.host, e.port, e.redis_url, e.max_batch_size) == ("0.0.0.0", 8101, "redis://r", 4)
    m = settings(["llm", "--model", "/m", "--port", "8201", "--backend", "hf", "--kv-bytes", "1000000",
                  "--kv-l3-url", "redis://r", "--media-redis-url", "redis://r", "--log-level", "debug"])
    assert (m.port, m.backend, m.kv_bytes, m.kv_l3_url, m.media_redis_url, m.log_level) == (
        8201, "hf", 1000000, "redis://r", "redis://r", "debug")
    g = settings(["gateway", "--model-name", "tiny", "--encoder-urls", "", "--llm-urls", "http://a:1,http://b:2",
                  "--api-keys", "k1,k2", "--allowed-hosts", "10.0.0.0/8", "--llm-routing", "round_robin"])
    assert (g.model_name, g.encoder_urls, g.llm_urls, g.api_keys, g.allowed_hosts, g.llm_routing) == (
        "tiny", [], ["http://a:1", "http://b:2"], ["k1", "k2"], ["10.0.0.0/8"], "round_robin")


def test_a_bad_value_names_its_flag_and_variable(capsys):
    with pytest.raises(SystemExit) as e:
        settings(["llm", "--model", "/m", "--max-model-len", "many"])
    assert e.value.code == 2
    assert "--max-model-len / MMSERVE_LLM_MAX_MODEL_LEN" in capsys.readouterr().err


def test_the_llm_role_and_vllms_kv_role_names(monkeypatch, capsys):
    assert settings(["llm", "--model", "/m"]).role == "both"  # today's unified replica
    assert settings(["llm", "--model", "/m", "--role", "prefill"]).role == "prefill"
    for vllm, ours in (("kv_producer", "prefill"), ("kv_consumer", "decode"), ("kv_both", "both")):
        assert settings(["llm", "--model", "/m", "--kv-role", vllm]).role == ours
    monkeypatch.setenv("MMSERVE_LLM_ROLE", "kv_consumer")
    assert settings(["llm", "--model", "/m"]).role == "decode"
    with pytest.raises(SystemExit):
        settings(["llm", "--model", "/m", "--role", "encode"])
    err = capsys.readouterr().err
    assert "--role / MMSERVE_LLM_ROLE" in err and "prefill, decode or both" in err and "kv_producer" in err


def test_the_kv_transport_and_vllms_nixl_connector_name(monkeypatch, capsys):
    assert settings(["llm", "--model", "/m"]).kv_transport == "auto"  # NIXL where installed
    assert settings(["llm", "--model", "/m", "--kv-transport", "tcp"]).kv_transport == "tcp"
    assert settings(["llm", "--model", "/m", "--kv-connector", "NixlConnector", "--role", "decode"]).kv_transport == "nixl"
    monkeypatch.setenv("MMSERVE_LLM_KV_TRANSPORT", "NIXL")
    assert settings(["llm", "--model", "/m"]).kv_transport == "nixl"
    with pytest.raises(SystemExit):
        settings(["llm", "--model", "/m", "--kv-transport", "mooncake"])
    err = capsys.readouterr().err
    assert "--kv-transport / MMSERVE_LLM_KV_TRANSPORT" in err and "auto, tcp, nixl" in err


def test_a_role_other_than_both_is_refused_where_the_engine_core_cannot_serve_it(capsys):
    """The hand-over runs in the engine core: with the transformers reference backend, or split
    over tensor-parallel ranks, a prefill or decode replica would silently be a unified one, so
    the service refuses to start and says why."""
    assert cli.main(["llm", "--model", "/m", "--role", "prefill", "--backend", "hf"]) == 2
    err = capsys.readouterr().err
    assert "role 'prefill' needs the engine core" in err and "--backend swa" in err and "Traceback" not in err
    assert cli.main(["llm", "--model", "/m", "--role", "decode", "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "tensor_parallel_size > 1 is not served yet" in err and "Traceback" not in err


def test_the_role_is_on_metrics():
    from llm_svc.front.metrics import LLMMetrics
    from llm_svc.types.request import BackendStats

    m = LLMMetrics()
    assert 'mmserve_llm_role{role="both"} 1.0' in m.render(BackendStats()).decode()  # today's default
    m.set_role("decode")
    text = m.render(BackendStats()).decode()
    assert 'mmserve_llm_role{role="decode"} 1.0' in text and 'mmserve_llm_role{role="both"} 0.0' in text
