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
from tests.xengine.spec.oracle import OracleProposer

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


def test_an_mtp_head_drafts_on_the_decode_side(make_model_dir, tmp_path_factory) -> None:
    """The decode side has no hidden states of the prompt (only its KV): its MTP layer starts from the
    first token it computes, attending to the pairs from there on."""
    from xengine.tools.mtp_checkpoint import add_mtp_layer

    model = add_mtp_layer(make_model_dir("qwen3_next"), tmp_path_factory.mktemp("mtp-pd"))
    kw = dict(state_snapshot_interval=32)
    prefill = make_engine(model, **SETTINGS, **kw)
    colocated = make_engine(model, **SETTINGS, **kw)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    decode = make_engine(model, **SETTINGS, **kw, speculative_config=spec)
    prompts = random_prompts([20, 45], seed=13)
    expected = [_generate(colocated, f"c{i}", p, MAX_TOKENS) for i, p in enumerate(prompts)]
    for i, prompt in enumerate(prompts):
        tokens, _, _, _ = _pd(prefill, decode, f"r{i}", prompt)
        assert tokens == expected[i], f"prompt {i} differs"
    proposer = decode.scheduler.drafter.proposer
    assert decode.scheduler.drafter.stats.num_draft_tokens > 0
    assert proposer.shadows == {} and proposer.kv.block_tables == {}
