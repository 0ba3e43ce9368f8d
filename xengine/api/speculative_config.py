"""The ``speculative_config`` section: vLLM's ``--speculative-config`` dict (``xengine/spec/`` runs it).

Torch-free, like ``config.py``, whose ``EngineConfig`` holds it."""

from __future__ import annotations

from dataclasses import dataclass

from xengine.api.config_fields import _f

SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp", "eagle", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` dict (the same keys in YAML's ``speculative_config`` section and
    ``LLM(speculative_config={...})``); ``xengine/spec/`` runs it."""

    method: str = _f(
        "",
        "Speculative decoding: empty (off); ngram (prompt lookup: drafts are the tokens that followed the "
        "latest earlier occurrence of the sequence's last n tokens; no model pass); draft_model (a small "
        "model with the target's vocabulary, speculative_config.model, drafts greedily); mtp (the "
        "checkpoint's own multi-token-prediction layer drafts from the target's hidden states: DeepSeek-V3 "
        "num_nextn_predict_layers, Qwen3-Next mtp.*); eagle / eagle3 (an EAGLE-1 / EAGLE-3 head from the HF "
        "folder speculative_config.model drafts from the target's hidden states).",
    )
    num_speculative_tokens: int = _f(
        0, "Draft tokens proposed per decoding sequence and step (k); the target verifies k + 1 positions."
    )
    prompt_lookup_min: int = _f(
        2, "ngram: the shortest suffix looked up (tokens); one-token matches draft mostly wrong tokens."
    )
    prompt_lookup_max: int = _f(
        4, "ngram: the longest suffix looked up (tokens); longer matches are tried first."
    )
    model: str = _f(
        "", "draft_model: the draft model's HF folder; eagle / eagle3: the head's (the target's vocabulary)."
    )
    disable_by_batch_size: int = _f(
        0,
        "Speculation turns itself off for a step while more than this many sequences run (0: never); "
        "benchmarks/offline/spec_decode.py measures where it stops paying.",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.method)

    def validate(self) -> None:
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "disable_by_batch_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"speculative_config.{name} must be an integer, got {value!r}")
        if not isinstance(self.method, str) or not isinstance(self.model, str):
            raise ValueError("speculative_config.method and speculative_config.model must be strings")
        if not self.method:
            return
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative_config.num_speculative_tokens must be >= 1 when a method is set")
        if self.method in ("draft_model", "eagle", "eagle3") and not self.model:
            raise ValueError(
                f"speculative_config.method {self.method} needs speculative_config.model (an HF folder)"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size < 0:
            raise ValueError("speculative_config.disable_by_batch_size must be >= 0")
