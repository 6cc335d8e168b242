import pytest

from gateway.routing.encoder_ring import EncoderRing
from shared.hashing import content_hash

pytestmark = pytest.mark.unit

NODES = [f"http://10.0.0.{i}:8100" for i in range(1, 5)]
KEYS = [content_hash(str(i).encode()) for i in range(400)]


def test_same_key_same_node_and_independent_of_order():
    a, b = EncoderRing(NODES), EncoderRing(list(reversed(NODES)))
    for k in KEYS:
        assert a.owner(k) == a.owner(k) == b.owner(k)


def test_keys_spread_over_nodes():
    ring = EncoderRing(NODES)
    counts = {n: 0 for n in NODES}
    for k in KEYS:
        counts[ring.owner(k)] += 1
    assert all(c > 40 for c in counts.values()), counts


def test_candidates_are_distinct_and_start_at_owner():
    ring = EncoderRing(NODES)
    for k in KEYS[:50]:
        c = ring.candidates(k)
        assert c[0] == ring.owner(k)
        assert sorted(c) == sorted(NODES)
        assert ring.candidates(k, 2) == c[:2]


def test_removing_a_node_moves_only_its_keys():
    full, less = EncoderRing(NODES), EncoderRing(NODES[1:])
    moved = [k for k in KEYS if full.owner(k) != less.owner(k)]
    assert moved and all(full.owner(k) == NODES[0] for k in moved)
    # the new owner of a moved key is the next node on the old ring: retry order is stable
    assert all(less.owner(k) == full.candidates(k)[1] for k in moved)


def test_set_nodes_and_empty_ring():
    ring = EncoderRing()
    assert ring.owner("k") is None and ring.candidates("k") == []
    ring.set_nodes(NODES[:1])
    assert ring.candidates("k") == NODES[:1] and ring.nodes() == NODES[:1]


def test_bounded_load_spills_a_hot_owner_to_the_next_node_on_the_ring():
    nodes = [f"http://e{i}:8100" for i in range(4)]
    ring = EncoderRing(nodes)
    key = "hot-item"
    order = ring.candidates(key)
    loads = {n: 0 for n in nodes}
    assert ring.bounded_candidates(key, loads.get) == order  # idle: the owner, in ring order
    loads[order[0]] = 2  # cap = ceil(1.5 * 3 / 4) = 2: the owner is at it
    assert ring.bounded_candidates(key, loads.get)[:2] == [order[1], order[0]]
    loads[order[1]] = 2
    got = ring.bounded_candidates(key, loads.get)
    assert got[0] == order[2] and sorted(got) == sorted(nodes)  # every node stays a fallback
    loads = {n: 5 for n in nodes}  # all equally busy: cap = ceil(1.5 * 21 / 4) = 8, owner keeps it
    assert ring.bounded_candidates(key, loads.get, limit=2) == order[:2]
    assert EncoderRing([nodes[0]]).bounded_candidates(key, lambda n: 99) == [nodes[0]]
    assert EncoderRing().bounded_candidates(key, lambda n: 0) == []
