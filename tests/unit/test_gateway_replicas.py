import asyncio

import pytest

from gateway.routing.encoder_ring import EncoderRing
from gateway.routing.replicas import ReplicaPool

pytestmark = pytest.mark.unit


def resolver(table):
    async def resolve(host, port):
        if host not in table:
            raise OSError("nxdomain")
        return table[host]

    return resolve


def prober(healthy: set[str]):
    async def probe(url: str) -> bool:
        return url in healthy

    return probe


def test_dns_name_with_many_a_records_becomes_many_replicas():
    pool = ReplicaPool(
        "encoder", ["http://encoder:8100", "http://10.0.0.9:8100", "https://tls.example"],
        resolver=resolver({"encoder": ["10.0.0.1", "10.0.0.2"]}),
    )
    asyncio.run(pool.refresh_dns())
    assert pool.replicas() == ["http://10.0.0.1:8100", "http://10.0.0.2:8100", "http://10.0.0.9:8100",
                               "https://tls.example"]


def test_unresolvable_name_is_kept_as_is():
    pool = ReplicaPool("encoder", ["http://gone:8100/"], resolver=resolver({}))
    asyncio.run(pool.refresh_dns())
    assert pool.replicas() == ["http://gone:8100"]


def test_health_probes_remove_and_readd_and_update_the_ring():
    urls = ["http://10.0.0.1:1", "http://10.0.0.2:1", "http://10.0.0.3:1"]
    healthy = set(urls)
    pool = ReplicaPool("encoder", urls, prober=prober(healthy))
    ring = EncoderRing()
    pool.on_change(lambda: ring.set_nodes(pool.routable()))
    assert ring.nodes() == urls
    healthy.discard(urls[1])
    asyncio.run(pool.probe_all())
    assert pool.healthy() == [urls[0], urls[2]] and ring.nodes() == [urls[0], urls[2]]
    healthy.add(urls[1])
    asyncio.run(pool.probe_all())
    assert ring.nodes() == urls


def test_all_down_falls_back_to_all_replicas_and_any_ready_is_false():
    urls = ["http://10.0.0.1:1", "http://10.0.0.2:1"]
    pool = ReplicaPool("llm", urls, prober=prober(set()))
    asyncio.run(pool.probe_all())
    assert pool.healthy() == [] and pool.routable() == urls
    assert asyncio.run(pool.any_ready()) is False
    pool.mark_up(urls[0])
    assert pool.routable() == urls[:1]


def test_dns_change_drops_down_marks_of_vanished_replicas():
    table = {"llm": ["10.0.0.1", "10.0.0.2"]}
    pool = ReplicaPool("llm", ["http://llm:8200"], resolver=resolver(table))
    asyncio.run(pool.refresh_dns())
    pool.mark_down("http://10.0.0.2:8200")
    table["llm"] = ["10.0.0.1", "10.0.0.3"]
    asyncio.run(pool.refresh_dns())
    assert pool.healthy() == ["http://10.0.0.1:8200", "http://10.0.0.3:8200"]


def test_run_loop_probes_periodically():
    healthy = {"http://10.0.0.1:1"}
    pool = ReplicaPool("e", ["http://10.0.0.1:1", "http://10.0.0.2:1"], prober=prober(healthy))

    async def main():
        task = asyncio.create_task(pool.run(health_interval=0.05, dns_interval=0))
        await asyncio.sleep(0.02)
        assert pool.healthy() == ["http://10.0.0.1:1"]
        healthy.add("http://10.0.0.2:1")
        await asyncio.sleep(0.15)
        task.cancel()
        assert len(pool.healthy()) == 2

    asyncio.run(main())


def test_passive_failures_only_count_while_probes_can_recover():
    urls = ["http://10.0.0.1:1", "http://10.0.0.2:1"]
    pool = ReplicaPool("e", urls, prober=prober(set(urls)))
    pool.report_failure(urls[0])
    assert pool.healthy() == urls, "without probing a replica marked down would never return"

    async def main():
        task = asyncio.create_task(pool.run(health_interval=10, dns_interval=0))
        await asyncio.sleep(0.01)
        pool.report_failure(urls[0])
        assert pool.healthy() == urls[1:]
        task.cancel()

    asyncio.run(main())


