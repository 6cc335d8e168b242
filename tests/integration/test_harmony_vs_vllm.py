"""Our gpt-oss harmony parser vs vLLM 0.32's (``vllm.parser.harmony.HarmonyParser``, which reads
the ids with openai-harmony's ``StreamableParser``) on a corpus of harmony assistant outputs as
o200k-harmony token ids, one-shot and streamed in random id splits (all at once, one by one,
random cuts): same content, reasoning, tool names and arguments (as JSON).

The ids come from openai-harmony's encoding in the vLLM venv (``scripts/vllm_parsers.py
--encode``), with each id's bytes, so that our parser reads them through a small tokenizer
(``O200kTokens``) and our environment needs no openai-harmony. Each output starts after the
prompt's ``<|start|>assistant``, as vLLM's parser expects.

Where we differ deliberately (``VLLM_DIFFERS``, each with its reason):
- ``not_an_object``: a call whose body is not a JSON object. vLLM sends the text (``5``) as
  the arguments; ours wraps it, ``{"value": 5}``, since OpenAI's arguments are a JSON object.
- ``bare_recipient``: a ``to=now`` recipient (no ``functions.``). vLLM's chat path takes any
  recipient that is not a built-in tool as a function; ours takes only ``functions.NAME``, the
  namespace harmony declares the tools in, and keeps the body as content (not dropped).
vLLM's one-shot joins its messages' texts with ``\\n`` (``NEWLINE_JOINED``: two analysis
messages, a preamble and a final answer); its stream, like ours, concatenates them as the model
wrote them. Ours is one function for both, so it equals vLLM's stream there."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from llm_svc.parsers import output_parser
from mmserve.cli import CACHE_DIR
from tests.unit.test_output_parsers import TOOLS, run

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]
VLLM_PY = Path(CACHE_DIR) / "vllm-venv" / "bin" / "python"
SCRIPT = REPO / "scripts" / "vllm_parsers.py"
A, C = "<|start|>assistant", "<|channel|>"
CALL = A + C + "commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"

CORPUS = {
    "analysis_only": C + "analysis<|message|>The user asks 2+2. That is 4.<|end|>",
    "analysis_final": C + "analysis<|message|>Think hard.<|end|>" + A + C + "final<|message|>It is 4.<|return|>",
    "preamble_then_call": (C + "analysis<|message|>need weather<|end|>" + A + C
                           + "commentary<|message|>Let me check the weather.<|end|>"
                           + CALL.format("get_weather", '{"city": "Paris"}')),
    "one_call": CALL.format("get_weather", '{"city": "Rome", "days": 3}').removeprefix(A),
    "two_calls": (CALL.format("get_weather", '{"city": "Rome"}') + CALL.format("now", "{}")).removeprefix(A),
    "call_after_analysis": C + "analysis<|message|>I should call now.<|end|>" + CALL.format("now", "{}"),
    "call_like_reasoning": (C + "analysis<|message|>maybe to=functions.now {\"x\": 1} or "
                            "<tool_call>now</tool_call>, or not.<|end|>" + A + C
                            + "final<|message|>No call needed.<|return|>"),
    "unicode_arguments": CALL.format("get_weather", '{"city": "São \\"Paulo\\" 東京 🌧", "opts": {"a": [1, {"b": null}]}, '
                                                    '"zip": "01234"}').removeprefix(A),
    "preamble_then_final": (C + "commentary<|message|>Looking it up.<|end|>" + A + C
                            + "final<|message|>It is sunny.<|return|>"),
    "final_cut_short": C + "analysis<|message|>short<|end|>" + A + C + "final<|message|>The answer is",
    "two_analyses": (C + "analysis<|message|>first<|end|>" + A + C + "analysis<|message|>second<|end|>" + A + C
                     + "final<|message|>done<|return|>"),
    "recipient_before_channel": (C + "analysis<|message|>call it<|end|>" + A + " to=functions.now" + C
                                 + "commentary <|constrain|>json<|message|>{\"tz\": \"UTC\"}<|call|>"),
    "unterminated_call": CALL.format("now", '{"tz": "Europe/Ro').removeprefix(A).removesuffix("<|call|>"),
    "final_without_header": "Just the final answer, é and 東京.",
    "not_an_object": CALL.format("now", " 5").removeprefix(A),
    "bare_recipient": C + "commentary to=now <|constrain|>json<|message|>{\"x\": 1}<|call|>",
}
NAMES = sorted(CORPUS)
VLLM_DIFFERS = {"not_an_object", "bare_recipient"}
NEWLINE_JOINED = {"two_analyses", "preamble_then_final"}  # vLLM's one-shot: its messages joined with "\n"
SEEDS = range(6)


class O200kTokens:
    """The part of a tokenizer our HarmonyParser uses, over o200k-harmony ids: each id's bytes and
    the special tokens' ids, as openai-harmony's encoding gave them."""

    unk_token_id = None

    def __init__(self, pieces: dict[int, bytes], specials: dict[str, int]):
        self._pieces, self._specials = pieces, specials

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._specials.get(token)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        special = set(self._specials.values()) if skip_special_tokens else set()
        return b"".join(self._pieces[i] for i in ids if i not in special).decode("utf-8", "replace")


def splits(ids: list[int]) -> list[list[list[int]]]:
    """All at once, one id at a time, and random cuts (seeded)."""
    out = [[ids], [[i] for i in ids]]
    for seed in SEEDS:
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randint(1, 12))))
        out.append([ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])])
    return out


def _vllm(args: list[str], job: dict):
    r = subprocess.run([str(VLLM_PY), str(SCRIPT), *args], input=json.dumps(job), capture_output=True, text=True,
                       timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def corpus():
    """name -> (ids, splits), and our tokenizer over those ids; vLLM's results per name."""
    if not VLLM_PY.exists():
        pytest.skip("vLLM venv not built (bash scripts/vllm_venv.sh)")
    enc = _vllm(["--encode"], {"texts": [CORPUS[n] for n in NAMES]})
    tok = O200kTokens({int(i): bytes.fromhex(h) for i, h in enc["pieces"].items()}, enc["specials"])
    cases = [{"family": "gpt_oss", "name": n, "ids": ids, "splits": splits(ids)} for n, ids in zip(NAMES, enc["ids"])]
    theirs = _vllm([], {"tools": TOOLS, "cases": cases})
    return tok, {c["name"]: (c, r) for c, r in zip(cases, theirs)}


