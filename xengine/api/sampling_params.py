"""What a request asks of the engine: sampling and pooling parameters, validated the same way
whatever the entry point (offline API, HTTP, batch). Torch-free: the service imports it.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from xengine.api.constraints import check_constraints, check_structured_outputs

# Bounds enforced on every request, whatever the entry point (offline API, HTTP, batch).
MAX_N = 128
MAX_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on ``logprob_token_ids``
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 256
MAX_BEAM_WIDTH = 1024  # hard bound; the engine's scheduler.max_beam_width is the configured one
MAX_CATALOG_NAME_LEN = 64


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Constrain a request's output to a language: exactly one of ``json``, ``json_object``, ``regex``,
    ``choice``, ``grammar``, ``structural_tag`` is set (see ``xengine/structured/`` and
    ``docs/structured_outputs.md``; structural tags are refused for now).

    JSON whitespace: flexible by default (runs of at most ``xengine.api.grammar.MAX_JSON_WHITESPACE``
    characters between tokens), none with ``disable_any_whitespace``, or ``whitespace_pattern`` (a regex).
    """

    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None  # Rust ``regex`` syntax (no look-around, no back-references)
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # a Lark or GBNF (llama.cpp / vLLM EBNF) grammar
    structural_tag: str | None = None  # a structural tag spec, as JSON text
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    # objects without "additionalProperties" get false (None: the engine's
    # structured_outputs.disable_additional_properties, true by default as vLLM's default backend)
    disable_additional_properties: bool | None = None
    # Output tokens this grammar already produced, which are the tail of the prompt: a request resumed
    # on another instance (PD hand-off, migration). Its matchers consume them before the first step.
    resume_token_ids: list[int] | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming 'structured_outputs' (cheap checks; compiling is the backend's)."""
        check_structured_outputs(self)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request. ``temperature == 0`` means greedy.

    ``logprobs``: None = no logprobs; k >= 0 returns the chosen token's logprob plus the
    top-k alternatives at each step. ``prompt_logprobs``: the same for each prompt token from the
    second on (the logprob of prompt token i given tokens < i), with its rank in the vocabulary.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    speculative: bool = True  # False: this request never drafts (speculative decoding, ``xengine/spec/``)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # see ``IncrementalDetokenizer``
    include_stop_str_in_output: bool = False
    # Beam search (deterministic; sampling fields are ignored). ``n`` is the number of returned
    # sequences, best first. Scores follow HF ``generate(num_beams=...)``: sum of logprobs /
    # (generated length ** length_penalty).
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    beam_top_k: int = 0  # candidates per beam per step; 0: enough for an exact top-k (HF)
    catalog: str | None = None  # constrain the output to one item of this registered catalog
    lora_name: str | None = None  # the LoRA adapter serving it (``xengine/lora/``); None: the base model
    cache_salt: str | None = None  # vLLM's: only requests of the same salt share prefix-cache blocks
    # Token-level constraints (``xengine/sampling/constraints.py``, ``xengine/structured/``): the output
    # follows a grammar; ``logit_bias`` (id -> [-100, 100]) is added to the logits; only
    # ``allowed_token_ids`` may be sampled; a ``bad_words_token_ids`` sequence's last token is banned
    # wherever the output ends with the rest of it (the service tokenizes ``bad_words``).
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's ``logprob_token_ids``: with ``logprobs`` set, each step reports the logprobs of exactly these
    # ids (in this order) as the alternatives instead of the top-k: a fixed label set (classification,
    # scoring) is read whatever its tokens' ranks.
    logprob_token_ids: list[int] | None = None

    def validate(self, vocab_size: int | None = None, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Raise ``ValueError`` naming the field and its allowed range (``max_logprobs``: the most
        alternatives per token, -1: the vocabulary's size)."""
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]")
        _check(
            _finite(self.temperature) and 0.0 <= self.temperature <= 100.0,
            "temperature",
            "must be in [0, 100]",
        )
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0),
            "top_k",
            "must be -1, 0 (disabled) or a positive integer",
        )
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed",
            "must be an integer in [0, 2^63)",
        )
        _check(
            _finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            "must be in (0, 10]",
        )
        _check(
            _finite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            "must be in [-2, 2]",
        )
        _check(
            _finite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            "must be in [-2, 2]",
        )
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 0),
            "max_tokens",
            "must be a non-negative integer (0: compute the prompt only, generate nothing)",
        )
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens, "min_tokens", f"must be <= max_tokens ({self.max_tokens})"
            )
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for s in self.stop:
            _check(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN,
                "stop",
                f"each stop string must have 1..{MAX_STOP_STRING_LEN} characters",
            )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} ids",
        )
        for t in self.stop_token_ids:
            ok = isinstance(t, int) and t >= 0 and (vocab_size is None or t < vocab_size)
            _check(ok, "stop_token_ids", f"each id must be in [0, {vocab_size})")
        cap = vocab_size if max_logprobs == -1 and vocab_size is not None else max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, int) and 0 <= v <= cap), name, f"must be in [0, {cap}]")
        self._validate_logprob_token_ids(vocab_size)
        check_constraints(self, vocab_size)  # structured outputs, logit_bias, allow-list, bad words
        if self.use_beam_search or self.catalog is not None:
            self._validate_beam()

    def _validate_logprob_token_ids(self, vocab_size: int | None) -> None:
        ids = self.logprob_token_ids
        if ids is None:
            return
        _check(
            isinstance(ids, list) and 1 <= len(ids) <= MAX_LOGPROB_TOKEN_IDS,
            "logprob_token_ids",
            f"must be a list of 1..{MAX_LOGPROB_TOKEN_IDS} token ids",
        )
        for t in ids:
            ok = isinstance(t, int) and t >= 0 and (vocab_size is None or t < vocab_size)
            _check(ok, "logprob_token_ids", f"each id must be in [0, {vocab_size})")
        _check(self.logprobs is not None, "logprob_token_ids", "requires 'logprobs'")
        _check(self.max_tokens != 0, "logprob_token_ids", "needs generated tokens (max_tokens > 0)")

    def _validate_beam(self) -> None:
        _check(self.use_beam_search, "use_beam_search", "must be true when 'catalog' is set")
        _check(
            isinstance(self.beam_width, int) and 1 <= self.beam_width <= MAX_BEAM_WIDTH,
            "beam_width",
            f"must be an integer in [1, {MAX_BEAM_WIDTH}]",
        )
        _check(self.n <= self.beam_width, "n", f"must be <= beam_width ({self.beam_width}) with beam search")
        _check(
            _finite(self.length_penalty) and -10.0 <= self.length_penalty <= 10.0,
            "length_penalty",
            "must be in [-10, 10]",
        )
        _check(
            self.early_stopping in (True, False, "never"), "early_stopping", "must be true, false or 'never'"
        )
        _check(
            isinstance(self.beam_top_k, int) and 0 <= self.beam_top_k <= 2 * MAX_BEAM_WIDTH,
            "beam_top_k",
            f"must be in [0, {2 * MAX_BEAM_WIDTH}]",
        )
        no_penalty = (self.repetition_penalty, self.presence_penalty, self.frequency_penalty) == (
            1.0,
            0.0,
            0.0,
        )
        _check(no_penalty, "repetition_penalty", "penalties are not supported with beam search")
        _check(self.logprobs is None, "logprobs", "not supported with beam search (each output has a score)")
        _check(self.prompt_logprobs is None, "prompt_logprobs", "not supported with beam search")
        _check(self.logprob_token_ids is None, "logprob_token_ids", "not supported with beam search")
        _check(self.max_tokens != 0, "max_tokens", "must be positive with beam search")
        if self.catalog is not None:
            _check(
                isinstance(self.catalog, str) and 0 < len(self.catalog) <= MAX_CATALOG_NAME_LEN,
                "catalog",
                f"must be a name of 1..{MAX_CATALOG_NAME_LEN} characters",
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_prefill_only(self) -> bool:
        """``max_tokens == 0``: the prompt is computed (prompt logprobs, embeddings, KV for the
        prefix cache) and the request finishes without sampling."""
        return self.max_tokens == 0


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, field: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"invalid value for '{field}': {rule}")


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Embed the prompt instead of generating (``/v1/embeddings``): the final hidden state (after the
    model's last norm) of the prompt's last token, optionally cut to its first ``dimensions``
    (Matryoshka), then L2-normalised when ``normalize``. The request must be prefill-only."""

    dimensions: int | None = None
    normalize: bool = True

    def validate(self, hidden_size: int) -> None:
        d = self.dimensions
        _check(
            d is None or (isinstance(d, int) and 1 <= d <= hidden_size),
            "dimensions",
            f"must be an integer in [1, {hidden_size}] (the model's hidden size)",
        )
