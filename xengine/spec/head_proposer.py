"""The ``mtp``, ``eagle`` and ``eagle3`` proposers: a draft head over the target's hidden states drafts
(``models/draft_head.py``: the checkpoint's own MTP layer, ``models/mtp.py``; an EAGLE head from a folder
of its own, ``models/eagle.py``).

The head reads pairs: a hidden state of the target's at position ``t`` (its final one; EAGLE-3: three of
its layers' side by side) and the token at ``t + 1``. The target's runner keeps each step's rows
(``HiddenRows``: only rows of tokens the sequence keeps), and before each scheduling pass ``prepare``
feeds every sequence's new pairs through the head in one batched forward: the prompt's while it is
prefilled (the head has KV for the prompt, as in the MiMo / DeepSeek serving stacks), then the tokens
each verification kept. The last pair's output is the first draft; each further draft feeds the previous
draft and the head's own output back in (for MTP, HF's chaining of depths, the last layer reused when
``k`` exceeds the layers). Drafts are greedy under the request's token-level constraints and penalties
(``draft_model._draft_params``): point masses for the verifier.

Each sequence has a shadow ``Request`` over its tokens from the second on: shadow position ``t`` is the
pair ``(h_t, x_{t+1})`` (the head's attention positions are the target's, shifted by one: RoPE sees the
same distances), with KV in the head's pool for its computed pairs. Draft pairs are written past them
and overwritten by the pairs a verification keeps, so nothing is rolled back. With prefix caching the
head's pool caches its blocks too, keyed by every token their pairs read (``pair_keys``): a sequence
that resumes from the target's prefix cache resumes from the head's.

Where the rows start later than the head's KV reaches (a decode instance that received its prompt's
KV; a prefix hit the head's cache lacks; a fork of an ``n > 1`` request; a step whose rows were not
captured), the head starts again from the first row held: its shadow's first position then stands for
that pair (``bases``), and it attends to the pairs from there on only -- fewer drafts right, none wrong.
"""

from __future__ import annotations

import dataclasses

import torch

from memory.kv_cache_manager import ComputedPrefix
from xengine.models.draft_head import DraftHeadModel
from xengine.models.info import ModelInfo
from xengine.request import Request
from xengine.scheduler.plan import ScheduledSeq, SchedulePlan
from xengine.spec.draft_model import _draft_params
from xengine.spec.draft_pool import TargetPool, build_draft_pool
from xengine.spec.hidden_rows import HiddenRows


def pair_keys(tokens: list[int]) -> list[int]:
    """Prefix-cache keys of the pairs of ``tokens`` (one fewer): pair ``t`` keyed by ``x_{t+1}``, the
    first by ``x_0`` and ``x_1`` together, so a block's path spells every token its pairs depend on."""
    return [tokens[1] + ((tokens[0] + 1) << 32)] + tokens[2:]


@dataclasses.dataclass
class _Pending:
    shadow: Request
    k: int  # drafts wanted
    tokens: list[int]  # the sequence's tokens (known ones)
    start: int  # the first pair (absolute) this pass computes
    end: int  # the pairs ``start..end-1`` have their row and their next token
    final: int  # after this pass, every depth's KV is final before this pair
    rows: torch.Tensor  # the previous depth's hidden state of each pair this depth computes
    drafts: list[int]
    keys: list[int] | None  # the tokens its pairs read, as the prefix cache keys them; None: not cached


