"""xengine.api.text.Tokenizer matches transformers.AutoTokenizer on the generated checkpoints."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from xengine.api.text.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Café naïve 你好，世界 こんにちは 😀🚀 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]

MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a joke"}],
        },
    ],
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def both(tiny_qwen3):
    return Tokenizer.from_dir(tiny_qwen3), AutoTokenizer.from_pretrained(tiny_qwen3)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(both, text: str) -> None:
    ours, hf = both
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == hf.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_random_ids_decode_and_tokens_match_hf(both) -> None:
    ours, hf = both
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 20))]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_special_ids_and_sizes(both) -> None:
    ours, hf = both
    assert ours.vocab_size == len(hf) == len(ours)
    assert ours.eos_token_id == hf.eos_token_id == ours.token_to_id("<|im_end|>")
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.bos_token_id is None
    assert ours.all_special_ids == sorted(hf.all_special_ids)
    assert len(ours.all_special_ids) == 3


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_hf(both, messages, gen: bool) -> None:
    ours, hf = both
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_chat_template_with_tools_matches_hf(both) -> None:
    ours, hf = both
    messages = [
        {"role": "system", "content": "Be useful."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "sunny"},
    ]
    expected = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    got = ours.apply_chat_template(messages, tools=TOOLS)
    assert got == expected
    assert '"name": "get_weather"' in got and got.endswith("<|im_start|>assistant\n")


def test_chatml_shape(both) -> None:
    ours, _ = both
    text = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_missing_files_raise_value_error(tmp_path, tiny_qwen3) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text((tiny_qwen3 / "tokenizer.json").read_text())
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("hi") and tok.eos_token_id is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_errors_are_value_errors(tmp_path, tiny_qwen3) -> None:
    (tmp_path / "tokenizer.json").write_text((tiny_qwen3 / "tokenizer.json").read_text())
    template = "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}{{ messages[0].content }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    with pytest.raises(ValueError, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "x"}] * 2)
    (tmp_path / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="chat template error"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([])


def test_text_layer_does_not_import_torch() -> None:
    code = (
        "import sys; import xengine.api.text.output_processor, xengine.api.text.tokenizer; "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
