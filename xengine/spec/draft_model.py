"""The ``draft_model`` proposer: a small model with the target's vocabulary drafts ``k`` tokens greedily.

The draft model runs on the engine's device beside the target, with a runner and a KV pool of its
own (paged, as many blocks as the target's pool: its blocks are smaller, so it holds every token the
target can). Before each scheduling pass, ``prepare`` drafts for every sequence that may draft, in
``k`` batched steps: the first feeds what the draft model has not seen yet (its whole prompt at the
start, afterwards the tokens the last verification emitted), the others one draft each.

Each sequence has a shadow ``Request`` in the draft model: its tokens and how many have KV in the
draft pool. After a verification the draft KV stays valid up to the first position where the
sequence's tokens differ from the shadow's (the accepted drafts are the same tokens), so only what
follows is computed again; a rejected draft's KV is overwritten in place. Drafts are greedy under the
request's token-level constraints and penalties (``allowed_token_ids``, ``logit_bias``, bad words): point
masses, which the rejection sampler takes as they are (``verify.py``).
"""

from __future__ import annotations

import msgspec

from xengine.api.messages import SamplingParams
from xengine.models.info import read_model_info
from xengine.models.loader import load_model
from xengine.request import Request
from xengine.scheduler.plan import ScheduledSeq, SchedulePlan
from xengine.spec.draft_pool import TargetPool, build_draft_pool
from xengine.state_setup import state_shapes


def _draft_params(params: SamplingParams) -> SamplingParams:
    """Greedy, under the request's token-level constraints and penalties (so the drafts are tokens the
    target may emit); its grammar is the target's to apply (``valid_prefix``)."""
    return msgspec.structs.replace(
        params, n=1, temperature=0.0, seed=None, max_tokens=None, min_tokens=0, ignore_eos=True, logprobs=None,
        prompt_logprobs=None, structured_outputs=None, logprob_token_ids=None, stop=[], stop_token_ids=[],
    )  # fmt: skip


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelProposer:
    def __init__(self, model_dir: str, target: TargetPool, vocab_size: int) -> None:
        """``target``: the target's pool; ``vocab_size``: its vocabulary."""
        info = read_model_info(model_dir)
        if info.vocab_size != vocab_size:
            raise ValueError(
                f"speculative_config.model {model_dir!r} has a vocabulary of {info.vocab_size} ids, the "
                f"target {vocab_size}: a draft model must share the target's tokenizer"
            )
        self.model = load_model(model_dir, target.dtype, target.platform.torch_device())
        if state_shapes(self.model):
            raise ValueError(
                "speculative_config.model: a draft model with recurrent layers is not supported yet"
            )
        max_len = min(target.max_model_len, info.max_position_embeddings)
        pool = build_draft_pool(self.model, info, target, max_len, prefix_caching=False)
        self.kv, self.runner, self.max_len = pool.kv, pool.runner, pool.max_len
        self.shadows: dict[str, Request] = {}
        self.drafts: dict[str, list[int]] = {}
        self.num_steps = 0  # draft-model forwards run

    def prepare(self, reqs: list[Request], ks: list[int]) -> None:
        """Draft up to ``ks[i]`` tokens for each of ``reqs`` (read back by ``propose``)."""
        self.drafts = {}
        active: list[tuple[Request, int]] = []
        for req, k in zip(reqs, ks):
            tokens = req.all_token_ids
            if k <= 0 or len(tokens) + k - 1 > self.max_len:
                continue
            shadow = self.shadows.get(req.seq_id)
            if shadow is None:
                shadow = Request(
                    req.seq_id, req.seq_id, 0, list(req.prompt_token_ids), _draft_params(req.params)
                )
                self.shadows[req.seq_id] = shadow
            valid = min(
                shadow.num_computed_tokens, _common_prefix(shadow.all_token_ids, tokens), len(tokens) - 1
            )
            shadow.output_token_ids = tokens[shadow.num_prompt_tokens :]
            shadow.num_computed_tokens = valid
            if not self.kv.allocate_slots(req.seq_id, len(tokens) + k - 1, num_computed=valid):
                continue  # the draft pool is full: no drafts for it this step
            active.append((shadow, k))
            self.drafts[req.seq_id] = []
        while active:
            plan = SchedulePlan(
                seqs=[ScheduledSeq(s, s.num_tokens - s.num_computed_tokens, True) for s, _ in active],
                block_tables={s.seq_id: self.kv.get_block_table(s.seq_id) for s, _ in active},
            )
            plan.num_batched_tokens = sum(x.num_new_tokens for x in plan.seqs)
            out = self.runner.execute(plan)
            self.num_steps += 1
            for shadow, _ in active:
                token = out.sampled[shadow.seq_id][0].token_id
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.output_token_ids.append(token)
                self.drafts[shadow.seq_id].append(token)
            active = [(s, k) for s, k in active if len(self.drafts[s.seq_id]) < k]

    def propose(self, req: Request, k: int) -> list[int]:
        return self.drafts.get(req.seq_id, [])[:k]

    def release(self, seq_id: str) -> None:
        self.kv.free(seq_id)
        self.shadows.pop(seq_id, None)
        self.drafts.pop(seq_id, None)
        self.runner.release([seq_id])
