"""Grammars for ``grammar=``: Lark (llguidance's dialect) or llama.cpp's GBNF.

The runtime's constraint code compiles Lark only (llguidance, docs/server.md); a GBNF grammar
is converted to that Lark first, by llguidance's own converter (``llguidance.gbnf_to_lark``, the
Python package of the same llguidance), so there is one path from either text to a constraint.
The bindings call `to_lark` for every ``grammar=``; the CLI and the server go through them.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["GRAMMAR_FORMATS", "is_gbnf", "to_lark"]

#: The values of ``grammar_format=``; None (or left out) detects the format.
GRAMMAR_FORMATS = ("lark", "gbnf")

# A GBNF rule is `name ::= ...` (names may hold dashes); Lark writes `name: ...` and never `::=`
# at the start of a line, so one GBNF rule head anywhere marks the text as GBNF.
_GBNF_RULE = re.compile(r"(?m)^[ \t]*[A-Za-z_][A-Za-z0-9_-]*[ \t]*::=")


def is_gbnf(text: str) -> bool:
    """Whether `text` is a GBNF grammar (it has a ``name ::= ...`` rule) rather than Lark."""
    return _GBNF_RULE.search(text) is not None


def to_lark(text: str, grammar_format: Optional[str] = None) -> str:
    """The Lark grammar llguidance compiles for `text`: itself when it is Lark, converted when
    it is GBNF (``grammar_format="gbnf"``, or detected when `grammar_format` is None).

    Raises ValueError for an unknown format or a GBNF grammar that does not parse (naming the
    line and column), and ImportError naming the package when llguidance is not installed."""
    if grammar_format is None:
        grammar_format = "gbnf" if is_gbnf(text) else "lark"
    if grammar_format not in GRAMMAR_FORMATS:
        raise ValueError(f"grammar_format must be one of {', '.join(map(repr, GRAMMAR_FORMATS))} "
                         f"(or None: detected), not {grammar_format!r}")
    if grammar_format == "lark":
        return text
    try:
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark
    except ImportError as e:
        raise ImportError("a GBNF grammar is converted by the llguidance package: pip install llguidance") from e
    try:
        return gbnf_to_lark(text)
    except GbnfToLarkError as e:
        raise ValueError(f"GBNF grammar: {e}") from None
