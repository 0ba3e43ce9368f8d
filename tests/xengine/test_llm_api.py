"""Offline ``LLM`` API end to end: stop conditions, logprobs, penalties, truncation, chat, dtypes.

Wherever HF ``transformers`` implements the same rule (eos, ``min_new_tokens``, repetition
penalty, logits) it is the oracle; otherwise a greedy loop over HF logits is.
"""

from __future__ import annotations

import pytest
import torch

from tests.xengine.conftest import random_prompts
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

ARCH = "qwen3"
NUM = 20


@pytest.fixture(scope="module")
def llm(make_model_dir):
    return LLM(str(make_model_dir(ARCH)), max_num_seqs=256, max_num_batched_tokens=1024)


@pytest.fixture(scope="module")
def oracle(hf_oracle):
    return hf_oracle(ARCH)


@pytest.fixture(scope="module")
def prompt():
    return random_prompts([24], seed=31)[0]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", NUM), **kw)


def one(llm: LLM, prompt, params: SamplingParams):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


@pytest.fixture(scope="module")
def eos_prompt(llm):
    """(prompt, k): a prompt whose greedy continuation is eos at output position k >= 2."""
    candidates = random_prompts([1 + i % 10 for i in range(400)], seed=32)
    outputs = llm.generate(candidates, greedy(), use_tqdm=False)
    for p, o in zip(candidates, outputs):
        tokens = o.outputs[0].token_ids
        if o.outputs[0].finish_reason == "stop" and 2 <= len(tokens) - 1 <= NUM - 8:
            return p, len(tokens) - 1
    raise AssertionError("no prompt reaches eos")


# ---------------------------------------------------------------------------- stop conditions


def test_max_tokens_finishes_with_length(llm, oracle, prompt):
    out = one(llm, prompt, greedy(ignore_eos=True, max_tokens=7))
    assert out.token_ids == oracle.greedy(prompt, 7)
    assert (out.finish_reason, out.stop_reason) == ("length", None)
    assert out.text == llm.tokenizer.decode(out.token_ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_never_leaks(llm, prompt, include):
    full = one(llm, prompt, greedy(ignore_eos=True)).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip() and len(full) > 10
    out = one(llm, prompt, greedy(ignore_eos=True, stop=[stop], include_stop_str_in_output=include))
    end = full.index(stop) + (len(stop) if include else 0)
    assert out.text == full[:end]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < NUM
    assert llm.engine.get_stats().num_running == 0  # the engine request was aborted


def test_stop_token_ids(llm, oracle, prompt):
    expected = oracle.greedy(prompt, NUM)
    j = next(i for i in range(4, NUM) if expected[i] not in expected[:i])
    out = one(llm, prompt, greedy(stop_token_ids=[expected[j]]))
    assert out.token_ids == expected[: j + 1]  # the stop token is in the ids, not in the text
    assert (out.finish_reason, out.stop_reason) == ("stop", expected[j])
    assert out.text == llm.tokenizer.decode(expected[:j])


def test_eos_and_ignore_eos(llm, oracle, eos_prompt):
    prompt, k = eos_prompt
    stopped = one(llm, prompt, greedy())
    assert stopped.token_ids == oracle.greedy(prompt, NUM, ignore_eos=False)
    assert stopped.token_ids[k] in oracle.eos_token_ids and len(stopped.token_ids) == k + 1
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
    ignored = one(llm, prompt, greedy(ignore_eos=True))
    assert ignored.token_ids == oracle.greedy(prompt, NUM, ignore_eos=True)
    assert ignored.token_ids[: k + 1] == stopped.token_ids and ignored.finish_reason == "length"


def test_min_tokens_delays_eos(llm, oracle, eos_prompt):
    prompt, k = eos_prompt
    out = one(llm, prompt, greedy(min_tokens=k + 3))
    assert not set(out.token_ids[: k + 3]) & set(oracle.eos_token_ids)
    assert len(out.token_ids) >= k + 3
    assert out.token_ids == oracle.greedy(prompt, NUM, ignore_eos=False, min_new_tokens=k + 3)


def test_min_tokens_delays_a_stop_token(llm, oracle, prompt):
    first = oracle.greedy(prompt, 1)[0]
    assert one(llm, prompt, greedy(stop_token_ids=[first])).token_ids == [first]
    out = one(llm, prompt, greedy(stop_token_ids=[first], min_tokens=5))
    assert first not in out.token_ids[:5] and len(out.token_ids) >= 5
    # HF: the stop token acts as one more eos id, banned below min_new_tokens like the others
    eos = [first, *oracle.eos_token_ids]
    assert out.token_ids == oracle.greedy(prompt, NUM, ignore_eos=False, eos_token_id=eos, min_new_tokens=5)


# ---------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("k", [0, 5])
def test_greedy_logprobs_match_hf(llm, oracle, prompt, k):
    out = one(llm, prompt, greedy(ignore_eos=True, logprobs=k))
    assert out.token_ids == oracle.greedy(prompt, NUM)
    logprobs = oracle.logits(prompt + out.token_ids).log_softmax(dim=-1)
    assert len(out.logprobs) == NUM
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = logprobs[len(prompt) - 1 + i]
        assert abs(entry[token] - row[token].item()) <= 1e-4
        if k == 0:
            assert list(entry) == [token]
            continue
        values = list(entry.values())
        assert len(entry) == k and values == sorted(values, reverse=True)
        assert list(entry) == row.topk(k).indices.tolist()
        assert torch.allclose(torch.tensor(values), row.topk(k).values, atol=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))


