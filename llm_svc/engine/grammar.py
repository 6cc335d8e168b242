"""Structured outputs: grammars compiled off the engine loop, one matcher per constrained request,
one token bitmask per step applied to the constrained rows on the logits' device.

The grammar engine is xgrammar (vLLM's default backend). ``benchmarks/grammar_engines.py``
measures it against llguidance on the same schema corpus; the README gives the figures and why.

Compiles run on a small thread pool (xgrammar releases the GIL while compiling), keyed by a hash
of the spec, so a request repeating a schema another request compiled shares its future, and a
large schema never stalls the steps of other users: the engine admits a constrained request only
once its grammar is ready (``GrammarCache.submit`` returns a ``Future``). xgrammar itself (seconds
to import) and the tokenizer's token table are loaded by the first compile, on the pool, so an
engine that never sees a constrained request never pays for them.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from shared.schemas import StructuredSpec


def _lower_priority() -> None:
    """A compile thread yields the CPU to the engine's step threads: a large schema's compile
    (seconds) then costs other users' steps little, on a machine with few cores."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: this thread alone
    except (AttributeError, OSError):
        pass


def _xgr():
    import xgrammar

    return xgrammar


class GrammarError(ValueError):
    """The spec cannot be compiled: the message names what the engine cannot honour."""


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


@dataclass
class GrammarCache:
    """The engine's compiler: ``submit(spec)`` -> a Future of an ``xgr.CompiledGrammar``. At most
    ``capacity`` compiled grammars are kept (least recently submitted go first)."""

    tokenizer: object
    vocab_size: int
    stop_token_ids: list[int]
    threads: int = 1
    capacity: int = 256
    any_whitespace: bool = True  # a spec's default (vLLM's too); False: compact JSON, no whitespace at all

    def __post_init__(self) -> None:
        self._compiler = None  # built by the first compile, on the pool
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="grammar",
                                        initializer=_lower_priority)
        self._futures: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0

    def submit(self, spec: StructuredSpec) -> Future:
        key = spec_key(spec)
        with self._lock:
            fut = self._futures.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._futures.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._futures[key] = fut
            while len(self._futures) > self.capacity:
                self._futures.popitem(last=False)
            return fut

    def compile(self, spec: StructuredSpec):
        """Compile now on this thread (cached like ``submit``)."""
        return self.submit(spec).result()

    def _compile(self, spec: StructuredSpec):
        if self._compiler is None:
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.stop_token_ids))
            # xgrammar's own cache is off: ours is keyed by the whole spec and bounded by count
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)
        c = self._compiler
        ws = self.any_whitespace if spec.any_whitespace is None else spec.any_whitespace
        # vLLM's mapping of disable_any_whitespace: no optional whitespace, and the compact separators
        sep = None if ws else (",", ":")
        try:
            if spec.kind == "json":
                schema = json_safe_lengths(json.loads(spec.spec))
                out = c.compile_json_schema(json.dumps(schema), any_whitespace=ws, separators=sep, strict_mode=True)
            elif spec.kind == "json_object":
                out = c.compile_json_schema('{"type": "object"}', any_whitespace=ws, separators=sep)
            elif spec.kind == "regex":
                out = c.compile_regex(spec.spec)
            elif spec.kind == "choice":
                out = c.compile_grammar(choice_grammar(json.loads(spec.spec)))
            elif spec.kind == "grammar":
                out = c.compile_grammar(spec.spec)
            elif spec.kind == "structural_tag":
                out = c.compile_structural_tag(spec.spec)
            else:  # the schema type says which kinds exist; this is a programming error
                raise AssertionError(spec.kind)
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                    "grammar": "grammar (EBNF)", "structural_tag": "structural_tag"}[spec.kind]
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GrammarError(f"the {what} cannot be used for structured output: {detail[:400]}") from None
        self.compiled += 1
        return out

    def matcher(self, compiled) -> "Matcher":
        return Matcher(_xgr().GrammarMatcher(compiled))  # rollback is unlimited (speculative decoding's drafts)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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
