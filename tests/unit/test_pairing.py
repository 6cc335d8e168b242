"""The gateway's prefill / decode pairing: which requests go to a prefill replica first."""

from __future__ import annotations

import pytest

from gateway.routing.llm_router import make_router
from gateway.routing.pairing import PairingConfig, PrefillPairing
from gateway.routing.replicas import ReplicaPool
from shared.rawwire import RawTensor, pack_raw, unpack_raw
from shared.schemas import GenerateRequest, PromptMedia, PromptMessage, PromptText

pytestmark = pytest.mark.unit

P = ["http://p0:8200", "http://p1:8200"]


def _req(media: bool = False) -> GenerateRequest:
    parts = [PromptText(text="hello")]
    if media:
        parts.append(PromptMedia(modality="image", index=0, content_hash="h", num_tokens=16))
    return GenerateRequest(request_id="r", messages=[PromptMessage(role="user", content=parts)])


def _pairing(**cfg) -> PrefillPairing:
    return PrefillPairing(ReplicaPool("llm-prefill", P), make_router("cache_aware"), PairingConfig(**cfg))


def test_conditional_disaggregation_decides_by_length_cache_and_queue():
    pr = _pairing(min_prompt_tokens=100, max_cached_fraction=0.5, max_prefill_queue=1)
    blocks = [1, 2, 3, 4]
    assert pr.choose(_req(), 99, blocks, 0) is None
    assert pr.choose(_req(), 1000, blocks, 2) is None  # half the prefix on the decode replica
    first = pr.choose(_req(), 1000, blocks, 1)
    assert first in P
    pr.router.begin(first)
    second = pr.choose(_req(), 1000, [9, 8], 0)  # the other prefill replica: the first one is busy
    assert second in P and second != first
    pr.router.begin(second)
    assert pr.choose(_req(), 1000, [7], 0) is None  # both busy: prefilled on the decode replica
    assert pr.decisions == {"remote": 2, "local_short": 1, "local_cached": 1, "local_no_prefill": 0,
                            "local_busy": 1}
    pr.router.end(first)
    assert pr.choose(_req(), 1000, [6], 0) == first


def test_no_queue_bound_and_the_body_names_the_prefill_replica():
    pr = _pairing(min_prompt_tokens=0)
    for _ in range(5):
        pr.router.begin(P[0])
        pr.router.begin(P[1])
    assert pr.choose(_req(), 1, [], 0) in P
    tensors, got = unpack_raw(pr.body(_req(), pack_raw({}, _req()), P[1]), GenerateRequest)
    assert tensors == {} and got.kv_transfer_params.do_remote_prefill
    assert got.kv_transfer_params.remote_prefill_url == P[1] and got.messages == _req().messages
    # media sent by value stays in the body, byte for byte
    emb = RawTensor("F32", (16, 4), bytes(range(256)))
    tensors, got = unpack_raw(pr.body(_req(media=True), pack_raw({"mm.0": emb}, _req(media=True)), P[0]),
                              GenerateRequest)
    assert list(tensors) == ["mm.0"] and tensors["mm.0"].data == emb.data and tuple(tensors["mm.0"].shape) == (16, 4)
    assert got.media()[0].num_tokens == 16 and got.kv_transfer_params.remote_prefill_url == P[0]


def test_the_config_refuses_what_means_nothing():
    with pytest.raises(ValueError, match="max_cached_fraction"):
        PairingConfig(max_cached_fraction=0.0)
    with pytest.raises(ValueError, match="min_prompt_tokens"):
        PairingConfig(min_prompt_tokens=-1)
    with pytest.raises(ValueError, match="max_prefill_queue"):
        PairingConfig(max_prefill_queue=-1)


def test_a_shorter_prompt_takes_only_an_idle_prefill_replica():
    pr = _pairing(min_prompt_tokens=1000, idle_min_prompt_tokens=10)
    assert pr.choose(_req(), 9, [1], 0) is None  # under both thresholds
    a = pr.choose(_req(), 50, [1], 0)
    assert a in P
    pr.router.begin(a)
    b = pr.choose(_req(), 50, [1], 0)  # the idle one, whatever its cache
    assert b in P and b != a
    pr.router.begin(b)
    assert pr.choose(_req(), 50, [2], 0) is None  # none idle: stays on its decode replica
    assert pr.choose(_req(), 5000, [3], 0) in P  # a long prompt queues on a busy one
    assert pr.decisions["local_busy"] == 1 and pr.decisions["local_short"] == 1 and pr.decisions["remote"] == 3
    with pytest.raises(ValueError, match="idle_min_prompt_tokens"):
        PairingConfig(idle_min_prompt_tokens=-1)