def test_logprob_token_ids_replace_the_top_k(llm, oracle, prompt):
    """Rows asking for ids (of different lengths) and a top-k row share one batch; each gets its own."""
    ids = [[7, 3, 11], [42]]
    params = [greedy(ignore_eos=True, logprobs=5, logprob_token_ids=i) for i in ids]
    outs = llm.generate([prompt] * 3, [*params, greedy(ignore_eos=True, logprobs=2)], use_tqdm=False)
    logprobs = oracle.logits(prompt + outs[0].outputs[0].token_ids).log_softmax(dim=-1)
    for asked, out in zip(ids, outs):
        for i, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            row = logprobs[len(prompt) - 1 + i]
            assert set(entry) == {token, *asked}
            assert all(abs(lp - row[t].item()) <= 1e-4 for t, lp in entry.items())
    top = outs[2].outputs[0].logprobs[0]
    assert list(top) == logprobs[len(prompt) - 1].topk(2).indices.tolist()


def test_sampled_logprobs_have_the_top_k(llm, prompt):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=NUM, ignore_eos=True, logprobs=3)
    out = one(llm, prompt, params)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) in (3, 4)  # the chosen token may lie outside the top 3
        top = [lp for t, lp in entry.items() if t != token or len(entry) == 3]
        assert top == sorted(top, reverse=True)
        assert entry[token] <= max(entry.values())


# ---------------------------------------------------------------------------- penalties


@pytest.fixture(scope="module")
def repeating_prompt(llm):
    """The prompt (of 100) whose greedy continuation repeats tokens most (penalties must change it)."""
    prompts = random_prompts([6] * 100, seed=33)
    outputs = llm.generate(prompts, greedy(ignore_eos=True), use_tqdm=False)
    num_distinct, best = min((len(set(o.outputs[0].token_ids)), p) for p, o in zip(prompts, outputs))
    assert num_distinct <= NUM - 3
    return best


def test_repetition_penalty_matches_hf(llm, oracle, repeating_prompt):
    plain = one(llm, repeating_prompt, greedy(ignore_eos=True)).token_ids
    out = one(llm, repeating_prompt, greedy(ignore_eos=True, repetition_penalty=1.3)).token_ids
    assert out != plain
    assert out == oracle.greedy(repeating_prompt, NUM, repetition_penalty=1.3)


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 0.7), (0.5, -0.3)])
def test_presence_and_frequency_penalties_match_a_hf_loop(llm, oracle, repeating_prompt, presence, frequency):
    plain = one(llm, repeating_prompt, greedy(ignore_eos=True)).token_ids
    params = greedy(ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency)
    out = one(llm, repeating_prompt, params).token_ids
    assert out != plain
    # oracle: greedy over HF logits minus presence * [count > 0] - frequency * count (outputs only)
    expected: list[int] = []
    for _ in range(NUM):
        logits = oracle.logits(repeating_prompt + expected)[-1]
        counts = torch.bincount(torch.tensor(expected, dtype=torch.int64), minlength=logits.shape[0]).float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        expected.append(int(logits.argmax()))
    assert out == expected


# ---------------------------------------------------------------------------- truncation