def normal(r: dict) -> dict:
    """Arguments compared as JSON where they are JSON (a cut call's text as it is)."""
    calls = []
    for name, args in r["calls"]:
        try:
            calls.append((name, json.loads(args) if isinstance(args, str) else args))
        except ValueError:
            calls.append((name, args))
    return {"content": r["content"], "reasoning": r["reasoning"], "calls": calls}


def ours(tok: O200kTokens, split: list[list[int]]) -> dict:
    r = run(output_parser("gpt_oss", tok, tools=TOOLS), [(ids, tok.decode(ids, skip_special_tokens=True))
                                                        for ids in split])
    return {"content": r["content"], "reasoning": r["reasoning"], "calls": r["calls"]}


def test_the_ids_are_harmony_ids(corpus):
    """The corpus went through the o200k-harmony vocabulary: specials are single ids, and a
    character split over two ids (the rain cloud) is joined by our tokenizer."""
    tok, cases = corpus
    assert tok.convert_tokens_to_ids("<|channel|>") == 200005 and tok.convert_tokens_to_ids("<|call|>") == 200012
    ids = cases["unicode_arguments"][0]["ids"]
    assert "🌧" in tok.decode(ids) and not any("🌧" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("name", NAMES)
def test_same_as_vllm(name, corpus):
    tok, cases = corpus
    case, theirs = cases[name]
    assert "error" not in theirs, theirs
    mine = [ours(tok, s) for s in case["splits"]]
    assert all(m == mine[0] for m in mine), "our split streams differ from our one-shot"
    streams = [normal(s) for s in theirs["streams"]]
    assert all(s == streams[0] for s in streams), "vLLM's split streams differ"
    if name in VLLM_DIFFERS:
        assert mine[0] != streams[0], "vLLM now agrees: drop it from VLLM_DIFFERS"
        return
    assert mine[0] == streams[0]
    whole = normal(theirs["whole"])
    if name in NEWLINE_JOINED:
        no_nl = lambda r: {k: v.replace("\n", "") if isinstance(v, str) else v for k, v in r.items()}
        assert whole != mine[0] and no_nl(whole) == no_nl(mine[0])
    else:
        assert whole == mine[0]
