"""Run vLLM 0.32's own output parsers on a corpus (JSON on stdin) and print their structures
(JSON on stdout): MiMo's ``MiMoParser``, Gemma 3's ``PythonicToolParser`` and gpt-oss's
``HarmonyParser``, each one-shot and streamed in the given chunks. Executed by the vLLM venv's
python (tests/integration/test_parsers_vs_vllm.py, tests/integration/test_harmony_vs_vllm.py).

stdin: {"tokenizer": dir (not needed for gpt_oss), "tools": [...],
        "cases": [{"family", "text", "chunks", "thinking"}]}; a gpt_oss case has "ids" (o200k-harmony
        token ids) and "splits" (lists of id chunks) instead of "text" and "chunks".
stdout: [{"whole": {content, reasoning, calls}, "stream": {...}}] (calls: [[name, arguments]]); a
        gpt_oss case has "streams", one per split, instead of "stream".

``--encode``: stdin {"texts": [...]} -> stdout {"ids": [[...]], "pieces": {id: hex of its bytes},
"specials": {tag: id}}: the texts as o200k-harmony ids (special tokens as such), from
openai-harmony's encoding, with what our side needs to decode them."""

from __future__ import annotations

import json
import sys


def _request(tools):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    return ChatCompletionRequest(model="x", messages=[{"role": "user", "content": "x"}], tools=tools)


def _mimo(tok, tools, case):
    from vllm.parser.mimo import MiMoParser
    kw = {} if case["thinking"] is None else {"chat_template_kwargs": {"enable_thinking": case["thinking"]}}
    req = _request(tools)
    reasoning, content, calls = MiMoParser(tok, req.tools, **kw).parse(case["text"], req, enable_auto_tools=True)
    whole = {"content": content or "", "reasoning": reasoning or "",
             "calls": [[c.name, c.arguments] for c in calls or []]}
    p = MiMoParser(tok, req.tools, **kw)
    stream = {"content": "", "reasoning": "", "calls": {}}
    for i, chunk in enumerate(case["chunks"]):
        d = p.parse_delta(chunk, [], req, finished=i == len(case["chunks"]) - 1)
        _add(stream, d)
    return {"whole": whole, "stream": _calls_list(stream)}


def _gemma(tok, tools, case):
    from vllm.tool_parsers.pythonic_tool_parser import PythonicToolParser
    req = _request(tools)
    info = PythonicToolParser(tok, req.tools).extract_tool_calls(case["text"], req)
    whole = {"content": info.content or "", "reasoning": "",
             "calls": [[c.function.name, c.function.arguments] for c in info.tool_calls]}
    p = PythonicToolParser(tok, req.tools)
    stream, prev = {"content": "", "reasoning": "", "calls": {}}, ""
    for chunk in case["chunks"]:
        cur = prev + chunk
        _add(stream, p.extract_tool_calls_streaming(prev, cur, chunk, [], [], [], req))
        prev = cur
    return {"whole": whole, "stream": _calls_list(stream)}


def _harmony_encoding():
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def _encode(job):
    enc = _harmony_encoding()
    ids = [enc.encode(t, allowed_special="all") for t in job["texts"]]
    used = {i for seq in ids for i in seq}
    specials = {t: enc.encode(t, allowed_special="all")[0] for t in enc.special_tokens_set}
    pieces = {i: enc.decode([i], errors="surrogateescape").encode("utf-8", "surrogateescape").hex() for i in used}
    return {"ids": ids, "pieces": pieces, "specials": specials}


class _HarmonyTokenizer:
    """What vLLM's HarmonyParser asks of a tokenizer (the reasoning parser keeps it; a turn that
    ends mid-header is decoded with it)."""

    def __init__(self, enc):
        self._enc = enc

    def decode(self, ids, **_):
        return self._enc.decode(ids)

    def get_vocab(self):
        return {}


def _gpt_oss(_tok, tools, case):
    from vllm.parser.harmony import HarmonyParser
    from vllm.reasoning.gptoss_reasoning_parser import GptOssReasoningParser
    from vllm.tool_parsers.gptoss_tool_parser import GptOssToolParser

    class Parser(HarmonyParser):  # what vLLM's ParserManager composes for a gpt_oss model
        reasoning_parser_cls = GptOssReasoningParser
        tool_parser_cls = GptOssToolParser

    tok, req = _HarmonyTokenizer(_harmony_encoding()), _request(tools)
    ids = case["ids"]
    reasoning, content, calls = Parser(tok, req.tools).parse(tok.decode(ids), req, enable_auto_tools=True,
                                                             model_output_token_ids=ids)
    whole = {"content": content or "", "reasoning": reasoning or "",
             "calls": [[c.name, c.arguments] for c in calls or []]}
    streams = []
    for split in case["splits"]:
        p, acc = Parser(tok, req.tools), {"content": "", "reasoning": "", "calls": {}}
        for i, chunk in enumerate(split):
            _add(acc, p.parse_delta(tok.decode(chunk), chunk, req, finished=i == len(split) - 1))
        streams.append(_calls_list(acc))
    return {"whole": whole, "streams": streams}


def _add(acc, d):
    if d is None:
        return
    acc["content"] += d.content or ""
    acc["reasoning"] += d.reasoning or ""
    for tc in d.tool_calls or []:
        call = acc["calls"].setdefault(tc.index, ["", ""])
        if tc.function is not None:
            call[0] += tc.function.name or ""
            call[1] += tc.function.arguments or ""


def _calls_list(acc):
    acc["calls"] = [acc["calls"][i] for i in sorted(acc["calls"])]
    return acc


def main() -> None:
    job = json.load(sys.stdin)
    if "--encode" in sys.argv[1:]:
        json.dump(_encode(job), sys.stdout)
        return
    tok = None
    if job.get("tokenizer"):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(job["tokenizer"])
    run = {"mimo": _mimo, "gemma3": _gemma, "gpt_oss": _gpt_oss}
    out = []
    for case in job["cases"]:
        try:
            out.append(run[case["family"]](tok, job["tools"], case))
        except Exception as e:  # reported, so that one case does not hide the others
            out.append({"error": f"{type(e).__name__}: {e}"})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
