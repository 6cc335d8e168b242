"""Streaming detokenization and stop strings: token ids in, safe-to-emit text deltas out."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from llm_svc.types.messages import CorePromptLogprob
from shared.schemas import PromptTokenLogprob, SampledLogprob, SamplingParams, TokenLogprob


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas.

    A delta is only emitted once it is final: a token that ends inside a multi-byte UTF-8
    character (decoded as U+FFFD) is held until the character completes. Decoding a window
    ``ids[prefix:]`` and subtracting ``ids[prefix:read]`` keeps tokenizers that change a token's
    text by its left context (leading spaces) correct, at O(window) cost per token.

    A fast tokenizer whose ``decode`` is its Rust tokenizer's (``clean_up_tokenization_spaces``
    off) steps with ``tokenizers``' ``DecodeStream``, which applies this same rule in one call.
    The window is tracked here as well: ``flush`` needs it (the stream has none), and so does a
    step the stream refuses because the window's text no longer starts with its prefix's (byte
    fallback tokens that turn an emitted byte into U+FFFD): that step takes the rule here, as
    every step does for other tokenizers.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        streams = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if streams else None

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=self._skip)

    def _window_delta(self) -> str | None:
        """The text ``ids[prefix:]`` adds to ``ids[prefix:read]``, None while not final."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            return new_text[len(prefix_text) :]
        return None

    def _stream_delta(self) -> str | None:
        try:
            return self._stream.step(self._backend, self.ids[-1])
        except Exception as e:  # the stream holds the id and kept its window
            if "Invalid prefix" not in str(e):
                raise
        delta = self._window_delta()
        if delta is not None:  # the window moves to ids[read:]: a new stream starts there
            self._stream = DecodeStream(self.ids[self._read :], skip_special_tokens=self._skip)
        return delta

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        delta = self._stream_delta() if self._stream is not None else self._window_delta()
        if delta is None:
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held (an incomplete character at the end stays U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        if self._stream is not None:
            self._stream = DecodeStream(skip_special_tokens=self._skip)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


class StopStringFilter:
    """Cuts the text at the first stop string and never emits the stop string itself.

    While streaming it holds back the longest tail that could still become a stop string.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        buf = self._held + delta
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out


class OutputText:
    """Detokenizer + stop strings for one request: ``push(token) -> delta``; ``stopped`` says a
    stop string matched (the engine then finishes the request with reason ``stop``)."""

    def __init__(self, tokenizer, sampling: SamplingParams):
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringFilter(sampling.stop)
        self._min_tokens = sampling.min_tokens
        self._n = 0

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def push(self, token_id: int) -> str:
        self._n += 1
        delta = self._detok.push(token_id)
        if self._n <= self._min_tokens:  # stop strings are looked for after min_tokens (vLLM)
            return delta
        return self._stops.push(delta)

    def flush(self) -> str:
        return self._stops.push(self._detok.flush()) + self._stops.flush()


def token_finish_reason(
    token_id: int, num_output: int, sampling: SamplingParams, eos_token_ids: Sequence[int]
) -> str | None:
    """Finish reason decided by the token just sampled (the ``num_output``-th output token).
    EOS and stop tokens count only past ``min_tokens`` (before that they are masked out of the
    logits, see ``min_tokens_banned``)."""
    if num_output > sampling.min_tokens and token_id in stop_ids(sampling, eos_token_ids):
        return "stop"
    if num_output >= sampling.max_tokens:
        return "length"
    return None


def stop_ids(sampling: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The token ids that end this request: its stop tokens, plus EOS unless ``ignore_eos``."""
    return list(sampling.stop_token_ids) + ([] if sampling.ignore_eos else list(eos_token_ids))


def min_tokens_banned(sampling: SamplingParams, num_output: int, eos_token_ids: Sequence[int]) -> list[int]:
    """Token ids the next sample must not take: the stop ids while fewer than ``min_tokens``
    tokens were produced (``num_output`` so far), none after."""
    return stop_ids(sampling, eos_token_ids) if num_output < sampling.min_tokens else []


def logprob_entry(tokenizer, token_id: int, logprob: float, top: Sequence[tuple[int, float]] = ()) -> SampledLogprob:
    """A generated token's text alone (as vLLM's ``decode([id])``), its logprob and alternatives."""
    dec = tokenizer.decode
    alts = [TokenLogprob(token_id=i, token=dec([i]), logprob=lp) for i, lp in top]
    return SampledLogprob(token_id=token_id, token=dec([token_id]), logprob=logprob, top=alts)


def prompt_logprob_entries(tokenizer, prompt_ids: Sequence[int],
                           scores: Sequence[CorePromptLogprob]) -> list[PromptTokenLogprob]:
    """The engine's prompt logprobs (one per prompt position) with each token's text alone, as
    ``logprob_entry`` writes it (each distinct id decoded once)."""
    texts: dict[int, str] = {}

    def dec(i: int) -> str:
        t = texts.get(i)
        if t is None:
            t = texts[i] = tokenizer.decode([i])
        return t

    return [PromptTokenLogprob(token_id=t, token=dec(t), logprob=s.logprob, rank=s.rank,
                               top=[TokenLogprob(token_id=i, token=dec(i), logprob=lp) for i, lp in s.top])
            for t, s in zip(prompt_ids, scores, strict=True)]
