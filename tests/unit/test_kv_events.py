"""KV events as bookkeeping: router keys -> prompt positions, the core's tracker over a real
radix tree (stored, removed on eviction and when the SWA windows are gone), the gateway's index
(order, gaps, snapshots) and the router that uses it."""

from __future__ import annotations

import pytest

from gateway.routing.kv_index import KVIndex
from gateway.routing.llm_router import EventRouter
from llm_svc.kv.events import KVKeyTracker
from llm_svc.kv.pool import SlotPool
from llm_svc.kv.radix import NO_SLOT, RadixCache
from shared.kv_events import KVEvent, KVSnapshot
from shared.prefix_keys import BLOCK_CHARS, key_positions, prefix_blocks, prefix_layout
from shared.schemas import PromptMedia, PromptMessage, PromptText

pytestmark = pytest.mark.unit


def messages(text: str, media_tokens: int = 0) -> list[PromptMessage]:
    parts = [PromptText(text=text)]
    if media_tokens:
        parts.append(PromptMedia(modality="image", index=0, content_hash="ab" * 16, num_tokens=media_tokens))
        parts.append(PromptText(text=text))
    return [PromptMessage(role="system", content=[PromptText(text="be brief. " * 10)]),
            PromptMessage(role="user", content=parts)]


def test_key_positions_rise_and_media_is_exact():
    msgs = messages("x" * 300, media_tokens=50)
    layout = prefix_layout(msgs)
    assert layout.keys == prefix_blocks(msgs)
    (c0, c1), = layout.media
    # 30 system tokens, 20 text tokens, the image's 50 rows at [50, 100), then 25 text tokens
    pos = key_positions(layout, 125, [(50, 50, 0)], system_len=30)
    ts = [t for _, t in pos]
    assert ts == sorted(ts) and ts[-1] == 125 and all(1 <= t <= 125 for t in ts)
    for (key, t), end in zip(pos, layout.ends):
        if c0 < end <= c1:
            assert t == 100, "a block ending inside the image needs all of its rows"
        if end <= c0:
            assert t <= 50
    with pytest.raises(ValueError):
        key_positions(layout, 125, [])  # one span per media item


class Tree:
    def __init__(self, n: int = 64, window: int = 4) -> None:
        self.full, self.swa = SlotPool(n, "full"), SlotPool(n, "swa")
        self.t = RadixCache(window, self.full, self.swa)

    def insert(self, keys: list[int], swa_mask: str | None = None) -> None:
        mask = swa_mask or "1" * len(keys)
        self.t.insert(keys, self.full.alloc(len(keys)), [self.swa.alloc(1)[0] if c == "1" else NO_SLOT for c in mask])


def test_tracker_stores_settled_keys_and_removes_evicted_ones():
    tree = Tree()
    tracker = KVKeyTracker(tree.t, slack=4)
    a, b = list(range(1, 21)), [100 + i for i in range(20)]
    tracker.expect("a", a, [(11, 10), (12, 20)])
    tracker.expect("b", b, [(21, 20)])
    tree.insert(a)
    tracker.settle("a")
    tracker.settle("b")  # never reached the tree (e.g. aborted): nothing stored
    assert tracker.poll() == ([11, 12], [])
    tracker.check_integrity()
    tree.t.evict(64, 0)  # everything unlocked goes
    assert tracker.poll() == ([], [11, 12])
    assert len(tracker) == 0
    tracker.check_integrity()


def test_a_prefix_whose_windows_are_gone_is_not_held():
    tree = Tree()
    tracker = KVKeyTracker(tree.t, slack=4)
    keys = list(range(1, 21))
    # SWA kept only for the last 4 tokens: position 10 has no window-safe end within 4 tokens
    tree.insert(keys, "0" * 16 + "1" * 4)
    tracker.expect("r", keys, [(1, 10), (2, 20)])
    tracker.settle("r")
    assert tracker.poll() == ([2], [])


def test_tracker_capacity_drops_the_oldest_as_removed():
    tree = Tree(n=128)
    tracker = KVKeyTracker(tree.t, slack=4, capacity=2)
    for i in range(3):
        keys = [1000 * (i + 1) + j for j in range(8)]
        tree.insert(keys)
        tracker.expect(f"r{i}", keys, [(i + 1, 8)])
        tracker.settle(f"r{i}")
    stored, removed = tracker.poll()
    assert stored == [2, 3] and removed == []  # 1 was stored and dropped within one poll
    assert tracker.held() == {2, 3}
    tracker.check_integrity()


def test_index_applies_in_order_and_distrusts_a_gap_until_a_snapshot():
    idx = KVIndex()
    assert idx.apply(KVEvent("a", 1, stored=[1, 2, 3]))
    assert idx.apply(KVEvent("a", 2, removed=[3]))
    assert idx.match_len("a", [1, 2, 3]) == 2 and idx.live("a")
    assert not idx.apply(KVEvent("a", 4, stored=[9]))  # 3 is missing
    assert not idx.live("a") and not idx.holds("a", 9)
    idx.load(KVSnapshot(instance="a", seq=4, keys=[1, 9]))
    assert idx.live("a") and idx.apply(KVEvent("a", 4, stored=[9]))  # already in the snapshot
    assert idx.apply(KVEvent("a", 5, clear=True, stored=[7]))
    assert idx.match_len("a", [7, 1]) == 1
    assert not idx.apply(KVEvent("b", 3, stored=[1]))  # met mid-stream: stale until loaded
    assert idx.stale() == {"b"}
    idx.check_integrity()
    idx.forget("a")
    idx.check_integrity()
    assert idx.total == 0
    from shared.kv_events import DOMAIN, KVEventAuthError, _message
    from shared.peer_auth import PeerKey

    malformed = {"i": "a", "s": "x"}  # tagged as a publisher would, but no seq
    malformed["m"] = PeerKey.development().tag(DOMAIN, "st", _message(malformed)).hex()
    with pytest.raises(ValueError) as e:
        KVEvent.parse(malformed, "st")
    assert not isinstance(e.value, KVEventAuthError)


def test_event_router_prefers_the_replica_that_holds_the_prefix():
    reports = {"A": {1, 2}, "B": {1, 2, 3}, "C": None}

    def held(replica, blocks):
        keys = reports[replica]
        if keys is None:
            return None
        n = 0
        while n < len(blocks) and blocks[n] in keys:
            n += 1
        return n

    router = EventRouter(held, recent_s=0)
    assert router.choose(["A", "B", "C"], [1, 2, 3, 4]) == "B"
    reports["B"] = set()  # B evicted it: A holds the longest prefix now
    assert router.choose(["A", "B", "C"], [1, 2, 3, 4]) == "A"
    # C publishes nothing: this gateway's own record of what it sent counts
    router.record("C", [1, 2, 3, 4])
    assert router.choose(["A", "B", "C"], [1, 2, 3, 4]) == "C"
    # what this gateway just sent counts until the replica's events arrive
    recent = EventRouter(held, recent_s=60)
    recent.record("A", [5, 6])
    assert recent.match_len("A", [5, 6]) == 2 and recent.match_len("B", [5, 6]) == 0


def test_prefix_block_boundaries_are_the_router_blocks():
    layout = prefix_layout(messages("y" * 1000))
    assert all(e % BLOCK_CHARS == 0 for e in layout.ends[:-1]) and layout.ends[-1] == layout.total
