"""Train and save the byte-level BPE tokenizer of the generated checkpoints."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from xengine.tools.corpus import iter_corpus

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
# vision-language checkpoints (qwen2_vl, qwen2_5_vl): added after training, at the end of the vocabulary
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# ChatML, with an optional tool list in the system turn (Qwen-style).
CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}\n"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures:\\n<tools>' }}\n"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}\n"
    "{{- '\\n</tools><|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}\n"
    "{%- if message['content'] is string %}{{- message['content'] }}\n"
    "{%- elif message['content'] %}\n"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}\n"
    "{%- endif %}\n"
    "{%- for call in message.get('tool_calls') or [] %}\n"
    "{%- set fn = call['function'] if call['function'] is defined else call %}\n"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}\n"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}\n"
    "{{- '}\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
# The same, with image parts (``{"type": "image"}`` as HF processors take them, or OpenAI's ``image_url``)
# rendered as Qwen2-VL's one-token placeholder, which the prompt builder expands per image.
VL_CHATML_TEMPLATE = CHATML_TEMPLATE.replace(
    "{%- endif %}{%- endfor %}\n",
    "{%- elif part['type'] in ('image', 'image_url') %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- endif %}{%- endfor %}\n",
    1,
)


@dataclass(frozen=True)
class TokenizerInfo:
    """Ids of the special tokens and the full vocabulary size (including added tokens)."""

    vocab_size: int
    endoftext_id: int
    im_start_id: int
    im_end_id: int


def train_bpe(vocab_size: int, corpus_chars: int, seed: int = 0) -> Tokenizer:
    """Train a byte-level BPE with ``vocab_size`` entries (special tokens included)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(iter_corpus(corpus_chars, seed), trainer=trainer)
    return tok


def save_tokenizer(
    tok: Tokenizer, out: Path, extra_special: list[str] | None = None, chat_template: str = CHATML_TEMPLATE
) -> TokenizerInfo:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with ``chat_template``, ChatML by default).
    ``extra_special``: special tokens appended to the vocabulary (e.g. ``VISION_TOKENS``)."""
    out.mkdir(parents=True, exist_ok=True)
    extra = list(extra_special or [])
    if extra:
        tok.add_special_tokens(extra)
    tok.save(str(out / "tokenizer.json"))
    info = TokenizerInfo(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        endoftext_id=tok.token_to_id(ENDOFTEXT),
        im_start_id=tok.token_to_id(IM_START),
        im_end_id=tok.token_to_id(IM_END),
    )
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS + extra
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END, *extra],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return info
