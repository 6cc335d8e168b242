"""Structured outputs: grammars compiled off the engine loop, one matcher per constrained request,
one token bitmask per step applied to the constrained rows on the logits' device.

The grammar engine is xgrammar (vLLM's default backend). ``benchmarks/grammar_engines.py``
measures it against llguidance on the same schema corpus; docs/api.md gives the figures and why.

Compiles run in worker processes (``grammar_pool``: a compile past its CPU-time limit, or one
nobody waits for any more, is killed there), keyed by a hash of the spec, so a request repeating
a schema another request compiled shares its compile, and a large schema never stalls the steps
of other users: the engine admits a constrained request only once its grammar is ready
(``GrammarCache.submit`` returns a ``Future``, one per caller: cancelling it drops the caller's
interest, and the compile when nobody else waits). A spec larger than ``max_bytes`` is refused
before any compile. xgrammar itself (seconds to import) and the tokenizer's token table are
loaded by the first compile, on the pool's thread, so an engine that never sees a constrained
request never pays for them.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch

from shared.schemas import StructuredSpec

from .grammar_errors import CompileTimeout, GrammarError, timeout_message, too_large
from .grammar_pool import CompilePool, Job

__all__ = ["GrammarCache", "GrammarError", "Matcher", "apply_grammars", "choice_grammar", "draft_masks",
           "json_safe_lengths", "spec_key"]


def _xgr():
    import xgrammar

    return xgrammar


_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _ebnf_literal(s: str) -> str:
    out = []
    for ch in s:
        if ch in _EBNF_ESCAPES:
            out.append(_EBNF_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_grammar(choices: list[str]) -> str:
    """``choice`` as an EBNF grammar: exactly one of the strings (vLLM's conversion)."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def json_safe_lengths(node):
    """A schema in which every length-bounded plain string can hold no raw control character.

    xgrammar (0.2.8-0.2.9) renders ``minLength`` / ``maxLength`` as ``[^"\\\r\n]{lo,hi}``, which
    admits U+0000-U+001F unescaped: invalid JSON that strict parsers (Python's ``json.loads``)
    refuse. Such a string gets the equivalent ``pattern`` with the control characters excluded
    (escapes were not admitted there either), its bounds in the pattern. Other nodes are copied
    unchanged."""
    if isinstance(node, list):
        return [json_safe_lengths(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for k in _SUBSCHEMAS:
        if isinstance(out.get(k), (dict, list)):
            out[k] = json_safe_lengths(out[k])
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [json_safe_lengths(x) for x in out[k]]
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: json_safe_lengths(x) for name, x in out[k].items()}
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out)
            and not any(k in out for k in ("pattern", "format", "enum", "const"))):
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)  # the pattern holds the bounds
        out["pattern"] = "^[^\\u0000-\\u001f\"\\\\]{%d,%s}$" % (lo, "" if hi is None else int(hi))
    return out


def spec_key(spec: StructuredSpec) -> str:  # any_whitespace None and its setting may differ: both kept
    return hashlib.sha256(json.dumps([spec.kind, spec.spec, spec.any_whitespace]).encode()).hexdigest()


@dataclass(eq=False)
class _Pending:
    job: Job
    waiters: set = field(default_factory=set)  # the callers' Futures


