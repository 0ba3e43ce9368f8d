"""What an engine checks of a request on arrival (``Engine.add_request``): every problem a
``ValueError`` naming the field, which the service turns into a 400."""

from __future__ import annotations

from typing import Any

from xengine.api.messages import AddRequest
from xengine.request import PRIORITY_RANK

Engine = Any  # ``xengine.engine.Engine`` (not imported: it imports this module)


def validate_request(engine: Engine, req: AddRequest) -> None:
    """Raise ``ValueError`` naming the field when ``req`` cannot be served by ``engine``."""
    if not req.req_id:
        raise ValueError("invalid value for 'req_id': must be a non-empty string")
    if req.req_id in engine.scheduler.groups or req.req_id in engine.structured.waiting:
        raise ValueError(f"invalid value for 'req_id': {req.req_id!r} is already running")
    if req.priority not in PRIORITY_RANK:
        raise ValueError(f"invalid value for 'priority': must be one of {sorted(PRIORITY_RANK)}")
    ids = req.prompt_token_ids
    if not ids:
        raise ValueError("invalid value for 'prompt': the prompt is empty")
    bad = next((t for t in ids if type(t) is not int or not (0 <= t < engine.vocab_size)), None)
    if bad is not None:
        raise ValueError(
            f"invalid value for 'prompt': token id {bad!r} is not an integer in the vocabulary [0, {engine.vocab_size})"
        )
    # a prefill-only request may fill the context: it adds no token
    if len(ids) > engine.max_model_len - (0 if req.params.is_prefill_only else 1):
        raise ValueError(
            f"invalid value for 'prompt': {len(ids)} tokens, the maximum context length is "
            f"{engine.max_model_len}, set by {engine.kv_setup.len_limit} (prompt must be shorter, leaving room for output)"
        )
    req.params.validate(engine.vocab_size, engine.config.model.max_logprobs)
    if req.pooling is not None:
        req.pooling.validate(engine.model_info.hidden_size)
        if not req.params.is_prefill_only or req.params.n != 1:
            raise ValueError("invalid value for 'max_tokens': an embedding request takes max_tokens=0, n=1")
    if req.params.use_beam_search:
        _validate_beam(engine, req)
    if req.params.lora_name is not None and (
        engine.lora is None or not engine.lora.knows(req.params.lora_name)
    ):
        why = (
            "this engine serves no LoRA adapters (--enable-lora)"
            if engine.lora is None
            else "no such adapter"
        )
        raise ValueError(f"invalid value for 'model': LoRA adapter {req.params.lora_name!r}: {why}")
    if req.params.lora_name is not None:
        try:
            engine.lora.acquire(req.params.lora_name)
        except ValueError as e:
            raise ValueError(
                f"invalid value for 'model': LoRA adapter {req.params.lora_name!r}: {e}"
            ) from None
    if req.encode_only:
        _validate_encode_only(engine, req)
    if req.prompt_embeds is not None:
        _validate_prompt_embeds(engine, req)


def _validate_beam(engine: Engine, req: AddRequest) -> None:
    params = req.params
    limit = engine.config.scheduler.max_beam_width
    if params.beam_width > limit:
        raise ValueError(f"invalid value for 'beam_width': must be in [1, {limit}], got {params.beam_width}")
    budget = engine.config.scheduler.max_num_batched_tokens
    if params.beam_width > budget:  # all beams step together, one token each
        raise ValueError(
            f"invalid value for 'beam_width': must be <= scheduler.max_num_batched_tokens ({budget})"
        )
    max_new = params.max_tokens or engine.max_model_len - len(req.prompt_token_ids)
    if params.catalog is not None:
        catalog = engine.catalogs.get(params.catalog)
        if catalog is None:
            raise ValueError(f"invalid value for 'catalog': no catalog named {params.catalog!r}")
        max_new = catalog.item_len
    # worst case: the prompt's blocks shared, each beam with its own blocks for the output
    bs = engine.kv.block_size
    need = -(-len(req.prompt_token_ids) // bs) + params.beam_width * (-(-max_new // bs) + 1)
    if need > engine.kv.pool.num_blocks:
        raise ValueError(
            f"invalid value for 'beam_width': {params.beam_width} beams of up to {max_new} tokens may "
            f"need {need} KV blocks, the pool has {engine.kv.pool.num_blocks}; lower beam_width or max_tokens"
        )


def _validate_prompt_embeds(engine: Engine, req: AddRequest) -> None:
    embeds, what = req.prompt_embeds, "invalid value for 'prompt_embeds'"
    if not engine.config.model.enable_prompt_embeds:
        raise ValueError(
            f"{what}: this server takes no prompt embeddings; start it with --enable-prompt-embeds"
        )
    if not hasattr(engine.model, "forward_embeds") or engine.parallel is not None:
        raise ValueError(
            f"{what}: not supported for {type(engine.model).__name__} (or with parallel ranks) yet"
        )
    if embeds.hidden_size != engine.model_info.hidden_size:
        raise ValueError(
            f"{what}: the embeddings' size is {embeds.hidden_size}, the model's hidden size {engine.model_info.hidden_size}"
        )
    if (
        embeds.num_tokens != len(req.prompt_token_ids)
        or len(embeds.data) != 4 * embeds.num_tokens * embeds.hidden_size
    ):
        raise ValueError(
            f"{what}: {embeds.num_tokens} embeddings for {len(req.prompt_token_ids)} prompt positions"
        )
    if req.images or req.params.prompt_logprobs is not None:
        raise ValueError(f"{what}: cannot be combined with images or prompt_logprobs")


def _validate_encode_only(engine: Engine, req: AddRequest) -> None:
    if engine.vision is None or not req.images:
        raise ValueError("invalid value for 'encode_only': it needs a vision-language model and images")
    if not req.params.is_prefill_only or req.params.n != 1 or req.pooling is not None:
        raise ValueError("invalid value for 'encode_only': an encode-only request takes max_tokens=0, n=1")
    if engine.config.scheduler.encode_scheduling != "stage":
        raise ValueError("invalid value for 'encode_only': needs scheduler.encode_scheduling 'stage'")
