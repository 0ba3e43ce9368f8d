"""Incremental detokenization: new token ids in, newly completed text out."""

from __future__ import annotations

from xengine.api.text.tokenizer import Tokenizer

# Prompt tokens kept as left context, so decoders that treat the first token specially (e.g.
# SentencePiece's leading space) see output tokens the way a full decode would.
_NUM_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation (plus ``flush()``) is the
    full decode of the output ids.

    Text ending in U+FFFD (a byte-level token split a multi-byte character) is held back until a
    later token completes it. Each call decodes only a small window, the tokens since the last
    emitted character boundary.

    ``spaces_between_special_tokens=False`` (with special tokens kept): an added token that follows
    another added token is emitted as its bare text, without the space some decoders (WordPiece,
    Metaspace) put between tokens, as vLLM does for fast tokenizers. Byte-level BPE decoders put
    no such space, so for them the option changes nothing.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # id -> text of added tokens when their spacing is to be dropped, else None (the fast path)
        keep_spacing = skip_special_tokens or spaces_between_special_tokens
        self._bare_added = None if keep_spacing else (tokenizer.added_tokens or None)
        self._last_added = False
        context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:]) if prompt_token_ids else []
        if _REPLACEMENT in self._decode(context):
            context = []  # a context with broken characters would merge bytes with the output's
        self._ids: list[int] = context
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(context)  # tokens before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _window_delta(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def add(self, new_token_ids: list[int]) -> str:
        """Append ``new_token_ids``; return the text they completed (possibly empty)."""
        if self._bare_added is not None:
            return "".join(self._add_one(t) for t in new_token_ids)
        return self._add(new_token_ids)

    def _add_one(self, token_id: int) -> str:
        bare = self._bare_added.get(token_id)  # type: ignore[union-attr]
        follows_added, self._last_added = self._last_added, bare is not None
        if bare is None or not follows_added:
            return self._add([token_id])
        # The previous added token completed its text, so nothing is held back here.
        self._ids.append(token_id)
        self._advance()
        return bare

    def _add(self, new_token_ids: list[int]) -> str:
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        delta = self._window_delta()
        if not delta or delta.endswith(_REPLACEMENT):
            return ""
        self._advance()
        return delta

    def flush(self) -> str:
        """At the end of the sequence: return the held-back text, incomplete characters as U+FFFD."""
        delta = self._window_delta()
        self._advance()
        return delta

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
