"""Typed messages between the service and an engine process (msgspec structs over ZMQ).

This module is torch-free: the service imports it. Never pickle across the socket; every
frame is one msgpack-encoded ``EngineInput`` (service → engine) or ``EngineOutput``
(engine → service) tagged union member.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from xengine.api.embed_messages import (  # noqa: F401 - EPD embedding transfer, re-exported
    EmbedExport,
    EmbedExportInfo,
    EmbedImport,
    EmbedImportResult,
    EmbedRelease,
)
from xengine.api.kv_tiers_messages import KVTiersStatsMsg, KVTierStatsMsg  # noqa: F401 - re-exported
from xengine.api.lora_messages import LoadLoRA, LoRAStatsMsg, UnloadLoRA  # noqa: F401 - re-exported
from xengine.api.multimodal import ImageInput
from xengine.api.prompt_embeds import PromptEmbeds
from xengine.api.sampling_params import (  # noqa: F401 - re-exported: the messages' field types
    MAX_BEAM_WIDTH,
    MAX_CATALOG_NAME_LEN,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    PoolingParams,
    SamplingParams,
    StructuredOutputsParams,
)

Priority = Literal["online", "offline"]
FinishReason = Literal["stop", "length", "abort", "error", "encoded"]


# ---------------------------------------------------------------- service -> engine


class RequestSLO(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A request's own latency objectives (ms; None: the service's default). The service routes by them
    (dynamic PD) and counts whether they were met; the engine does not use them."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


class AddRequest(msgspec.Struct, tag="add", kw_only=True):
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: Priority = "online"
    arrival_time: float = 0.0
    pooling: PoolingParams | None = None  # set: an embedding request (``params.max_tokens`` must be 0)
    slo: RequestSLO | None = None  # service-side objectives (``xservice/serving/slo.py``)
    # preprocessed images whose pad tokens the prompt holds (``xengine/api/multimodal.py``)
    images: list[ImageInput] | None = None
    # EPD's encode stage on its own: encode ``images`` into the instance's image-embedding cache and
    # finish with finish_reason "encoded" and no tokens (``params.max_tokens`` must be 0)
    encode_only: bool = False
    prompt_embeds: PromptEmbeds | None = None  # vLLM's: the prompt as embeddings (ids are placeholders)


class AbortRequests(msgspec.Struct, tag="abort"):
    req_ids: list[str]


class UtilityCall(msgspec.Struct, tag="call"):
    """``method``: "stats" | "ping" | "reset_prefix_cache" | "list_catalogs" | "list_requests"."""

    call_id: int
    method: str


class RegisterCatalog(msgspec.Struct, tag="register_catalog", kw_only=True):
    """Register (or replace) an item catalog for constrained beam search; answered by a
    ``UtilityResult`` carrying its ``CatalogInfo`` (or ``ok=False`` and the error)."""

    call_id: int
    name: str
    items: list[list[int]]  # each item a fixed-length tuple of token ids


class Shutdown(msgspec.Struct, tag="shutdown"):
    drain_timeout_s: float = 10.0


# EngineInput (the union of every service -> engine message) is defined after the PD messages below.


# ---------------------------------------------------------------- engine -> service


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class PromptLogprobs(msgspec.Struct, kw_only=True):
    """Logprobs of the prompt tokens at positions ``start .. start + len(logprobs) - 1`` (``start`` >= 1:
    the first prompt token has none), each given the tokens before it."""

    start: int
    logprobs: list[float]  # of the prompt token at each position
    ranks: list[int]  # its rank in the vocabulary (1: the most likely token)
    top: list[list[TokenLogprob]]  # the top ``prompt_logprobs`` tokens there, most likely first


class CompletionDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New tokens of one sequence (``index`` < n) of one request since the last delta."""

    req_id: str
    index: int = 0
    new_token_ids: list[int] = []
    # per new token: the chosen token's logprob, and the top alternatives (when requested)
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[TokenLogprob]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # beam search: sent once per returned sequence, with all its tokens
    score: float | None = None  # length-penalised score (the ranking key)
    cumulative_logprob: float | None = None
    # prompt logprobs computed since the last delta (sequence 0 only; positions in order, no repeats)
    prompt_logprobs: PromptLogprobs | None = None
    embedding: list[float] | None = None  # pooling requests: the pooled vector, on the final delta
    # seconds from the engine receiving the request to its first scheduling (once, on a later delta)
    queue_time_s: float | None = None


