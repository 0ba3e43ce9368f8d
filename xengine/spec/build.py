"""Speculative decoding's set-up for an engine: the drafter and its proposer (n-gram; a draft model;
an MTP / EAGLE head over the target's hidden states), built once the engine has its model, runner and
KV pool; what it does not run with yet is refused rather than ignored."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from xengine.api.config import EngineConfig
from xengine.models.eagle import load_eagle
from xengine.models.mtp import load_mtp
from xengine.spec.draft_model import DraftModelProposer
from xengine.spec.draft_pool import TargetPool
from xengine.spec.drafting import Drafter
from xengine.spec.head_proposer import HeadProposer
from xengine.spec.hidden_rows import HiddenRows

Engine = (
    Any  # ``xengine.engine.Engine`` (its model, runner, KV pool, platform): not imported, it imports this
)


def build_drafter(engine: Engine, config: EngineConfig) -> Drafter | None:
    """Speculative decoding's drafts (``xengine/spec/``), or None when it is off; refuses the
    setups it does not run with yet, rather than ignoring the setting."""
    spec = config.speculative_config
    if not spec.enabled:
        return None
    blocker = None
    tensor_parallel = engine.parallel is not None and engine.parallel.tensor_parallel_size > 1
    if engine.parallel is not None and not (tensor_parallel and spec.method == "ngram"):
        # n-gram drafts need no model: under tensor parallelism every draft row's logits are split
        # over the ranks like any sampled row's
        blocker = "tensor parallelism (ngram only)" if tensor_parallel else "expert parallelism"
    elif engine.graph_mode == "full":
        blocker = "full device graphs (set execution.graph_mode eager or partial)"
    elif getattr(engine.model, "encode_images", None) is not None:
        blocker = "vision-language models"
    if blocker is not None:
        raise ValueError(f"speculative decoding ({spec.method}) does not run with {blocker} yet")
    proposer = None
    if spec.method == "draft_model":
        if not Path(spec.model).is_dir():
            raise ValueError(
                f"speculative_config.model {spec.model!r} is not a folder: give the draft's HF folder"
            )
        proposer = DraftModelProposer(spec.model, target_pool(engine, config), engine.model_info.vocab_size)
    elif spec.method in ("mtp", "eagle", "eagle3"):
        proposer = _head_proposer(engine, config)
    return Drafter(spec, engine.max_model_len, proposer)


def _head_proposer(engine: Engine, config: EngineConfig) -> HeadProposer:
    """A draft head over the target's hidden states: the checkpoint's MTP layer, or an EAGLE head
    from ``speculative_config.model``; the runner keeps the rows it reads."""
    spec = config.speculative_config
    if spec.method == "mtp":
        head = load_mtp(engine.model, config.model.model, config.model.quantization)
        geometry_of = getattr(engine.model, "mtp_kv_info", None)  # a layer unlike the target's first
        depths = head.num_depths  # one KV layer per MTP layer
        geometry = (
            geometry_of(engine.model_info, depths)
            if geometry_of is not None
            else dataclasses.replace(engine.model_info, num_layers=depths)
        )
    else:
        if not Path(spec.model).is_dir():
            raise ValueError(
                f"speculative_config.model {spec.model!r} is not a folder: give the {spec.method} head's "
                "HF folder"
            )
        head, geometry = load_eagle(engine.model, spec.model, spec.method, config.model.quantization)
    source = None
    if spec.method == "eagle3":  # the layers the target captures, not its final hidden state
        source = lambda: engine.model.model.aux_hidden  # noqa: E731
    engine.runner.hidden_rows = HiddenRows(source)
    return HeadProposer(head, engine.runner.hidden_rows, target_pool(engine, config), geometry)


def target_pool(engine: Engine, config: EngineConfig) -> TargetPool:
    """What a proposer's own KV pool copies from ``engine``'s."""
    return TargetPool(
        engine.platform,
        engine.dtype,
        config.cache,
        config.scheduler,
        engine.kv.pool.num_blocks,
        engine.max_model_len,
    )
