"""Run vLLM 0.32's own output parsers on a corpus (JSON on stdin) and print their structures
(JSON on stdout): MiMo's ``MiMoParser`` and Gemma 3's ``PythonicToolParser``, each one-shot and
streamed in the given chunks. Executed by the vLLM venv's python
(tests/integration/test_parsers_vs_vllm.py).

stdin: {"tokenizer": dir, "tools": [...], "cases": [{"family", "text", "chunks", "thinking"}]}
stdout: [{"whole": {content, reasoning, calls}, "stream": {...}}] (calls: [[name, arguments]])."""

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
    from transformers import AutoTokenizer
    job = json.load(sys.stdin)
    tok = AutoTokenizer.from_pretrained(job["tokenizer"])
    run = {"mimo": _mimo, "gemma3": _gemma}
    out = []
    for case in job["cases"]:
        try:
            out.append(run[case["family"]](tok, job["tools"], case))
        except Exception as e:  # reported, so that one case does not hide the others
            out.append({"error": f"{type(e).__name__}: {e}"})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