def test_a_replica_leaves_rotation_only_after_consecutive_failed_probes():
    urls = ["http://10.0.0.1:1", "http://10.0.0.2:1"]
    healthy = set(urls)
    pool = ReplicaPool("encoder", urls, prober=prober(healthy), fail_threshold=3)
    healthy.discard(urls[1])
    for _ in range(2):
        asyncio.run(pool.probe_all())
    assert pool.healthy() == urls  # two slow/failed probes: still routable
    healthy.add(urls[1])
    asyncio.run(pool.probe_all())  # a success resets the count
    healthy.discard(urls[1])
    for _ in range(2):
        asyncio.run(pool.probe_all())
    assert pool.healthy() == urls
    asyncio.run(pool.probe_all())
    assert pool.healthy() == urls[:1]
    with pytest.raises(ValueError):
        ReplicaPool("encoder", urls, fail_threshold=0)


def test_silent_probes_make_a_replica_lost_refusals_only_down():
    urls = ["http://10.0.0.1:1", "http://10.0.0.2:1", "http://10.0.0.3:1"]
    answers = {urls[0]: True, urls[1]: False, urls[2]: None}  # ready, refused / not ready, no answer

    async def probe(url):
        return answers[url]

    lost: list[str] = []
    pool = ReplicaPool("llm", urls, prober=probe, fail_threshold=2)
    pool.on_lost(lost.append)
    asyncio.run(pool.probe_all())
    assert pool.lost() == [] and lost == [] and pool.healthy() == urls
    asyncio.run(pool.probe_all())
    assert pool.healthy() == [urls[0]] and pool.lost() == [urls[2]] and lost == [urls[2]]
    answers[urls[2]] = True  # it answers again: neither lost nor down
    asyncio.run(pool.probe_all())
    assert pool.lost() == [] and pool.healthy() == [urls[0], urls[2]]


def test_unreachable_tells_silence_from_refusal():
    import errno

    import httpx

    from gateway.routing.replicas import unreachable

    def connect_error(code):
        try:
            try:
                raise OSError(code, "x")
            except OSError as e:
                raise httpx.ConnectError(str(e)) from e
        except httpx.ConnectError as e:
            return e

    assert unreachable(httpx.ConnectTimeout("t")) and unreachable(httpx.ReadTimeout("t"))
    assert unreachable(connect_error(errno.EHOSTUNREACH)) and unreachable(connect_error(errno.ENETUNREACH))
    assert not unreachable(connect_error(errno.ECONNREFUSED))
    assert not unreachable(httpx.RemoteProtocolError("closed"))


def test_lose_ends_the_waits_on_that_replica_only():
    import anyio

    from gateway.routing.inflight import InFlightWaits, ReplicaLost

    waits = InFlightWaits()
    results: dict[str, str] = {}

    async def wait_on(name: str, replica: str, answering: bool) -> None:
        try:
            with waits.waiting(replica, answering=answering):
                await anyio.sleep(5)
            results[name] = "finished"
        except ReplicaLost as e:
            results[name] = f"lost {e.replica}"

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_on, "a", "r1", False)
            tg.start_soon(wait_on, "b", "r1", True)
            tg.start_soon(wait_on, "c", "r2", True)
            await anyio.sleep(0.05)
            assert waits.open("r1") == 2 and waits.open("r2") == 1
            assert waits.lose("r1") == 2
            await anyio.sleep(0.05)
            assert waits.open("r1") == 0 and waits.open("r2") == 1
            tg.cancel_scope.cancel()

    asyncio.run(main())
    assert results == {"a": "lost r1", "b": "lost r1"}  # c was cancelled with the group, not lost
    assert waits.lost == {"before_answer": 1, "mid_answer": 1} and waits.open("r2") == 0