class HeadProposer:
    def __init__(self, head: DraftHeadModel, hidden: HiddenRows, target: TargetPool, info: ModelInfo) -> None:
        """``hidden``: the rows the target's runner keeps; ``target``: the target's pool; ``info``: the
        head's KV geometry (its pool holds ``info.num_layers`` layers: one per depth of an MTP chain)."""
        self.head = head
        self.hidden = hidden
        self.depths = head.num_depths  # layers chained at one position (MTP); further drafts advance
        pool = build_draft_pool(head, info, target, target.max_model_len, prefix_caching=True)
        self.kv, self.runner, self.max_len = pool.kv, pool.runner, pool.max_len
        self.caches = pool.caches  # the head's KV tensors (a PD export hands out their blocks)
        self.shadows: dict[str, Request] = {}
        self.bases: dict[str, int] = {}  # per shadow: the pair its first position stands for
        self.drafts: dict[str, list[int]] = {}
        self.num_steps = 0  # head forwards run

    def prepare(self, reqs: list[Request], ks: list[int]) -> None:
        """Feed each of ``reqs`` its new pairs and draft up to ``ks[i]`` tokens (``propose`` reads them)."""
        self.drafts = {}
        self.hidden.keep_only({r.seq_id for r in reqs})
        self._run([p for p in (self._new_pairs(req, k) for req, k in zip(reqs, ks)) if p is not None])

    def finish(self, req: Request) -> None:
        """``req`` ended: feed the pairs it still has when they complete a block the head's cache keeps
        (a prefill instance's prompt, for the decode instance that imports it: ``disagg/head_transfer.py``),
        then release it."""
        if self.kv.prefix_cache is not None:
            p = self._new_pairs(req, 0)
            base = self.bases.get(req.seq_id, 0)
            if (
                p is not None
                and p.keys is not None
                and self.kv.has_blocks_to_cache(req.seq_id, p.final - base)
            ):
                self._run([p])
        self.release(req.seq_id)

    def _run(self, batch: list[_Pending]) -> None:
        """Run ``batch`` through the head, one depth per forward. Depth ``i`` below the chain's layers runs
        layer ``i`` over the pass's pairs with the tokens shifted by ``i`` (the drafts so far past the
        known ones, as HF's MTP chain); each further depth runs the last layer one position on."""
        pending, depth = list(batch), 0
        while batch:
            views, going = [], []
            for p in batch:
                view = self._view(p, depth)
                if view is not None:
                    views.append((p, *view))
            if not views:
                break
            plan = SchedulePlan(
                seqs=[ScheduledSeq(v, n, sample) for _, v, n, sample in views],
                block_tables={v.seq_id: self.kv.get_block_table(p.shadow.seq_id) for p, v, _, _ in views},
            )
            plan.num_batched_tokens = sum(n for _, _, n, _ in views)
            self.head.depth = depth
            self.head.prev_hidden = torch.cat([p.rows[:n] for p, _, n, _ in views])
            out = self.runner.execute(plan)
            self.num_steps += 1
            chain = self.head.out_hidden
            assert chain is not None
            offset = 0
            for p, view, n, sample in views:
                p.rows, offset = chain[offset : offset + n], offset + n
                if sample:
                    p.drafts.append(out.sampled[view.seq_id][0].token_id)
                if depth + 1 < self.depths or len(p.drafts) < p.k:
                    going.append(p)
            batch = going
            depth += 1
        for p in pending:
            shadow, base = p.shadow, self.bases[p.shadow.seq_id]
            shadow.num_computed_tokens = p.final - base
            if p.keys is not None and self.kv.has_blocks_to_cache(shadow.seq_id, p.final - base):
                self.kv.cache_blocks(shadow.seq_id, pair_keys(p.keys), p.final - base)
        self.head.prev_hidden = self.head.out_hidden = None

    def _view(self, p: _Pending, depth: int) -> tuple[Request, int, bool] | None:
        """What depth ``depth`` computes for ``p``: a request over the shadow's block table whose token at
        position ``t`` is the one pair ``t`` reads at that depth, the pairs to compute, whether to draft."""
        base, layer = self.bases[p.shadow.seq_id], min(depth, self.depths - 1)
        if depth < self.depths:  # the pass's pairs, with the drafts so far where the tokens run out
            drafting = p.k > 0 and len(p.drafts) >= depth
            first, last = p.start, p.end if drafting else p.end - depth
            sample = drafting and len(p.drafts) < p.k
        else:  # one pair on, from the last draft
            first = last = p.end + depth - self.depths
            last += 1
            sample = True
            if p.rows.shape[0] > 1:
                p.rows = p.rows[-1:]
        if last <= first:
            return None
        tokens = p.tokens[1 + base + layer : p.end + 1] + p.drafts[:depth]
        split = max(p.shadow.num_prompt_tokens - layer, 1)
        view = Request(f"{p.shadow.seq_id}@{layer}", p.shadow.req_id, 0, tokens[:split], p.shadow.params)
        view.output_token_ids = tokens[split:]
        view.num_computed_tokens = first - base
        return view, last - first, sample

    def _new_pairs(self, req: Request, k: int) -> _Pending | None:
        """``req``'s pass: its new pairs (and those a deeper depth must compute again) with room for ``k``
        drafts, or None when there is nothing to compute."""
        tokens = req.all_token_ids
        known = len(tokens) - req.num_placeholders
        held = self.hidden.available(req.seq_id)
        if held is None or known < 2:
            return None
        shadow = self.shadows.get(req.seq_id)
        base = self.bases.get(req.seq_id, 0)  # the pair the shadow's first position stands for
        final = base + shadow.num_computed_tokens if shadow is not None else 0
        if shadow is not None and held[0] > final:  # a gap in the rows: start again from those held
            self._forget(req.seq_id)
            shadow = None
        prefix = None
        if shadow is None:
            base = final = held[0]
            if held[0] > 0:  # the target resumed from its prefix cache (or got its prompt's KV)
                prefix = self._cached_pairs(req.cache_token_ids, held[0])
                if prefix is not None:  # so does the head, from its own cached blocks
                    base = 0
        end = min(held[1], known - 1)  # pairs ..end-1 have their row and their next token
        extra = max(k - self.depths, 0)  # pairs past the last known one (drafts beyond the chain)
        if end < known - 1 or end - base + extra > self.max_len:
            k = extra = 0  # the last known token's pair is not computable yet: feed, no drafts
        start = min(final, end - 1) if k else final  # drafting reads the last pair again
        if end <= start or start < held[0]:
            return None
        if not self.kv.allocate_slots(req.seq_id, end - base + extra, prefix, num_computed=start - base):
            return None  # the head's pool is full: this sequence's new pairs wait
        new_final = max(final, end - self.depths + 1)
        rows = self.hidden.take(req.seq_id, start, end, keep_from=min(new_final, end - 1))
        if rows is None:
            return None
        if shadow is None:
            first = tokens[1 + base : max(req.num_prompt_tokens, base + 2)]
            shadow = Request(req.seq_id, req.seq_id, 0, first, _draft_params(req.params))
            self.shadows[req.seq_id], self.bases[req.seq_id] = shadow, base
        drafts = self.drafts[req.seq_id] = []
        keys = req.cache_token_ids[: end + 1] if base == 0 else None
        return _Pending(shadow, k, tokens[:known], start, end, new_final, rows, drafts, keys)

    def _cached_pairs(self, tokens: list[int], num: int) -> ComputedPrefix | None:
        """The head's cached blocks of pairs ``0..num-1`` (all of them, whole blocks), or None."""
        bs = self.kv.block_size
        if num % bs or num + 1 > len(tokens):
            return None
        hit = self.kv.get_computed_prefix(pair_keys(tokens[: num + 1]) + [-1])  # -1: leaves none to compute
        if hit.num_tokens < num:
            return None
        return ComputedPrefix(hit.block_ids[: num // bs], num)

    def propose(self, req: Request, k: int) -> list[int]:
        return self.drafts.get(req.seq_id, [])[:k]

    def release(self, seq_id: str) -> None:
        self._forget(seq_id)
        self.drafts.pop(seq_id, None)
        self.hidden.release(seq_id)

    def _forget(self, seq_id: str) -> None:
        """Drop a sequence's shadow and its KV in the head."""
        self.kv.free(seq_id)
        self.shadows.pop(seq_id, None)
        self.bases.pop(seq_id, None)
        self.runner.release([f"{seq_id}@{layer}" for layer in range(self.depths)])