class GrammarCache:
    """The engine's compiler: ``submit(spec)`` -> a Future of an ``xgr.CompiledGrammar``. At most
    ``capacity`` results are kept (least recently submitted go first): compiled grammars, and the
    specs that timed out (a repeat fails at once instead of burning another ``timeout_s``).

    ``workers`` compile processes at most, ``threads`` xgrammar threads each; ``max_bytes``: the
    largest spec (UTF-8 bytes) compiled at all; ``timeout_s``: CPU seconds one compile may use."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], threads: int = 1, capacity: int = 256,
                 any_whitespace: bool = True, workers: int = 2, max_bytes: int = 256 * 1024,
                 timeout_s: float = 10.0, full_speed_s: float = 1.0, slow_share: float = 1.0) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self.capacity = capacity
        self.any_whitespace = any_whitespace  # a spec's default (vLLM's too); False: compact JSON, no whitespace
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self._info = None  # xgr.TokenizerInfo, built by the pool's first start (on its thread)
        self._results: OrderedDict[str, object] = OrderedDict()  # key -> CompiledGrammar | CompileTimeout
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self.compiled = 0
        ref = weakref.ref(self)  # the pool's thread must not keep the cache alive

        def init() -> str:
            return ref()._token_table()

        def done(job: Job, result: str | None, error: BaseException | None) -> None:
            cache = ref()
            if cache is not None:
                cache._finished(job, result, error)

        self._pool = CompilePool(init, workers=workers, threads=threads, timeout_s=timeout_s,
                                 full_speed_s=full_speed_s, slow_share=slow_share)
        self._on_done = done
        weakref.finalize(self, self._pool.close)

    def submit(self, spec: StructuredSpec) -> Future:
        """A Future of ``spec``'s compiled grammar, or of its ``GrammarError`` (``CompileTimeout``
        past the time limit). Raises ``GrammarTooLarge`` (an ``InvalidRequest``) at once for a spec
        over ``max_bytes``. Cancel the Future when the result is no longer wanted."""
        size = len(spec.spec.encode("utf-8", "replace"))
        if size > self.max_bytes:
            raise too_large(spec.kind, size, self.max_bytes)
        key = spec_key(spec)
        fut: Future = Future()
        with self._lock:
            hit = self._results.get(key)
            if hit is not None:
                self._results.move_to_end(key)
                fut.set_exception(hit) if isinstance(hit, BaseException) else fut.set_result(hit)
                return fut
            p = self._pending.get(key)
            if p is None:
                ws = self.any_whitespace if spec.any_whitespace is None else spec.any_whitespace
                job = self._pool.submit([spec.kind, spec.spec, ws], self._on_done, key=key,
                                        timeout_message=timeout_message(spec.kind, self.timeout_s))
                p = self._pending[key] = _Pending(job)
            p.waiters.add(fut)
        fut.add_done_callback(lambda f: self._left(key, p, f))
        return fut

    def compile(self, spec: StructuredSpec):
        """Compile now, waiting on this thread (cached like ``submit``)."""
        return self.submit(spec).result()

    def stats(self) -> dict[str, int]:
        """The compile pool's state: ``grammar_workers``, ``_queued``, ``_running``, ``_timeouts``, ..."""
        return self._pool.stats()

    def worker_pids(self) -> list[int]:
        return self._pool.worker_pids()

    def _token_table(self) -> str:
        xgr = _xgr()
        self._info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                        stop_token_ids=list(self.stop_token_ids))
        return self._info.serialize_json()

    def _left(self, key: str, p: _Pending, fut: Future) -> None:
        """A caller's Future is done; if it was cancelled and nobody else waits, drop the compile."""
        if not fut.cancelled():
            return
        with self._lock:
            p.waiters.discard(fut)
            if p.waiters or self._pending.get(key) is not p:
                return
            del self._pending[key]
        self._pool.cancel(p.job)

    def _finished(self, job: Job, result: str | None, error: BaseException | None) -> None:
        """On the pool's thread: the job's grammar (deserialized here, off the engine loop) or error."""
        out: object = error
        if error is None:
            try:
                out = _xgr().CompiledGrammar.deserialize_json(result, self._info)
            except (RuntimeError, ValueError) as e:
                out = GrammarError(f"the compiled grammar could not be loaded: {e}")
        key = job.key
        with self._lock:
            if error is None and not isinstance(out, BaseException):
                self.compiled += 1
            if not isinstance(out, BaseException) or isinstance(out, CompileTimeout):
                self._results[key] = out
                while len(self._results) > self.capacity:
                    self._results.popitem(last=False)
            p = self._pending.get(key)
            waiters = []
            if p is not None and p.job is job:
                del self._pending[key]
                waiters = list(p.waiters)
        for fut in waiters:
            try:
                fut.set_exception(out) if isinstance(out, BaseException) else fut.set_result(out)
            except InvalidStateError:  # cancelled meanwhile
                pass

    def matcher(self, compiled) -> "Matcher":
        return Matcher(_xgr().GrammarMatcher(compiled))  # rollback is unlimited (speculative decoding's drafts)

    def close(self) -> None:
        """Stop the compile workers (killed and reaped); pending Futures fail."""
        self._pool.close()


class Matcher:
    """One request's grammar state: which tokens may come next, and the tokens taken so far."""

    def __init__(self, m) -> None:
        self._m = m

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        if n:
            self._m.rollback(n)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Take ``token_id``; False if the grammar forbids it (the state is unchanged)."""
        return bool(self._m.accept_token(int(token_id)))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and took its stop token: nothing more may follow."""
        return bool(self._m.is_terminated())


def draft_masks(x: torch.Tensor, matcher: Matcher, drafts: list[int]) -> tuple[torch.Tensor, int]:
    """One request's rows ``x [d + 1, V]`` (row j after ``drafts[:j]``) -> the rows with the
    grammar's forbidden tokens at -inf, and how many drafts the grammar takes (rows past the first
    draft it refuses, or past its end, are not masked and must not be used). The matcher is left
    as it was."""
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(x.shape[0], x.shape[1])
    taken = 0
    for j in range(x.shape[0]):
        if matcher.terminated:  # drafts[j - 1] ended it: row j is never used (left unmasked)
            break
        matcher.fill(bitmask, j)
        if j == len(drafts) or not matcher.accept(drafts[j]):
            break
        taken += 1
    matcher.rollback(taken)
    x = x[:taken + 1].float().contiguous().clone()
    xgr.apply_token_bitmask_inplace(x, bitmask[:taken + 1].to(x.device))
    return x, taken


def apply_grammars(x: torch.Tensor, matchers: list[Matcher | None]) -> torch.Tensor:
    """x [B, V] logits -> the same tensor with every constrained row's forbidden tokens at -inf
    (in place; rows whose matcher is None untouched). One bitmask [B, ceil(V / 32)] int32."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return x
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(x.shape[0], x.shape[1])  # all ones: no row forbids anything
    for i in rows:
        matchers[i].fill(bitmask, i)
    if not x.is_contiguous() or x.dtype != torch.float32:
        x = x.float().contiguous()
    xgr.apply_token_bitmask_inplace(x, bitmask.to(x.device, non_blocking=True), indices=rows)
    return x
