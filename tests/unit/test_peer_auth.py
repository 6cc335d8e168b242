"""shared.peer_auth and the three sealed formats (KV pages, embeddings, KV events): a value
verifies under the key and identity it was written with, and fails under another key, another
identity (moved), another domain, or with any byte changed; a missing key refuses a remote Redis."""

from __future__ import annotations

import logging

import pytest
import torch

from llm_svc.offload.l3 import PAGE, WINDOW, PeerAuthFailed, decode, encode, fingerprint
from shared import embedding_store
from shared.kv_events import KVEvent, KVEventAuthError
from shared.peer_auth import TAG_BYTES, PeerKey, resolve

pytestmark = pytest.mark.unit

A, B = PeerKey(b"a" * 32), PeerKey(b"b" * 32)


def test_tag_binds_key_domain_identity_and_bytes():
    t = A.tag("kv_page", "k1", b"head", b"payload")
    assert len(t) == TAG_BYTES
    assert A.verify(t, "kv_page", "k1", b"head", b"payload")
    assert not B.verify(t, "kv_page", "k1", b"head", b"payload")  # another key
    assert not A.verify(t, "kv_page", "k2", b"head", b"payload")  # moved
    assert not A.verify(t, "embedding", "k1", b"head", b"payload")  # another kind of value
    assert not A.verify(t, "kv_page", "k1", b"headp", b"ayload")  # the same bytes split otherwise
    assert not A.verify(t[:-1], "kv_page", "k1", b"head", b"payload")
    sealed = A.seal("embedding", "m1", b"value")
    assert A.open("embedding", "m1", sealed) == b"value"
    for bad in (sealed[:-1] + b"X", sealed[:10], b"", None):
        assert A.open("embedding", "m1", bad) is None
    assert B.open("embedding", "m1", sealed) is None and A.open("embedding", "m2", sealed) is None
    assert "a" * 32 not in repr(A)


def test_l3_values_fail_under_another_key_or_redis_key():
    fp = fingerprint({"t": 1})
    payload = bytes(range(256)) * 4
    v = encode(PAGE, 32, fp, payload, "mmkv:{x}:p:1", A)
    assert decode(v, PAGE, 32, fp, len(payload), "mmkv:{x}:p:1", A) == payload
    for key, peer, value in (("mmkv:{x}:p:1", B, v), ("mmkv:{x}:p:2", A, v),
                             ("mmkv:{x}:p:1", A, v[:-1] + bytes([v[-1] ^ 1])), ("mmkv:{x}:p:1", A, b"short")):
        with pytest.raises(PeerAuthFailed):
            decode(value, PAGE, 32, fp, len(payload), key, peer)
    # a tagged value of another kind / length under the right key is no hit either (not an attack)
    assert decode(v, WINDOW, 32, fp, len(payload), "mmkv:{x}:p:1", A) is None
    assert decode(v, PAGE, 32, fp, len(payload) - 1, "mmkv:{x}:p:1", A) is None


def test_embedding_entries_are_sealed_per_media_key():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    raw = embedding_store.to_bytes("m1", t)
    sealed = embedding_store.seal_entry(A, "m1", raw)
    body = embedding_store.open_entry(A, "m1", sealed)
    assert torch.equal(embedding_store.from_bytes("m1", body), t)
    assert embedding_store.open_entry(B, "m1", sealed) is None
    assert embedding_store.open_entry(A, "m2", embedding_store.seal_entry(A, "m1", raw)) is None
    assert embedding_store.open_entry(A, "m1", raw) is None  # unsealed: planted without a tag


def test_kv_events_are_checked_before_use():
    ev = KVEvent("inst", 3, stored=[1, 2], removed=[5], clear=True)
    f = ev.fields("stream", A)
    back = KVEvent.parse(f, "stream", A)
    assert (back.instance, back.seq, back.stored, back.removed, back.clear) == ("inst", 3, [1, 2], [5], True)
    with pytest.raises(KVEventAuthError):
        KVEvent.parse(f, "stream", B)
    with pytest.raises(KVEventAuthError):
        KVEvent.parse(f, "other-stream", A)
    with pytest.raises(KVEventAuthError):
        KVEvent.parse({**f, "a": "1 2 3"}, "stream", A)
    with pytest.raises(KVEventAuthError):
        KVEvent.parse({k: v for k, v in f.items() if k != "m"}, "stream", A)
    with pytest.raises(KVEventAuthError):
        KVEvent.parse({**f, "m": "zz"}, "stream", A)


def test_resolve_needs_a_key_for_a_remote_redis(caplog):
    with pytest.raises(ValueError, match="MMSERVE_LLM_PEER_KEY is not set") as e:
        resolve(None, ["redis://:secretpw@redis:6379/0"], "MMSERVE_LLM_PEER_KEY")
    assert "secretpw" not in str(e.value) and "redis" in str(e.value)
    with pytest.raises(ValueError, match="MMSERVE_X_PEER_KEY"):
        resolve(None, [None, "redis+cluster://127.0.0.1:7000,10.0.0.5:7001"], "MMSERVE_X_PEER_KEY")
    with pytest.raises(ValueError, match="at least 16"):
        resolve("short", ["redis://127.0.0.1"], "MMSERVE_LLM_PEER_KEY")
    with caplog.at_level(logging.WARNING, logger="shared.peer_auth"):
        dev = resolve(None, ["redis://127.0.0.1:6379/0", "unix:///tmp/r.sock", "redis://localhost"],
                      "MMSERVE_TEST_ONCE_PEER_KEY")
    assert dev.fallback and "MMSERVE_TEST_ONCE_PEER_KEY is not set" in caplog.text
    key = resolve("k" * 64, ["redis://redis:6379/0"], "MMSERVE_LLM_PEER_KEY")
    assert not key.fallback and key.tag("d", "i") != dev.tag("d", "i")
