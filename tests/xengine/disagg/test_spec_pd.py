"""Speculative decoding on the decode side of PD disaggregation: the prefill engine computes the prompt
and hands its KV (and a recurrent model's state snapshot) over Mooncake; the decode engine drafts from
the imported prefix on. Greedy tokens equal one colocated engine's without speculation; drafts were
accepted (the bigram checkpoint on prompts that hold its own continuation; an oracle proposer on
Qwen3-Next, whose random weights never repeat themselves)."""

from __future__ import annotations

import pytest

from benchmarks.spec_checkpoints import make_bigram_copy
from tests.xengine.conftest import make_engine, random_prompts
from tests.xengine.disagg.test_hybrid_pd import MAX_TOKENS, SETTINGS, _generate, _pd
from tests.xengine.spec.oracle import OracleProposer, RecordingProposer

pytest.importorskip("mooncake.engine")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_the_decode_side_drafts_from_the_imported_prefix(make_model_dir, tmp_path_factory, arch) -> None:
    recurrent = arch == "qwen3_next"
    model = make_model_dir(arch)
    if not recurrent:
        model = make_bigram_copy(model, tmp_path_factory.mktemp("bigram-pd"))
    kw = dict(state_snapshot_interval=32) if recurrent else {}
    prefill = make_engine(model, **SETTINGS, **kw)
    colocated = make_engine(model, **SETTINGS, **kw)
    decode = make_engine(model, **SETTINGS, **kw, speculative_config=NGRAM)
    heads = random_prompts([20, 45, 70], seed=12)
    chains = [_generate(colocated, f"h{i}", h, 30) for i, h in enumerate(heads)]
    prompts = [h + c + h for h, c in zip(heads, chains)]  # lookup finds the continuation (bigram)
    expected = [_generate(colocated, f"c{i}", p, MAX_TOKENS) for i, p in enumerate(prompts)]
    drafter = decode.scheduler.drafter
    if recurrent:
        drafter.proposer = OracleProposer({tuple(p + e[:1]): e[1:] for p, e in zip(prompts, expected)}, 2048)
    for i, prompt in enumerate(prompts):
        tokens, result, source, _ = _pd(prefill, decode, f"r{i}", prompt)
        assert tokens == expected[i], f"prompt {i} differs"
        assert result.num_blocks == len(source.block_ids) > 0
    assert drafter.stats.num_accepted_tokens > 0, drafter.stats


def _pd_with_head(prefill, decode, req_id: str, prompt: list[int]):
    """PD as the service runs it: the prefill's token keys the head's last block of the prompt."""
    first = _generate(prefill, f"{req_id}-p", prompt, 1)
    source = prefill.kv_export(f"{req_id}-x", prompt, first[0])
    result = decode.kv_import(source, prompt, f"{req_id}-d", first[0])
    assert prefill.kv_release(f"{req_id}-x")
    return first + _generate(decode, f"{req_id}-d", prompt + first, MAX_TOKENS - 1), result, source


@pytest.mark.parametrize("arch,method", [("qwen3_next", "mtp"), ("llama", "eagle")])
def test_a_draft_head_gets_the_prompt_with_its_kv(make_model_dir, tmp_path_factory, arch, method) -> None:
    """The prefill instance's head reads the prompt's pairs and its blocks travel with the prompt's KV:
    the decode side's head drafts from the whole prompt, exactly what one colocated engine's head
    drafts (the same drafts at the same tokens), and never restarts past the first pair."""
    from xengine.tools.eagle_checkpoint import make_eagle_head
    from xengine.tools.mtp_checkpoint import add_mtp_layer

    recurrent = arch == "qwen3_next"
    model = make_model_dir(arch)
    spec = {"method": method, "num_speculative_tokens": 2}
    if method == "mtp":
        model = add_mtp_layer(model, tmp_path_factory.mktemp("mtp-pd"))
    else:
        spec["model"] = str(make_eagle_head(model, tmp_path_factory.mktemp("eagle-pd"), "eagle"))
    kw = dict(state_snapshot_interval=32) if recurrent else {}
    prefill, decode, colocated = (
        make_engine(model, **SETTINGS, **kw, speculative_config=spec) for _ in range(3)
    )
    recorders = []
    for engine in (decode, colocated):
        drafter = engine.scheduler.drafter
        drafter.proposer = RecordingProposer(drafter.proposer)
        recorders.append(drafter.proposer)
    prompts = random_prompts([70, 100, 64], seed=13)  # 64: the last block is keyed by the prefill's token
    for i, prompt in enumerate(prompts):
        expected = _generate(colocated, f"c{i}", prompt, MAX_TOKENS)
        tokens, result, source = _pd_with_head(prefill, decode, f"r{i}", prompt)
        assert tokens == expected, f"prompt {i} differs"
        k = len(source.block_ids)
        assert k > 0 and source.head is not None and len(source.head.block_ids) == k
        head = decode.kv_transfer.head
        per_block = head.caches[0][0, 0].nbytes * 2 * len(head.caches)
        assert (result.num_head_blocks, result.num_head_bytes) == (k, k * per_block)
    on_decode, on_colocated = recorders
    assert on_decode.truncated == 0 and on_decode.seen
    assert on_decode.seen == {key: on_colocated.seen[key] for key in on_decode.seen}
    assert decode.scheduler.drafter.stats.num_draft_tokens > 0
    assert prefill.kv_transfer.num_pins == 0 and decode.kv_transfer.num_pins == 0
    proposer = decode.scheduler.drafter.proposer.inner
    assert proposer.shadows == {} and proposer.kv.block_tables == {}


def test_a_decode_side_with_another_head_starts_from_its_first_token(
    make_model_dir, tmp_path_factory
) -> None:
    """A prefill instance without speculation sends no head blocks, and an importer running another
    head ignores them: its head starts from the first token it computes (fewer drafts right, none
    wrong)."""
    from xengine.tools.eagle_checkpoint import make_eagle_head

    model = make_model_dir("llama")
    heads = [make_eagle_head(model, tmp_path_factory.mktemp(f"eagle-{s}"), "eagle", seed=s) for s in (1, 2)]
    specs = [{"method": "eagle", "num_speculative_tokens": 2, "model": str(h)} for h in heads]
    plain = make_engine(model, **SETTINGS)
    other = make_engine(model, **SETTINGS, speculative_config=specs[0])
    decode = make_engine(model, **SETTINGS, speculative_config=specs[1])
    colocated = make_engine(model, **SETTINGS)
    drafter = decode.scheduler.drafter
    drafter.proposer = recorder = RecordingProposer(drafter.proposer)
    for i, (prompt, prefill) in enumerate(zip(random_prompts([70, 90], seed=14), (plain, other))):
        tokens, result, source = _pd_with_head(prefill, decode, f"r{i}", prompt)
        assert tokens == _generate(colocated, f"c{i}", prompt, MAX_TOKENS), f"prompt {i} differs"
        assert (source.head is None) == (prefill is plain)
        assert result.num_blocks == len(source.block_ids) > 0 and result.num_head_blocks == 0
    assert recorder.truncated > 0 and drafter.stats.num_draft_tokens > 0
