"""Token outputs of the engine core -> ``GenOutput`` increments per request: detokenized text
deltas, stop strings (a match finishes the request here and asks the core to abort it), and
the final counts. Runs in the front (or beside an in-process engine)."""

from __future__ import annotations

from dataclasses import dataclass

from llm_svc.types.messages import CoreToken

from llm_svc.types.request import GenOutput
from llm_svc.types.request import PreparedRequest
from llm_svc.engine.textproc import OutputText, logprob_entry, prompt_logprob_entries


@dataclass
class _Pending:
    prep: PreparedRequest
    sink: object  # has put(GenOutput), e.g. a RequestStream
    text: OutputText
    num_out: int = 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._reqs: dict[str, _Pending] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def prep(self, request_id: str) -> PreparedRequest | None:
        p = self._reqs.get(request_id)
        return p.prep if p is not None else None

    def fail(self, request_id: str, message: str, status: int, code: str | None = None) -> bool:
        """End one request with an error now (the core is told to abort it by the caller)."""
        p = self._reqs.pop(request_id, None)
        if p is None:
            return False
        p.sink.put(GenOutput(error=message, error_status=status, error_code=code,
                             prompt_tokens=len(p.prep.prompt_ids), completion_tokens=p.num_out))
        return True

    def add(self, prep: PreparedRequest, sink, key: str | None = None) -> None:
        """Track ``prep`` under ``key`` (the id the engine knows it by; its request_id if None)."""
        key = prep.request_id if key is None else key
        assert key not in self._reqs, key
        self._reqs[key] = _Pending(prep, sink, OutputText(self.tokenizer, prep.sampling))

    def process(self, t: CoreToken) -> bool:
        """Hand ``t`` to its request's sink; True if the core must abort the request (a stop
        string matched before the core finished it)."""
        p = self._reqs.get(t.request_id)
        if p is None:
            return False  # finished here already (stop string, or failed)
        if t.error is not None:
            del self._reqs[t.request_id]
            p.sink.put(GenOutput(error=t.error, error_status=t.status or 500, error_code=t.code,
                                 prompt_tokens=len(p.prep.prompt_ids), completion_tokens=p.num_out))
            return False
        out = GenOutput()
        if t.prompt_logprobs is not None:
            out.prompt_logprobs = prompt_logprob_entries(self.tokenizer, p.prep.prompt_ids, t.prompt_logprobs)
        if t.token_id is not None:
            p.num_out += 1
            out.token_ids = [t.token_id]
            out.text = p.text.push(t.token_id)
            if p.prep.return_logprobs:
                out.logprobs = [t.logprob]
                out.token_logprobs = [logprob_entry(self.tokenizer, t.token_id, t.logprob, t.top or ())]
        reason = t.finish_reason
        abort = False
        if p.text.stopped:  # a stop string matched (it wins over length on the same token)
            abort = reason is None
            reason = "stop"
        if reason is not None:
            del self._reqs[t.request_id]
            out.text += p.text.flush()
            out.finish_reason = reason
            out.prompt_tokens = len(p.prep.prompt_ids)
            out.completion_tokens = p.num_out
            out.cached_tokens = t.num_cached_tokens
        p.sink.put(out)
        return abort

    def fail_all(self, message: str, status: int) -> None:
        reqs, self._reqs = self._reqs, {}
        for p in reqs.values():
            p.sink.put(GenOutput(error=message, error_status=status, prompt_tokens=len(p.prep.prompt_ids),
                                 completion_tokens=p.num_out))