class SpecDecodeStatsMsg(msgspec.Struct, kw_only=True):
    """Speculative decoding since start (``xengine/spec/stats.py``): sequence-steps that drafted, draft
    tokens proposed and accepted, and acceptances per draft position."""

    method: str = ""
    num_speculative_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0  # tokens emitted per drafting sequence-step (accepted + 1)


class EngineStats(msgspec.Struct, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of those, found in the cache
    num_preemptions: int = 0
    num_steps: int = 0
    num_computed_prompt_tokens: int = 0
    # PD disaggregation (decode side): KV blocks pulled from prefill instances, and their bytes
    num_kv_blocks_imported: int = 0
    num_kv_bytes_imported: int = 0
    num_auth_denied: int = 0  # cluster mode: peers refused for lacking the cluster key
    num_kv_peers_refused: int = 0  # PD: KV-transfer connections from other local users, closed unserved
    # KV memory layout; with xTensor, its pages by state (xLLM §4.3) and map/unmap calls so far
    kv_layout: str = "paged"
    xtensor: XTensorStatsMsg | None = None
    # sliding-window layers in a pool of their own (hybrid_kv): that pool; the fields above are then
    # the full-attention pool's
    window_pool: WindowPoolStatsMsg | None = None
    # recurrent layers (Mamba2, gated DeltaNet): their state slots and snapshots
    state_pool: StatePoolStatsMsg | None = None
    # execution: async scheduling on/off, and the graph runner's mode and counters
    async_scheduling: bool = False
    graph: GraphStatsMsg | None = None
    moe: MoeStatsMsg | None = None  # expert-parallel instances only
    colocation: ColocationStatsMsg | None = None
    # vision-language models: images run through the vision encoder, and images whose embeddings came
    # from the instance's image-embedding cache (by content hash) instead
    num_image_encodes: int = 0
    num_image_cache_hits: int = 0
    num_image_tokens_encoded: int = 0  # the encoded images' tokens (their image pads)
    num_encode_steps: int = 0  # steps that carried image encodes (``scheduler.encode_scheduling: stage``)
    spec_decode: SpecDecodeStatsMsg | None = None  # speculative decoding, when it is on
    kv_tiers: KVTiersStatsMsg | None = None  # KV tiers behind the prefix cache, when configured
    lora: LoRAStatsMsg | None = None  # LoRA adapters, when served


class ColocationStatsMsg(msgspec.Struct, kw_only=True):
    """Online/offline co-location in the engine (``xengine/colocation/interrupter.py``)."""

    offline_preemption: str = "layer"  # layer | step
    num_interrupted_steps: int = 0  # offline steps stopped between layers for an online arrival
    num_interrupted_tokens: int = 0  # tokens of those not resumed: computed again later
    num_paused_steps: int = 0  # of those, kept and carried on from where they stopped
    # online requests that arrived while an offline prefill step ran: arrival -> their first step
    num_latencies: int = 0
    preemption_latency_p50_ms: float = 0.0
    preemption_latency_p99_ms: float = 0.0
    preemption_latency_max_ms: float = 0.0


class GraphStatsMsg(msgspec.Struct, kw_only=True):
    mode: str = "eager"
    buckets: list[int] = []  # token-count buckets captured
    capture_s: dict[int, float] = {}  # bucket -> seconds it took to compile / capture
    num_compiles: int = 0
    num_recompiles_after_warmup: int = 0  # should stay 0
    num_replays: int = 0  # steps run through a graph
    num_eager_steps: int = 0  # steps run eagerly (larger than every bucket)
    decode_graph_buckets: list[int] = []  # full mode: decode batch sizes captured as whole-step graphs
    decode_graph_capture_s: dict[int, float] = {}
    num_decode_graph_replays: int = 0  # decode steps run as one whole-step graph


class WindowPoolStatsMsg(msgspec.Struct, kw_only=True):
    """The sliding-window layers' own KV pool (``cache.hybrid_kv``; ``memory/sliding_window.py``)."""

    window: int = 0  # tokens (the largest of the sliding layers')
    num_layers: int = 0
    num_total_blocks: int = 0  # usable ones (the null block not counted)
    num_free_blocks: int = 0
    num_cached_windows: int = 0  # released blocks still findable by a window-safe prefix hit
    usage: float = 0.0


class StatePoolStatsMsg(msgspec.Struct, kw_only=True):
    """The recurrent layers' state pool (``memory/recurrent_state.py``)."""

    num_layers: int = 0
    bytes_per_slot: int = 0  # one sequence's state over every recurrent layer
    num_seq_slots: int = 0
    num_free_seq_slots: int = 0
    num_snapshot_slots: int = 0
    num_snapshots: int = 0  # snapshots keyed by a cached block (usable by a prefix hit)
    num_snapshots_taken: int = 0
    num_snapshot_hits: int = 0
    usage: float = 0.0  # of the sequence slots


class XTensorStatsMsg(msgspec.Struct, kw_only=True):
    num_pages: int = 0
    num_free: int = 0
    num_allocated: int = 0
    num_mapped: int = 0
    num_reusable: int = 0
    num_maps: int = 0  # page mappings made (a page: one block of every layer's K and V)
    num_unmaps: int = 0
    num_live_mappings: int = 0
    num_slots: int = 0
    map_seconds: float = 0.0


class MoeStatsMsg(msgspec.Struct, kw_only=True):
    """Expert / tensor parallelism of an instance: communication rank 0 waited on, and EPLB's balance."""

    expert_parallel_size: int = 1
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    num_idle_exchanges: int = 0  # data parallel: forwards of other ranks this rank served idle
    num_all_reduces: int = 0  # tensor parallel: rank 0's all-reduces so far
    all_reduce: str = ""  # tensor parallel: "shared_memory" (one host) or "torch.distributed"
    dual_batch_overlap: bool = False
    num_moe_layers: int = 0
    num_steps: int = 0
    comm_exposed_s: float = 0.0  # rank 0, summed: time blocked on all-to-all / all-gather
    comm_bytes_sent: int = 0
    eplb: bool = False
    num_redundant_experts: int = 0
    balancedness: list[float] = []  # per MoE layer: mean / max tokens per rank over the window
    balancedness_before: list[float] = []  # at the last rebalancing decision
    num_swaps: int = 0
    last_swap_s: float = 0.0
    last_load_s: float = 0.0


class EngineInfo(msgspec.Struct, kw_only=True):
    """Sent once by the engine process when it is ready to serve."""

    model_name: str
    vocab_size: int
    max_model_len: int
    block_size: int
    eos_token_ids: list[int]
    num_total_blocks: int
    device: str
    pid: int
    hidden_size: int = 0  # width of the final hidden states (embeddings); 0: unknown
    # for the service's roofline performance model (co-location); 0: unknown
    num_params: int = 0
    kv_bytes_per_token: int = 0  # K and V of every layer
    weight_bytes: int = 0
    num_threads: int = 0  # CPU intra-op threads
    kv_tiers: list[str] = []  # KV tiers behind the prefix cache: host, disk, store (``docs/kv_tiers.md``)
    lora: bool = False  # serves LoRA adapters (``lora.enable_lora``)
    lora_adapters: dict[str, str] = {}  # the adapters registered at start: name -> folder


class CatalogInfo(msgspec.Struct, kw_only=True):
    name: str
    num_items: int
    item_len: int
    num_nodes: int = 0  # trie nodes, a memory measure


class StepOutputs(msgspec.Struct, tag="outputs"):
    deltas: list[CompletionDelta]


class UtilityResult(msgspec.Struct, tag="result", kw_only=True):
    call_id: int
    stats: EngineStats | None = None
    catalogs: list[CatalogInfo] | None = None
    kv_export: KVExportInfo | None = None
    kv_import: KVImportResult | None = None
    embed_export: EmbedExportInfo | None = None  # EPD: image embeddings pinned for a peer
    embed_import: EmbedImportResult | None = None
    req_ids: list[str] | None = None  # "list_requests": the requests the engine still runs
    ok: bool = True
    error: str | None = None


class Ready(msgspec.Struct, tag="ready"):
    info: EngineInfo


class EngineDead(msgspec.Struct, tag="dead"):
    message: str


EngineOutput = Union[StepOutputs, UtilityResult, Ready, EngineDead]


# ---------------------------------------------------------------- PD disaggregation (KV transfer)


class KVRankRegionMsg(msgspec.Struct, kw_only=True):
    """One tensor-parallel rank's registered KV memory and the KV heads it holds (an export's or an
    import's share; ``xengine/disagg/tp_transfer.py``)."""

    session: str
    layer_addrs: list[int]
    num_blocks: int
    block_bytes: int
    first_head: int
    num_heads: int


class KVExportInfo(msgspec.Struct, kw_only=True):
    """A prefill instance's pinned prompt blocks and where a peer reads them (Mooncake session)."""

    session: str  # "host:rpc_port" of the exporter's transfer engine
    layer_addrs: list[int]  # base address of each layer's registered KV tensor
    num_blocks: int  # blocks per layer tensor (the exporter's pool size)
    block_bytes: int  # bytes of one block of K (or V) in one layer
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_ids: list[int]  # the exporter's blocks holding the prompt's leading whole blocks
    # hybrid models (``xengine/disagg/hybrid_transfer.py``): the window pages and the recurrent state
    # a query after those blocks needs; the blocks are then as many as every layer kind can resume from
    window: WindowExportMsg | None = None
    state: StateExportMsg | None = None
    # speculative decoding with a draft head (``xengine/disagg/head_transfer.py``): its KV of the prompt
    head: HeadExportMsg | None = None
    # a tensor-parallel exporter: every rank's memory and heads (``num_kv_heads`` is then the model's;
    # the fields above describe rank 0's)
    ranks: list[KVRankRegionMsg] | None = None


class WindowExportMsg(msgspec.Struct, kw_only=True):
    """The sliding-window pool's blocks of an export: those a query after the exported prefix reads."""

    layer_addrs: list[int]  # each window layer's registered tensor
    num_blocks: int  # blocks per window layer tensor (the exporter's window pool)
    block_bytes: int
    window: int
    first: int  # block index of ``block_ids[0]`` in the prompt
    block_ids: list[int]


class StateExportMsg(msgspec.Struct, kw_only=True):
    """The recurrent state snapshot at the exported prefix's end (copied whole)."""

    tensor_addrs: list[int]  # each registered state tensor (``[num_slots, ...]``)
    slot_bytes: list[int]  # bytes of one slot of each
    slot: int


class HeadExportMsg(msgspec.Struct, kw_only=True):
    """A draft head's blocks of the exported prompt (the pairs of hidden state and next token it read
    while the prompt was prefilled), as many as the full-attention blocks exported."""

    head_id: str  # which head computed them: an importer with another head ignores them
    layer_addrs: list[int]
    num_blocks: int
    block_bytes: int
    block_ids: list[int]


class KVImportResult(msgspec.Struct, kw_only=True):
    num_blocks: int  # leading whole prompt blocks now pinned on the importer
    num_hit_blocks: int  # of those, already in its prefix cache (not transferred)
    num_transferred_blocks: int
    num_bytes: int  # everything moved: full-attention blocks, window blocks and state
    transfer_s: float
    num_window_blocks: int = 0  # sliding-window blocks transferred (hybrid models)
    num_window_bytes: int = 0
    num_state_bytes: int = 0  # recurrent state snapshot bytes transferred
    num_head_blocks: int = 0  # a draft head's prompt blocks transferred (speculative decoding)
    num_head_bytes: int = 0


class KVExport(msgspec.Struct, tag="kv_export", kw_only=True):
    """Pin the cached whole blocks of ``token_ids`` under ``export_id``; answered with ``KVExportInfo``."""

    call_id: int
    export_id: str
    token_ids: list[int]
    next_token_id: int | None = None  # the token the prefill sampled (keys a draft head's last block)


class KVImport(msgspec.Struct, tag="kv_import", kw_only=True):
    """Pull the prompt blocks this instance lacks from ``source`` into its prefix cache and pin them
    under ``pin_id`` until the request ``pin_id`` is admitted; answered with ``KVImportResult``."""

    call_id: int
    source: KVExportInfo
    token_ids: list[int]
    pin_id: str
    next_token_id: int | None = None  # as in ``KVExport``


class KVRelease(msgspec.Struct, tag="kv_release", kw_only=True):
    """Drop the pin ``export_id`` (an export or an import pin); unknown ids are ignored."""

    call_id: int
    export_id: str


EngineInput = Union[
    AddRequest,
    AbortRequests,
    UtilityCall,
    RegisterCatalog,
    LoadLoRA,
    UnloadLoRA,
    Shutdown,
    KVExport,
    KVImport,
    KVRelease,
    EmbedExport,
    EmbedImport,
    EmbedRelease,
]


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def make_input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineInput)


def make_output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineOutput)


# ---------------------------------------------------------------- service identity (cluster mode)


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    """First frame a service sends a standalone engine (``engine_server``) it connects to. An engine
    serves one service at a time: a hello from a new ``service_id`` (the previous service died or
    was replaced) aborts every request of other services, whose outputs are then dropped."""

    service_id: str


EngineInput = Union[EngineInput, Hello]  # type: ignore[misc]  # Union flattens: Hello joins the inputs
