"""Torch-free tokenizer: ``tokenizers`` for text <-> ids, sandboxed jinja2 for chat templates.

Reads a Hugging Face model folder (``tokenizer.json``, ``tokenizer_config.json``, optionally
``chat_template.jinja``) and matches ``transformers.AutoTokenizer`` on encode, decode and
``apply_chat_template``.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from xengine.api.text.length_bound import max_token_chars

# Decodes of at least this many ids go through ``decode_batch``, which releases the GIL (``decode``
# holds it); below it ``decode`` is a little cheaper (the per-token incremental detokenizer).
_GIL_FREE_DECODE_MIN_IDS = 1024


def _token_content(value: Any) -> str | None:
    """A special token entry of tokenizer_config.json: a string, an AddedToken dict or null."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF assistant-mask marker): renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class Tokenizer:
    """Encode, decode and render chat prompts for one model folder."""

    def __init__(
        self,
        backend: HFTokenizer,
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self._tok = backend
        # tokenizers >= 0.21; ``encode_batch`` also releases the GIL but is slower
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        self.chat_template = chat_template
        self.special_tokens: dict[str, str | None] = dict(special_tokens or {})
        self.add_bos_token = add_bos_token
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        self.pad_token_id = self._id_of(self.special_tokens.get("pad_token"))
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: list[int] = sorted(i for i, t in added.items() if t.special)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load from a model folder; ``ValueError`` when it has no ``tokenizer.json``."""
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(
                f"no tokenizer.json in {model_dir}: the model folder needs a fast tokenizer file"
            )
        cfg_file = model_dir / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        names = ("bos_token", "eos_token", "pad_token", "unk_token")
        special = {name: _token_content(config.get(name)) for name in names}
        return cls(
            HFTokenizer.from_file(str(tok_file)),
            chat_template=_read_chat_template(model_dir, config),
            special_tokens=special,
            add_bos_token=bool(config.get("add_bos_token", False)),
        )

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (``len(AutoTokenizer)``)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the post-processor (and BOS) apply.

        Releases the GIL while it tokenizes (``encode_batch_fast``; ``encode`` holds it and also
        computes offsets), so a large text encoded on a worker thread does not stall other threads.
        """
        ids = self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid or incomplete UTF-8 byte sequences become U+FFFD."""
        if len(ids) >= _GIL_FREE_DECODE_MIN_IDS:
            return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of input text one token can cover; None when the tokenizer gives no such bound.

        A text longer than ``n * max_token_chars`` characters has more than ``n`` tokens.
        """
        return max_token_chars(self._tok)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """Vocabulary strings of ``ids`` (byte-level symbols for BPE), None for unknown ids."""
        return [self._tok.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @cached_property
    def _template_env(self) -> ImmutableSandboxedEnvironment:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlock]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat template (tokenizer_config.json 'chat_template'); use a completion request"
            )
        return self._template_env.from_string(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (OpenAI-style dicts) to the prompt text; ``ValueError`` on template errors."""
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(kwargs)
        template = self._compiled_template
        try:
            return template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **context
            )
        except Exception as exc:  # any failure inside the template is a bad request, not a crash
            raise ValueError(f"chat template error: {exc}") from exc
