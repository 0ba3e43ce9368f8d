"""Bad input through the offline API: a ``ValueError`` naming the field and its allowed range,
nothing left behind in the engine, and the same ``LLM`` still generating correctly afterwards."""

from __future__ import annotations

import pytest

from tests.xengine.conftest import VOCAB_SIZE, make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams
from xengine.llm import LLM

MAX_MODEL_LEN = 128
GOOD_PROMPT = random_prompts([12], seed=41)[0]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(make_model_dir):
    return LLM(str(make_model_dir("qwen3")), max_model_len=MAX_MODEL_LEN, num_blocks=64)


@pytest.fixture(scope="module")
def expected(hf_oracle):
    return hf_oracle("qwen3").greedy(GOOD_PROMPT, 8)


def assert_clean_and_working(llm: LLM, expected: list[int]) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.seqs == {} and engine.scheduler.groups == {}
    assert engine.kv.block_tables == {}
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    out = llm.generate([GOOD_PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected


BAD_PROMPTS = {
    "empty text": ("", r"'prompt'.*empty"),
    "empty ids": ([[]], r"'prompt'.*empty"),
    "too long": ([list(range(3, 3 + MAX_MODEL_LEN))], rf"'prompt'.*{MAX_MODEL_LEN}"),
    "far too long": ([[5] * (3 * MAX_MODEL_LEN)], rf"'prompt'.*{MAX_MODEL_LEN}"),
    "id = vocab": ([[5, VOCAB_SIZE, 6]], rf"'prompt'.*{VOCAB_SIZE}.*\[0, {VOCAB_SIZE}\)"),
    "id huge": ([[5, 10**12]], rf"'prompt'.*\[0, {VOCAB_SIZE}\)"),
    "negative id": ([[5, -1]], rf"'prompt'.*-1.*\[0, {VOCAB_SIZE}\)"),
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_bad_prompt(llm, expected, case):
    prompts, message = BAD_PROMPTS[case]
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_clean_and_working(llm, expected)


def test_longest_allowed_prompt(llm):
    out = llm.generate([[7] * (MAX_MODEL_LEN - 1)], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"  # the context is full


BAD_PARAMS = {
    "temperature=-1": (dict(temperature=-1.0), r"'temperature'.*\[0, 100\]"),
    "temperature=nan": (dict(temperature=float("nan")), r"'temperature'.*\[0, 100\]"),
    "top_p=0": (dict(top_p=0.0), r"'top_p'.*\(0, 1\]"),
    "top_p=1.5": (dict(top_p=1.5), r"'top_p'.*\(0, 1\]"),
    "top_k=-2": (dict(top_k=-2), r"'top_k'.*-1, 0 .*positive"),
    "min_p=2": (dict(min_p=2.0), r"'min_p'.*\[0, 1\]"),
    "n=0": (dict(n=0), r"'n'.*\[1, 128\]"),
    "n=1000": (dict(n=1000), r"'n'.*\[1, 128\]"),
    "max_tokens=-1": (dict(max_tokens=-1), r"'max_tokens'.*non-negative"),  # 0: prefill only
    "prompt_logprobs=21": (dict(prompt_logprobs=21), r"'prompt_logprobs'.*\[0, 20\]"),
    "min_tokens>max_tokens": (dict(min_tokens=9, max_tokens=8), r"'min_tokens'.*<= max_tokens \(8\)"),
    "min_tokens=-1": (dict(min_tokens=-1), r"'min_tokens'.*>= 0"),
    "logprobs=50": (dict(logprobs=50), r"'logprobs'.*\[0, 20\]"),
    "logprobs=-1": (dict(logprobs=-1), r"'logprobs'.*\[0, 20\]"),
    "stop_token_ids=vocab": (dict(stop_token_ids=[VOCAB_SIZE]), rf"'stop_token_ids'.*\[0, {VOCAB_SIZE}\)"),
    "stop_token_ids=-3": (dict(stop_token_ids=[-3]), rf"'stop_token_ids'.*\[0, {VOCAB_SIZE}\)"),
    "repetition_penalty=0": (dict(repetition_penalty=0.0), r"'repetition_penalty'.*\(0, 10\]"),
    "presence_penalty=3": (dict(presence_penalty=3.0), r"'presence_penalty'.*\[-2, 2\]"),
    "frequency_penalty=-3": (dict(frequency_penalty=-3.0), r"'frequency_penalty'.*\[-2, 2\]"),
    "seed=-1": (dict(seed=-1), r"'seed'.*\[0, 2\^63\)"),
    "empty stop string": (dict(stop=[""]), r"'stop'.*1\.\.256"),
    "too many stop strings": (dict(stop=[f"s{i}" for i in range(17)]), r"'stop'.*16"),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_bad_sampling_params(llm, expected, case):
    kw, message = BAD_PARAMS[case]
    with pytest.raises(ValueError, match=message):
        llm.generate([GOOD_PROMPT], SamplingParams(**kw), use_tqdm=False)
    assert_clean_and_working(llm, expected)


@pytest.mark.parametrize("bad_first", [False, True])
def test_batch_with_one_bad_request_leaves_nothing(llm, expected, bad_first):
    good = [GOOD_PROMPT, random_prompts([100], seed=42)[0]]
    params = [GREEDY, GREEDY, SamplingParams(temperature=-1.0)]
    prompts = [*good, GOOD_PROMPT]
    if bad_first:
        prompts, params = prompts[::-1], params[::-1]
    with pytest.raises(ValueError, match="'temperature'"):
        llm.generate(prompts, params, use_tqdm=False)
    assert_clean_and_working(llm, expected)


def test_mismatched_params_list(llm, expected):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate([GOOD_PROMPT] * 3, [GREEDY, GREEDY], use_tqdm=False)
    assert_clean_and_working(llm, expected)


def test_duplicate_request_id_is_refused(make_model_dir):
    engine = make_engine(make_model_dir("qwen3"), num_blocks=32)
    engine.add_request(AddRequest(req_id="x", prompt_token_ids=GOOD_PROMPT, params=GREEDY))
    with pytest.raises(ValueError, match="'req_id'.*already running"):
        engine.add_request(AddRequest(req_id="x", prompt_token_ids=GOOD_PROMPT, params=GREEDY))
    with pytest.raises(ValueError, match="'req_id'"):
        engine.add_request(AddRequest(req_id="", prompt_token_ids=GOOD_PROMPT, params=GREEDY))
    run_to_completion(engine)
    assert engine.scheduler.groups == {} and engine.kv.num_free_blocks == 32


@pytest.mark.parametrize("bad_id", [1.5, "7"], ids=["float", "str"])
def test_non_integer_token_ids_are_refused(llm, expected, bad_id):
    with pytest.raises(ValueError, match="'prompt'"):
        llm.generate([[5, bad_id, 6]], GREEDY, use_tqdm=False)
    assert_clean_and_working(llm, expected)


def test_prompt_over_the_unchunked_budget(make_model_dir):
    """Without chunked prefill a prompt must fit one step's budget: a longer one is refused up front,
    naming the limit, and leaves nothing behind; one that fits runs to the end (both sequences)."""
    engine = make_engine(
        make_model_dir("qwen3"), enable_chunked_prefill=False, max_num_batched_tokens=64, num_blocks=32
    )
    prompt = random_prompts([100], seed=43)[0]
    with pytest.raises(
        ValueError, match=r"'prompt'.*64, set by max_num_batched_tokens \(chunked prefill is off"
    ):
        engine.add_request(AddRequest(req_id="big", prompt_token_ids=prompt, params=SamplingParams(n=2)))
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == 32
    params = SamplingParams(n=2, max_tokens=3, ignore_eos=True)
    engine.add_request(AddRequest(req_id="fits", prompt_token_ids=prompt[:60], params=params))
    finished = {d.index for d in run_to_completion(engine, max_steps=50) if d.finish_reason is not None}
    assert finished == {0, 1}
    assert engine.scheduler.groups == {} and engine.kv.num_free_blocks == 32
