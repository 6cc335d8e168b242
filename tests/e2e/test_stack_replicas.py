"""Two encoder and two ``swa`` LLM replicas behind one gateway, driven by the ``openai`` client.

Which replica served a request is read from the replicas' own Prometheus counters
(``encoder_requests_total``, ``encoder_cache_lookups_total``, ``mmserve_llm_prompt_tokens_total``):
requests here are sequential, so a counter delta names the replica."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from benchmarks._stack_util import image_part, make_png, scrape, total, totals, user
from mmserve.launcher import LocalStack, StackSpec

pytestmark = pytest.mark.e2e

ENC_REQUESTS = "encoder_requests_total"
ENC_LOOKUPS = "encoder_cache_lookups_total"
LLM_PROMPT_TOKENS = "mmserve_llm_prompt_tokens_total"


@pytest.fixture(scope="module")
def stack(mimo_bundle, tmp_path_factory):
    spec = StackSpec(
        model_dir=str(mimo_bundle),
        gateway_port=0,
        encoders=2,
        llms=2,
        llm_backend="swa",
        llm_routing="cache_aware",
        gateway_env={"health_interval": "0.5"},
    )
    with LocalStack(spec, log_dir=tmp_path_factory.mktemp("stack-replicas-logs")) as s:
        s.wait_ready(timeout=240)
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=120, max_retries=0)


def _ask_image(client, stack, *pngs: bytes, max_tokens: int = 1):
    msgs = [user("What is this?", *(image_part(p) for p in pngs))]
    return client.chat.completions.create(model=stack.model_name, messages=msgs, max_tokens=max_tokens, temperature=0)


def _image_requests(stack) -> list[float]:
    return totals([e.url for e in stack.encoders], ENC_REQUESTS, modality="image", status="200")


def _delta(before, after, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def _served_by(before: list[float], after: list[float]) -> list[int]:
    return [i for i, (b, a) in enumerate(zip(before, after)) if a != b]


@pytest.fixture(scope="module")
def placement(client, stack) -> dict[int, list[bytes]]:
    """Distinct images sent once each, grouped by the encoder that served them, until each
    encoder has served two (the ring places by content hash and port-dependent node names)."""
    owned: dict[int, list[bytes]] = {0: [], 1: []}
    for seed in range(100, 160):
        png = make_png(seed=seed)
        before = _image_requests(stack)
        _ask_image(client, stack, png)
        (idx,) = _served_by(before, _image_requests(stack))
        owned[idx].append(png)
        if min(len(v) for v in owned.values()) >= 2:
            return {i: v[:2] for i, v in owned.items()}
    pytest.fail(f"60 distinct images never spread over both encoders: {[len(v) for v in owned.values()]}")


def test_the_same_image_always_lands_on_the_same_encoder_and_hits_its_cache(client, stack, placement):
    urls = [e.url for e in stack.encoders]
    for owner, pngs in placement.items():
        for png in pngs:
            before = [scrape(u) for u in urls]
            for _ in range(3):
                _ask_image(client, stack, png)
            after = [scrape(u) for u in urls]
            for i in range(2):
                d_req = _delta(before[i], after[i], ENC_REQUESTS, modality="image")
                d_hit = _delta(before[i], after[i], ENC_LOOKUPS, modality="image", result="hit")
                d_miss = _delta(before[i], after[i], ENC_LOOKUPS, modality="image", result="miss")
                if i == owner:
                    assert (d_req, d_hit, d_miss) == (3, 3, 0), f"encoder-{i} (owner)"
                else:
                    assert (d_req, d_hit, d_miss) == (0, 0, 0), f"encoder-{i} (not the owner)"


def test_one_request_fans_its_images_out_to_their_owners(client, stack, placement):
    before = _image_requests(stack)
    r = _ask_image(client, stack, placement[0][0], placement[1][0], placement[0][1])
    assert r.usage.completion_tokens >= 1
    after = _image_requests(stack)
    assert [a - b for a, b in zip(after, before)] == [2, 1]


class _Load:
    """Sends image requests in a loop on a thread, recording every outcome."""

    def __init__(self, client, stack, pngs: list[bytes]) -> None:
        self.client, self.stack, self.pngs = client, stack, pngs
        self.outcomes: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            png = self.pngs[i % len(self.pngs)]
            i += 1
            try:
                _ask_image(self.client, self.stack, png)
                self.outcomes.append((time.monotonic(), "ok"))
            except Exception as e:  # recorded, asserted on by the test
                self.outcomes.append((time.monotonic(), f"{type(e).__name__}: {e}"))

    def __enter__(self) -> "_Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def wait_for(self, n: int, since: float, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while sum(1 for t, _ in self.outcomes if t > since) < n:
            assert time.monotonic() < deadline, f"fewer than {n} requests finished in {timeout}s"
            time.sleep(0.05)

    def errors(self) -> list[str]:
        return [o for _, o in self.outcomes if o != "ok"]


def test_killed_encoder_fails_over_then_rejoins_on_the_same_port(client, stack, placement):
    victim, survivor = stack.encoders
    url_before = victim.url
    pngs = placement[0] + placement[1]
    with _Load(client, stack, pngs) as load:
        load.wait_for(4, since=0)
        victim.kill()  # SIGKILL, mid-run: requests may be in flight on it
        killed_at = time.monotonic()
        load.wait_for(8, since=killed_at)
        assert httpx.get(f"{stack.url}/readyz", timeout=10).status_code == 200
    assert load.errors() == [], load.errors()[:3]

    # while it is down, its images are encoded by the other replica
    for png in placement[0]:
        before = total(scrape(survivor.url), ENC_REQUESTS, modality="image")
        assert _ask_image(client, stack, png).usage.completion_tokens >= 1
        assert total(scrape(survivor.url), ENC_REQUESTS, modality="image") == before + 1

    with _Load(client, stack, pngs) as load:
        stack.restart(victim)  # same argv, same port
        assert victim.url == url_before
        restarted_at = time.monotonic()
        # the gateway's prober puts it back in the ring: its images reach it again
        deadline = time.monotonic() + 30
        while total(scrape(victim.url), ENC_REQUESTS, modality="image") == 0:
            assert time.monotonic() < deadline, "the restarted encoder never got a request back"
            time.sleep(0.2)
        load.wait_for(4, since=restarted_at)
    assert load.errors() == [], load.errors()[:3]

    # with the load stopped: every image is back on its original owner
    for owner, imgs in placement.items():
        for png in imgs:
            before = _image_requests(stack)
            _ask_image(client, stack, png)
            assert _served_by(before, _image_requests(stack)) == [owner]


def _llm_prompt_tokens(stack) -> list[float]:
    return totals([s.url for s in stack.llms], LLM_PROMPT_TOKENS)


SYSTEM = {
    "a": "You are a meticulous assistant for a museum; answer with care and cite the exhibit. " * 4,
    "b": "You are a terse assistant for a bicycle repair shop; answer in short steps only. " * 4,
}


def test_follow_up_turns_stay_on_one_llm_replica_and_reuse_its_prefix_cache(client, stack):
    """Two conversations, interleaved turn by turn: each turn lands on one replica (its prompt
    tokens show up there and only there), every turn of a conversation on the same replica, and
    every follow-up turn reports the previous turn's whole prompt as cached (the previous prompt
    is a token prefix of the next one: the chat template only appends)."""
    history = {
        "a": [
            {"role": "system", "content": SYSTEM["a"]},
            user("What is in this picture?", image_part(make_png(seed=42))),
        ],
        "b": [{"role": "system", "content": SYSTEM["b"]}, user("My chain skips. What should I check?")],
    }
    turns: dict[str, list[tuple[int, int, int]]] = {"a": [], "b": []}  # (replica, prompt, cached)
    for turn in range(4):
        for conv in ("a", "b"):
            before = _llm_prompt_tokens(stack)
            r = client.chat.completions.create(
                model=stack.model_name, messages=history[conv], max_tokens=8, temperature=0
            )
            after = _llm_prompt_tokens(stack)
            (replica,) = _served_by(before, after)
            assert after[replica] - before[replica] == r.usage.prompt_tokens
            turns[conv].append((replica, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
            history[conv] += [
                {"role": "assistant", "content": r.choices[0].message.content},
                user(f"Thanks. And step {turn + 2}?"),
            ]
    for conv, seen in turns.items():
        assert len({rep for rep, _, _ in seen}) == 1, f"conversation {conv} moved between replicas: {seen}"
    short = [
        f"conversation {conv} turn {k}: cached_tokens={seen[k][2]} < previous prompt_tokens={seen[k - 1][1]}"
        for conv, seen in turns.items()
        for k in range(1, len(seen))
        if seen[k][2] < seen[k - 1][1]
    ]
    assert not short, f"{short}; (replica, prompt_tokens, cached_tokens) per turn: {turns}"


def test_a_dead_llm_replica_is_routed_around(client, stack):
    """After one LLM replica is killed (last test here: it stays down), a conversation that was
    on it continues on the other replica and the gateway stays ready."""
    history = [{"role": "system", "content": SYSTEM["b"] + " (failover)"}, user("Brakes squeal. Why?")]
    before = _llm_prompt_tokens(stack)
    client.chat.completions.create(model=stack.model_name, messages=history, max_tokens=4, temperature=0)
    (home,) = _served_by(before, _llm_prompt_tokens(stack))
    other = 1 - home
    stack.llms[home].kill()
    assert httpx.get(f"{stack.url}/readyz", timeout=10).status_code == 200
    for turn in range(3):
        history.append(user(f"And then {turn}?"))
        before_other = total(scrape(stack.llms[other].url), LLM_PROMPT_TOKENS)
        r = client.chat.completions.create(model=stack.model_name, messages=history, max_tokens=4, temperature=0)
        assert r.usage.completion_tokens >= 1
        assert total(scrape(stack.llms[other].url), LLM_PROMPT_TOKENS) == before_other + r.usage.prompt_tokens
        history.append({"role": "assistant", "content": r.choices[0].message.content})
