"""The two traces of ``benchmarks.spec_decode``, built from text every machine has (the Python
standard library's sources, read by the client only), seeded, sized in the served checkpoint's
own tokens, identical for every side:

* ``chat``: short questions about one standard-library function, with the first paragraph of its
  docstring (``prompt_tokens`` in tokens of the user message);
* ``agent``: a copy-heavy edit: a system prompt for a coding agent, then a contiguous chunk of a
  standard-library module (whole lines, about ``context_tokens`` tokens) and a request to rename
  one of its identifiers and write the whole code out again. A model that follows it copies its
  context; a weak model copies little or repeats itself: acceptance is measured, not assumed.

The modules are a fixed list of pure-Python files present in every CPython 3.10-3.13; their text
differs a little between Python versions (the results record the client's Python)."""

from __future__ import annotations

import ast
import keyword
import random
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

MODULES = ("textwrap.py", "difflib.py", "heapq.py", "bisect.py", "shlex.py", "fnmatch.py", "calendar.py",
           "string.py", "argparse.py", "json/decoder.py", "json/encoder.py", "csv.py", "glob.py", "tokenize.py",
           "functools.py", "statistics.py", "fractions.py", "queue.py", "sched.py", "contextlib.py",
           "dataclasses.py", "configparser.py", "pprint.py", "base64.py", "gettext.py", "locale.py")  # fmt: skip
AGENT_SYSTEM = ("You are a coding agent. You edit the code you are given exactly as asked and answer with the "
                "complete edited code in one Python block, nothing else.")  # fmt: skip


@dataclass(frozen=True)
class Request:
    """One chat completion: its messages, ``max_tokens`` and the prompt's size in tokens (the
    messages' text, without the chat template)."""

    messages: tuple[dict, ...]
    max_tokens: int
    prompt_tokens: int


def _sources() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = [(m, (root / m).read_text(encoding="utf-8")) for m in MODULES if (root / m).exists()]
    if not out:
        raise FileNotFoundError(f"none of the standard-library modules {MODULES[:3]}... under {root}")
    return out


def _docstrings(sources: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(module.function, first docstring paragraph) of every documented function, in file order."""
    out = []
    for name, text in sources:
        mod = name.removesuffix(".py").replace("/", ".")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    out.append((f"{mod}.{node.name}", " ".join(doc.split("\n\n")[0].split())))
    return out


def chat_trace(tok, seed: int, n: int, prompt_tokens: tuple[int, int], max_tokens: int) -> list[Request]:
    """``n`` questions of ``prompt_tokens`` (lo, hi) tokens: the docstring is cut to fit."""
    rng = random.Random(seed)
    docs = _docstrings(_sources())
    out = []
    for _ in range(n):
        fn, doc = rng.choice(docs)
        want = rng.randint(*prompt_tokens)
        head = f"What does `{fn}` do, and when would I use it? Its documentation says: "
        budget = max(8, want - _count(tok, head))
        ids = tok(doc, add_special_tokens=False)["input_ids"][:budget]
        text = head + tok.decode(ids)
        out.append(Request(({"role": "user", "content": text},), max_tokens, _count(tok, text)))
    return out


def agent_trace(tok, seed: int, n: int, context_tokens: int, max_tokens: int) -> list[Request]:
    """``n`` rename-and-rewrite requests, each over a chunk of about ``context_tokens`` tokens."""
    rng = random.Random(seed)
    sources = _sources()
    out = []
    for _ in range(n):
        name, text = rng.choice(sources)
        lines = text.splitlines(keepends=True)
        start = rng.randrange(max(1, len(lines) - 40))
        chunk, used = [], 0
        for line in lines[start:]:
            cost = _count(tok, line)
            if used + cost > context_tokens and chunk:
                break
            chunk.append(line)
            used += cost
        code = "".join(chunk)
        old = _identifier(code, rng)
        user = (f"Here is part of `Lib/{name}` (from line {start + 1}):\n```python\n{code}```\n"
                f"Rename `{old}` to `{old}_v2` everywhere in this code and write out the whole edited code, "
                f"unchanged otherwise.")  # fmt: skip
        msgs = ({"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": user})
        out.append(Request(msgs, max_tokens, _count(tok, AGENT_SYSTEM) + _count(tok, user)))
    return out


def _identifier(code: str, rng: random.Random) -> str:
    """A name defined in ``code`` (a def / class / assignment target), else its most frequent
    non-keyword identifier of 4+ letters."""
    defined = re.findall(r"^\s*(?:def|class)\s+([A-Za-z_]\w*)|^\s*([A-Za-z_]\w*)\s*=[^=]", code, re.M)
    names = sorted({a or b for a, b in defined} - set(keyword.kwlist) - {"self"})
    if names:
        return rng.choice(names)
    counts = Counter(w for w in re.findall(r"[A-Za-z_]\w{3,}", code) if not keyword.iskeyword(w))
    return counts.most_common(1)[0][0] if counts else "value"


def _count(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])
