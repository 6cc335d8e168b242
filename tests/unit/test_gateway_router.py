import pytest

from gateway.routing.llm_router import CacheAwareRouter, RoundRobinRouter, make_router
from shared.prefix_keys import prefix_blocks, render_prefix
from shared.schemas import PromptMedia, PromptMessage, PromptText

pytestmark = pytest.mark.unit

R = ["a", "b", "c"]


def msgs(*texts: str) -> list[PromptMessage]:
    return [PromptMessage(role="user", content=[PromptText(text=t)]) for t in texts]


def test_prefix_blocks_share_exactly_the_common_prefix():
    system = "You are a helpful assistant. " * 10  # ~290 chars: 4 full blocks + part
    a = prefix_blocks(msgs(system, "question one " * 10))
    b = prefix_blocks(msgs(system, "another question " * 10))
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common >= 4
    assert a[:common] == b[:common]
    assert len(set(a) & set(b)) == common  # chaining: once different, always different


def test_prefix_blocks_depend_on_role_and_media_hash():
    text = "x" * 200
    user = [PromptMessage(role="user", content=[PromptText(text=text)])]
    system = [PromptMessage(role="system", content=[PromptText(text=text)])]
    assert prefix_blocks(user)[0] != prefix_blocks(system)[0]

    def with_media(h: str) -> list[PromptMessage]:
        media = PromptMedia(modality="image", index=0, content_hash=h, num_tokens=4)
        return [PromptMessage(role="user", content=[media, PromptText(text=text)])]

    assert prefix_blocks(with_media("aa" * 16)) != prefix_blocks(with_media("bb" * 16))
    assert "image:" + "aa" * 16 in render_prefix(with_media("aa" * 16))


def test_short_prompt_has_one_tail_key_and_long_prompts_are_capped():
    hi = prefix_blocks(msgs("hi"))
    assert len(hi) == 1 and hi == prefix_blocks(msgs("hi"))
    assert prefix_blocks(msgs("ho")) != hi
    assert prefix_blocks([]) == []
    assert len(prefix_blocks(msgs("y" * 100_000))) == 512


def test_round_robin_cycles():
    r = RoundRobinRouter()
    assert [r.choose(R, []) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_cache_aware_sticks_to_the_replica_with_the_prefix():
    r = CacheAwareRouter()
    blocks = prefix_blocks(msgs("shared system prompt " * 20, "q1"))
    first = r.choose(R, blocks)
    other = prefix_blocks(msgs("shared system prompt " * 20, "a different question " * 5))
    for _ in range(5):
        assert r.choose(R, other) == first
    assert r.match_len(first, other) >= len(blocks) - 1


def test_cache_aware_spreads_unrelated_prompts_by_load():
    r = CacheAwareRouter()
    chosen = []
    for i in range(3):
        rep = r.choose(R, prefix_blocks(msgs(f"{i} unrelated prompt " * 20)))
        r.begin(rep)
        chosen.append(rep)
    assert sorted(chosen) == R


def test_cache_aware_leaves_an_overloaded_replica():
    r = CacheAwareRouter(load_factor=2.0, load_slack=4)
    blocks = prefix_blocks(msgs("hot prefix " * 30))
    hot = r.choose(R, blocks)
    for _ in range(5):
        r.begin(hot)  # load 5 vs 0: > 2x and > 0+4
    assert r.overloaded(5, 0) and not r.overloaded(4, 0) and not r.overloaded(9, 5)
    spill = r.choose(R, blocks)
    assert spill != hot
    r.begin(spill)
    r.end(hot)  # hot: load 4, not overloaded any more; both now hold the prefix
    third = next(x for x in R if x not in (hot, spill))
    for _ in range(3):
        assert r.choose(R, blocks) in (hot, spill)
    assert r.match_len(third, blocks) == 0


def test_track_counts_in_flight():
    r = RoundRobinRouter()
    with r.track("a"):
        assert r.load("a") == 1
    assert r.load("a") == 0


def test_lru_capacity_evicts_oldest():
    r = CacheAwareRouter(capacity_blocks=3)
    r.record("a", [1, 2, 3])
    r.record("a", [4])
    assert r.match_len("a", [1, 2]) == 0 and r.match_len("a", [2, 3, 4]) == 3


def test_registry():
    assert isinstance(make_router("cache_aware"), CacheAwareRouter)
    assert isinstance(make_router("round_robin"), RoundRobinRouter)
    with pytest.raises(ValueError, match="unknown"):
        make_router("random")


def test_index_bound_from_the_registry_holds_per_replica():
    r = make_router("cache_aware", index_blocks=5)
    for i in range(40):
        r.choose(["a", "b"], [1000 * i + k for k in range(3)])
    assert r.index_blocks() == 10  # 5 per replica, however many prompts
    assert make_router("round_robin", index_blocks=5).index_blocks() == 0
