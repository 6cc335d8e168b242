"""``/v1/completions`` through the gateway with the official ``openai`` client: string and
token-id prompts, batches, streaming, logprobs, echo (with the prompt's logprobs, as
lm-evaluation-harness asks for loglikelihoods), vLLM's ``prompt_logprobs``, and clear 400s."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=120, max_retries=0)


def _ids(stack, text: str) -> list[int]:
    r = httpx.post(f"{stack.url}/tokenize", json={"prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_string_and_token_prompts_agree_and_default_to_16_tokens(client, stack):
    text = "The quick brown fox"
    a = client.completions.create(model=stack.model_name, prompt=text, temperature=0, extra_body={"ignore_eos": True})
    assert a.object == "text_completion" and a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions
    ids = _ids(stack, text)  # the tokenizer's own special tokens, as the string prompt gets them
    b = client.completions.create(model=stack.model_name, prompt=ids, temperature=0, extra_body={"ignore_eos": True})
    assert b.choices[0].text == a.choices[0].text
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == len(ids)


def test_a_batch_gets_one_choice_per_prompt(client, stack):
    prompts = ["one two three", "four five six", "seven"]
    r = client.completions.create(model=stack.model_name, prompt=prompts, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    for i, p in enumerate(prompts):
        alone = client.completions.create(model=stack.model_name, prompt=p, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert alone.choices[0].text == r.choices[i].text


def test_streamed_text_and_logprobs_equal_the_plain_answer(client, stack):
    kw = dict(model=stack.model_name, prompt="hello there", max_tokens=8, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw)
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == plain.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and abs(max(top.values()) - chosen) < 1e-5  # greedy: the best alternative
    text, tokens = "", []
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
    assert text == plain.choices[0].text and tokens == lp.tokens


def test_echo_prepends_the_prompt(client, stack):
    r = client.completions.create(model=stack.model_name, prompt="echo me", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("echo me")
    streamed = "".join(c.text for chunk in client.completions.create(
        model=stack.model_name, prompt="echo me", max_tokens=3, temperature=0, echo=True, stream=True)
        for c in chunk.choices)
    assert streamed == r.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(client, stack):
    """lm-evaluation-harness's loglikelihood request: the logprobs cover the prompt's tokens (the
    first one's null) then the completion's; each prompt position scores as the model's next
    token after the tokens before it; max_tokens=0 answers the prompt alone; streamed the same."""
    text = "The quick brown fox jumps over the lazy dog"
    ids = _ids(stack, text)
    kw = dict(model=stack.model_name, prompt=text, echo=True, logprobs=1, temperature=0)
    r = client.completions.create(**kw, max_tokens=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(text) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    pl = r.choices[0].model_extra["prompt_logprobs"]  # vLLM's field, computed for the echo
    assert pl[0] is None and len(pl) == len(ids)
    assert [pos[str(t)]["logprob"] for pos, t in zip(pl[1:], ids[1:])] == lp.token_logprobs[1:len(ids)]
    nxt = client.completions.create(model=stack.model_name, prompt=ids[:-1], max_tokens=1, logprobs=1, temperature=0)
    (tok, want), = nxt.choices[0].logprobs.top_logprobs[0].items()
    (got_tok, got), = lp.top_logprobs[len(ids) - 1].items()
    assert tok == got_tok and abs(got - want) < 1e-4
    alone = client.completions.create(**kw, max_tokens=0)
    assert alone.choices[0].text == text and alone.choices[0].finish_reason == "length"
    assert alone.usage.completion_tokens == 0 and alone.usage.prompt_tokens == len(ids)
    assert alone.choices[0].logprobs.tokens == lp.tokens[:-1]
    assert alone.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:-1], abs=1e-5)
    tokens, values, streamed = [], [], ""
    for chunk in client.completions.create(**kw, max_tokens=1, stream=True):
        for c in chunk.choices:
            streamed += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert streamed == r.choices[0].text and tokens == lp.tokens
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_prompt_logprobs_on_chat_and_completions(client, stack):
    """vLLM's ``prompt_logprobs`` extra: per prompt position (null for the first) the prompt token
    and the asked-for alternatives, each with its logprob, rank and text."""
    r = client.completions.create(model=stack.model_name, prompt="one two three", max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == r.usage.prompt_tokens and r.choices[0].logprobs is None
    for pos in pl[1:]:
        assert 2 <= len(pos) <= 3 and all({"logprob", "rank", "decoded_token"} <= set(v) for v in pos.values())
        assert sorted(v["rank"] for v in pos.values())[:2] == [1, 2]
    c = client.chat.completions.create(model=stack.model_name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0})
    pl = c.model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == c.usage.prompt_tokens and all(len(pos) == 1 for pos in pl[1:])
    assert "prompt_logprobs" not in client.completions.create(model=stack.model_name, prompt="x", max_tokens=1
                                                              ).choices[0].model_extra


@pytest.mark.parametrize("extra,field", [
    ({"suffix": "x"}, "suffix"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": ["a", "b"], "stream": True}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"best_of": 3}, "best_of"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_completions_are_400s_naming_the_field(stack, extra, field):
    body = {"model": stack.model_name, "prompt": "x", "max_tokens": 2, **extra}
    r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
