"""A structural tag (``StructuredSpec(kind="structural_tag")``) as the compile worker hands it to
xgrammar: its XML tool arguments without whitespace around a value, and the server's whitespace
setting applied.

xgrammar's ``qwen_xml`` style (0.2.9) admits whitespace between ``<parameter=K>`` and a value
that is not a plain string, and between the value and ``</parameter>``, as padding that is not
part of the value: ``<parameter=city> Rome </parameter>`` passes ``"enum": ["Rome"]``, as does
``<parameter=s>  ab</parameter>`` ``"maxLength": 3``. MiMo's parser (like vLLM's MiMo converter)
takes a value verbatim, and MiMo's template writes none, so the padding would turn a valid
grammar path into an invalid argument. Each ``qwen_xml`` arguments format is therefore compiled
from its EBNF with the padding rules taken out; whitespace between parameters stays.
"""

from __future__ import annotations

import json
import re

_WS = "[ \\n\\r\\t]*"
_AFTER_OPEN, _BEFORE_CLOSE = f'">" {_WS} ', f' {_WS} "</parameter>"'


def tag_for_compile(tag_json: str, any_whitespace: bool) -> str:
    """``tag_json`` with each ``qwen_xml`` arguments format as an EBNF grammar without value
    padding, and, unless ``any_whitespace``, at most one whitespace character at a time in
    arguments (JSON's and between XML parameters: the structural tag's compact JSON; one, so a
    template's newline between parameters stays writable). Raises ``ValueError`` when xgrammar's
    EBNF is not the shape this rewrite knows (a changed xgrammar must fail, not loosen)."""

    def walk(node):
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema":
            if node.get("style") == "qwen_xml":
                return {"type": "grammar", "grammar": xml_arguments_ebnf(node, any_whitespace)}
            if not any_whitespace and node.get("max_whitespace_cnt") is None:
                return {**node, "max_whitespace_cnt": 1}
            return node
        return {k: walk(v) for k, v in node.items()}

    return json.dumps(walk(json.loads(tag_json)))


def xml_arguments_ebnf(fmt: dict, any_whitespace: bool) -> str:
    """One ``qwen_xml`` ``json_schema`` format as EBNF, no whitespace around a value."""
    import xgrammar as xgr

    fmt = {**fmt, "max_whitespace_cnt": None}  # the EBNF's whitespace rules in the one form rewritten here
    ebnf = str(xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": fmt})))
    # every "</parameter>": a padded value's end, a plain string's (never padded), or in its excludes
    padded = ebnf.count(_BEFORE_CLOSE)
    known = padded + ebnf.count('xml_string "</parameter>"') + sum(
        m.count('"</parameter>"') for m in re.findall(r'excludes=\([^)]*\)', ebnf))
    if ebnf.count(_AFTER_OPEN) != padded or ebnf.count('"</parameter>"') != known:
        raise ValueError("xgrammar's XML arguments grammar is not the shape expected; value padding not removed")
    out = ebnf.replace(_AFTER_OPEN, '">" ').replace(_BEFORE_CLOSE, ' "</parameter>"')
    return out if any_whitespace else out.replace(_WS, "[ \\n\\r\\t]?")
