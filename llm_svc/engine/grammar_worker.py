"""A grammar compile worker: one process compiling one structured-output spec at a time.

``llm_svc.engine.grammar_pool`` starts it as ``python -m llm_svc.engine.grammar_worker`` and
kills it when a compile runs past its limit or nobody waits for it any more: a thread cannot be
stopped in the middle of an xgrammar compile, a process can.

Protocol on stdin / stdout, each message one frame (a 4-byte big-endian length, then msgpack):

* in, first: ``[tokenizer_info_json, threads]`` (``xgr.TokenizerInfo.serialize_json``);
  out: ``[true, ""]`` once the compiler is built;
* in, then: ``[kind, spec, any_whitespace]`` per job; out: ``[true, compiled_json]``
  (``xgr.CompiledGrammar.serialize_json``) or ``[false, message]`` (a ``GrammarError``'s text).

End of input ends the worker. It runs at the lowest CPU priority, dies with the thread that
started it (``PR_SET_PDEATHSIG``) and never dumps core.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import signal
import sys

import msgspec

from .grammar_frames import read_frame, write_frame

_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def compile_spec(compiler, kind: str, spec: str, any_whitespace: bool):
    """One spec -> an ``xgr.CompiledGrammar``; raises ``GrammarError`` naming what cannot be used."""
    from .grammar import choice_grammar, json_safe_lengths
    from .grammar_tags import tag_for_compile
    from .grammar_errors import GrammarError, spec_label

    # vLLM's mapping of disable_any_whitespace: no optional whitespace, and the compact separators
    sep = None if any_whitespace else (",", ":")
    try:
        if kind == "json":
            schema = json_safe_lengths(json.loads(spec))
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=any_whitespace, separators=sep,
                                                strict_mode=True)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace, separators=sep)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(spec)))
        if kind == "grammar":
            return compiler.compile_grammar(spec)
        if kind == "structural_tag":
            return compiler.compile_structural_tag(tag_for_compile(spec, any_whitespace))
    except (RuntimeError, ValueError, TypeError) as e:  # RecursionError (a deep schema) is a RuntimeError
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        detail = _SOURCE_PREFIX.sub("", detail)  # xgrammar's "[time] /project/cpp/file.cc:94: ": not the caller's
        raise GrammarError(f"the {spec_label(kind)} cannot be used for structured output: {detail[:400]}") from None
    raise GrammarError(f"unknown structured output kind {kind!r}")


def yield_cpu() -> None:
    """Run only when no ordinary process wants the CPU: ``SCHED_IDLE`` (nice 19 where it is refused).
    Nice 19 alone was not enough: a waking engine step, front or gateway task waited for the
    compile's time slice to end (up to ~3 ms per wake-up, several per token on 2 cores: steady
    streams' p99 ITL 1.3-1.7x while a hostile schema compiled), where the scheduler preempts a
    ``SCHED_IDLE`` task at once."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    except OSError:
        pass


def _detach(parent: int) -> None:
    """Die with the thread that started this worker; lowest priority; no core files."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent:  # the parent went before prctl took effect
        os._exit(1)
    yield_cpu()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main() -> int:
    _detach(int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid())
    # frames go to a private copy of stdout; anything a library prints lands on stderr instead
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    init = read_frame(inp)
    if init is None:
        return 0
    from .grammar_errors import GrammarError
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(init[0])
    # xgrammar's own cache is off: the engine's is keyed by the whole spec and bounded by count
    compiler = xgr.GrammarCompiler(info, max_threads=int(init[1]), cache_enabled=False)
    write_frame(out, [True, ""])
    while (job := read_frame(inp)) is not None:
        kind, spec, ws = job
        try:
            reply = [True, compile_spec(compiler, kind, spec, bool(ws)).serialize_json()]
        except GrammarError as e:
            reply = [False, str(e)]
        write_frame(out, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
