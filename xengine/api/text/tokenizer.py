"""Torch-free tokenizer: ``tokenizers`` for text <-> ids, sandboxed jinja2 for chat templates.

Reads a Hugging Face model folder (``tokenizer.json``, ``tokenizer_config.json``, optionally
``chat_template.jinja``) and matches ``transformers.AutoTokenizer`` on encode, decode and
``apply_chat_template``.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from xengine.api.text.length_bound import max_token_chars

# Decodes of at least this many ids go through ``decode_batch``, which releases the GIL (``decode``
# holds it); below it ``decode`` is a little cheaper (the per-token incremental detokenizer).
_GIL_FREE_DECODE_MIN_IDS = 1024
# Compiled chat templates kept per tokenizer: the model's plus a few sent with requests.
_MAX_CACHED_TEMPLATES = 16


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


def _final_text(messages: list[dict[str, Any]]) -> str:
    """The text of the last message (its last text part when its content is a list of parts)."""
    if not messages:
        raise ValueError("continue_final_message needs at least one message")
    content = messages[-1].get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a final message with text to continue")
    return content


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """``text`` up to the end of the last message's content (what follows it closes the turn).

    Templates may strip surrounding whitespace, so the stripped content is searched; trailing
    whitespace of the content is kept when the template kept it.
    """
    final = _final_text(messages)
    core = final.strip()
    at = text.rfind(core)
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not render the final message's text")
    with_tail = final.lstrip()
    keep = len(with_tail) if text[at : at + len(with_tail)] == with_tail else len(core)
    return text[: at + keep]


class Tokenizer:
    """Encode, decode and render chat prompts for one model folder."""

    def __init__(
        self,
        backend: HFTokenizer,
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
        add_bos_token: bool = False,
        config: dict[str, Any] | None = None,
    ) -> None:
        """``config``: the model folder's ``tokenizer_config.json`` (``/tokenizer_info`` shows it)."""
        self._tok = backend
        self.config: dict[str, Any] = dict(config or {})
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
        self.added_tokens: dict[int, str] = {i: t.content for i, t in added.items()}  # id -> its text
        self._templates: dict[str, jinja2.Template] = {}  # source -> compiled, insertion-ordered
        self._templates_lock = threading.Lock()  # rendered on several tokenizer worker threads
        self._template_vars: dict[str, frozenset[str]] = {}  # source -> variables it reads

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
            config=config,
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

    def _compiled(self, chat_template: str | None) -> jinja2.Template:
        """The compiled ``chat_template`` (the model's when None); a few request templates stay cached."""
        source = self.chat_template if chat_template is None else chat_template
        if not source:
            raise ValueError(
                "this tokenizer has no chat template (tokenizer_config.json 'chat_template'); use a completion request"
            )
        with self._templates_lock:
            template = self._templates.get(source)
        if template is None:
            try:
                template = self._template_env.from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"chat template syntax error: {exc}") from exc
            with self._templates_lock:
                if len(self._templates) >= _MAX_CACHED_TEMPLATES:
                    self._templates.pop(next(iter(self._templates)))
                self._templates[source] = template
        return template

    def template_variables(self, chat_template: str | None = None) -> frozenset[str]:
        """Names a chat template reads from its context (``messages``, ``tools``, ``enable_thinking``, ...).

        Lets a caller refuse inputs the template would not render (e.g. ``tools`` for a template
        without tool support) instead of dropping them silently. ``ValueError`` on a syntax error.
        """
        source = self.chat_template if chat_template is None else chat_template
        if not source:
            return frozenset()
        with self._templates_lock:
            names = self._template_vars.get(source)
        if names is None:
            try:
                names = frozenset(meta.find_undeclared_variables(self._template_env.parse(source)))
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"chat template syntax error: {exc}") from exc
            with self._templates_lock:
                if len(self._template_vars) >= _MAX_CACHED_TEMPLATES:
                    self._template_vars.pop(next(iter(self._template_vars)))
                self._template_vars[source] = names
        return names

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (OpenAI-style dicts) to the prompt text; ``ValueError`` on template errors.

        ``chat_template`` replaces the model's template; ``continue_final_message`` ends the text
        inside the last message (no end-of-turn after it), so generation continues that message,
        as ``transformers``' option of that name. Other ``kwargs`` are template variables.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(kwargs)
        template = self._compiled(chat_template)
        try:
            text = template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **context
            )
        except Exception as exc:  # any failure inside the template is a bad request, not a crash
            raise ValueError(f"chat template error: {exc}") from exc
        return _cut_after_final_message(text, messages) if continue_final_message else text
