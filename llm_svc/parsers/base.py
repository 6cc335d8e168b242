"""The interface every model family's output parser implements: a request's generated output,
fed as it comes, split into content, reasoning and tool calls."""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` + 24 random ``[a-zA-Z0-9]``."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass
class ToolCallDelta:
    """A piece of one tool call. A call's first delta has its id and name (arguments usually
    empty); the arguments of all its deltas, concatenated in order, are its JSON arguments. The
    non-streamed answer is the same concatenation (``llm_svc.front.output_shape.merge_calls``), so the
    two agree by construction."""

    index: int                # the call's position in this output: 0, 1, ...
    id: str | None = None     # only on a call's first delta
    name: str | None = None   # only on a call's first delta (the full function name)
    arguments: str = ""       # a fragment of the call's JSON arguments; fragments concatenate


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: ParsedDelta) -> None:
        """Append ``other`` to this delta (both stay in output order)."""
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)


class OutputParser(ABC):
    """One request's output, fed as it is generated."""

    @abstractmethod
    def feed(self, token_ids: list[int], text: str) -> ParsedDelta:
        """The next generated tokens and their detokenized text (special tokens skipped, as the
        service shows text); returns what is now certain. Text that may still turn out to be the
        start of a tag is held back until it is certain."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """The output ended: everything held back. A call whose name was sent stays a call (each
        family's module says how its arguments are closed); text not yet committed to a call
        goes to content."""

    @property
    @abstractmethod
    def tool_calls_made(self) -> int:
        """How many tool calls were started (their id and name sent) so far."""
