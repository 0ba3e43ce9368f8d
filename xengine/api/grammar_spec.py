"""``GrammarSpec``: a structured-output constraint normalised, the key grammars are checked and cached by.

Its own module (no imports) so the bounds, the sandbox and the validator can all name it without an
import circle; ``xengine.api.grammar`` builds specs from request params.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    source: str  # JSON schema text | regex | JSON list of choices | Lark / GBNF grammar
    whitespace: str | None = None  # JSON only: a whitespace regex, or None for none at all