@pytest.mark.parametrize(
    "kw",
    [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(temperature=1e-6), dict(top_k=1, top_p=0.5)],
    ids=["top_k=1", "top_p~0", "min_p=1", "temperature~0", "top_k=1+top_p"],
)
def test_degenerate_truncation_is_greedy(llm, oracle, prompt, kw):
    params = SamplingParams(**{"temperature": 1.0, **kw}, seed=4, max_tokens=NUM, ignore_eos=True)
    assert one(llm, prompt, params).token_ids == oracle.greedy(prompt, NUM)


def _hf_probs(oracle, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] next-token probabilities (temperature 1) at each output position."""
    return oracle.logits(prompt + tokens)[len(prompt) - 1 : -1].softmax(dim=-1)


def test_top_k_top_p_min_p_keep_sampled_tokens_inside_their_sets(llm, oracle, prompt):
    prompts = random_prompts([4, 9, 17, 30], seed=34)
    cases = [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.2)]
    for kw in cases:
        params = SamplingParams(temperature=1.0, seed=5, max_tokens=NUM, ignore_eos=True, **kw)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        num_not_top1 = 0
        for p, o in zip(prompts, outputs):
            tokens = o.outputs[0].token_ids
            probs = _hf_probs(oracle, p, tokens)
            for row, t in zip(probs, tokens):
                num_not_top1 += int(t != int(row.argmax()))
                if "top_k" in kw:
                    assert t in row.topk(3).indices.tolist()
                elif "top_p" in kw:  # mass strictly above the token is below top_p
                    assert row[row > row[t]].sum() < 0.5 + 1e-5
                else:
                    assert row[t] >= 0.2 * row.max() - 1e-6
        assert num_not_top1 > 0, f"{kw}: nothing but argmax was sampled"


def test_mixed_sampling_settings_run(llm, prompt):
    params = [
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, max_tokens=NUM, ignore_eos=True),
        SamplingParams(temperature=1.5, top_k=-1, max_tokens=NUM, ignore_eos=True, seed=1),
        SamplingParams(temperature=0.0, max_tokens=NUM, ignore_eos=True, repetition_penalty=1.1),
        SamplingParams(temperature=0.3, top_p=0.95, max_tokens=NUM, ignore_eos=True, presence_penalty=0.4),
    ]
    outputs = llm.generate([prompt] * 4, params, use_tqdm=False)
    for o in outputs:
        assert len(o.outputs[0].token_ids) == NUM and o.outputs[0].finish_reason == "length"
        assert all(0 <= t < 2048 for t in o.outputs[0].token_ids)


# ---------------------------------------------------------------------------- chat and dtypes

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


def test_chat_uses_the_chat_template(llm, make_model_dir):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(make_model_dir(ARCH))
    text = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert "<|im_start|>assistant" in text
    out = llm.chat(MESSAGES, greedy(ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt == text and out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == one(llm, ids, greedy(ignore_eos=True)).token_ids
    both = llm.chat([MESSAGES, MESSAGES[1:]], greedy(ignore_eos=True), use_tqdm=False)
    assert both[0].outputs[0].token_ids == out.outputs[0].token_ids
    other = hf_tok.apply_chat_template(MESSAGES[1:], tokenize=False, add_generation_prompt=True)
    assert both[1].prompt_token_ids == hf_tok.encode(other, add_special_tokens=False)


def test_text_prompt_is_tokenized(llm, oracle):
    out = llm.generate("The quick brown fox", greedy(ignore_eos=True, max_tokens=8), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("The quick brown fox")
    assert out.outputs[0].token_ids == oracle.greedy(out.prompt_token_ids, 8)


def test_bfloat16_loads_and_generates(make_model_dir, prompt):
    llm = LLM(str(make_model_dir(ARCH)), dtype="bfloat16")
    assert llm.engine.dtype == torch.bfloat16
    assert {p.dtype for p in llm.engine.model.parameters()} == {torch.bfloat16}
    outputs = llm.generate([prompt, prompt[:5]], greedy(ignore_eos=True), use_tqdm=False)
    for o in outputs:
        assert len(o.outputs[0].token_ids) == NUM and o.outputs[0].finish_reason == "length"
    # greedy is deterministic in bf16 too
    again = llm.generate([prompt], greedy(ignore_eos=True), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outputs[0].outputs[0].token_ids
