"""Token logprobs in the two OpenAI shapes: completions (parallel lists) and chat (per-token objects)."""

from __future__ import annotations

import math
from typing import Any

from xservice.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

TopLogprobs = list[list[tuple[int, float]]]


class TokenText:
    """How single token ids are shown in logprobs: their text (special tokens included), cached per
    id, or with ``as_token_ids`` (vLLM's ``return_tokens_as_token_ids``) ``"token_id:<id>"``, which
    identifies tokens whose text is not valid UTF-8 on its own (a part of a character)."""

    def __init__(self, tokenizer: Any, as_token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_token_ids else self.text(token_id)

    def text(self, token_id: int) -> str:
        """The token's decoded text (what it adds to the output), whatever ``as_token_ids`` says."""
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _finite(x: float) -> float:
    # JSON has no -inf; a token the model gives no probability gets the most negative float.
    return x if math.isfinite(x) else -9999.0


class CompletionLogprobsBuilder:
    """Builds ``CompletionLogprobs`` for successive deltas of one choice, tracking text offsets."""

    def __init__(self, token_text: TokenText, initial_offset: int = 0) -> None:
        self.token_text = token_text
        self.offset = initial_offset

    def build(
        self, token_ids: list[int], logprobs: list[float] | None, tops: TopLogprobs | None
    ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        logprobs = logprobs or []
        tops = tops or []
        for i, token_id in enumerate(token_ids):
            text = self.token_text(token_id)
            lp = _finite(logprobs[i]) if i < len(logprobs) else None
            # Distinct ids can share a text (e.g. partial UTF-8 bytes): the first, most likely one wins.
            alts: dict[str, float] = {} if lp is None else {text: lp}
            for t, v in tops[i] if i < len(tops) else []:
                alts.setdefault(self.token_text(t), _finite(v))
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.top_logprobs.append(alts)
            out.text_offset.append(self.offset)
            self.offset += len(self.token_text.text(token_id))  # offsets index the output text
        return out


def chat_logprobs(
    token_text: TokenText,
    token_ids: list[int],
    logprobs: list[float] | None,
    tops: TopLogprobs | None,
    num_top: int | None,
) -> ChatLogprobs:
    """``ChatLogprobs`` of ``token_ids``; ``num_top`` alternatives per token. ``num_top`` None
    (``logprob_token_ids``): the chosen token, then every id the engine reported, each id once."""
    content: list[ChatTokenLogprob] = []
    logprobs = logprobs or []
    tops = tops or []
    for i, token_id in enumerate(token_ids):
        text = token_text(token_id)
        alts = tops[i] if i < len(tops) else []
        if num_top is None:
            chosen = [(token_id, logprobs[i])] if i < len(logprobs) else []
            alts = list(dict(chosen + [(t, v) for t, v in alts if t != token_id]).items())
        else:
            alts = alts[:num_top]
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=_finite(logprobs[i]) if i < len(logprobs) else -9999.0,
                bytes=list(text.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(
                        token=token_text(t), logprob=_finite(v), bytes=list(token_text(t).encode("utf-8"))
                    )
                    for t, v in alts
                ],
            )
        )
    return ChatLogprobs(content=content)
