"""A parallel worker: rank 1..N-1 of one engine instance (started by ``ExpertParallelGroup``).

It builds the same model as rank 0 but holds only its own experts (and, under tensor parallelism, its
slice of every split layer), allocates a KV pool of the geometry rank 0 sends (its own KV heads), then
runs every step rank 0 publishes: the same inputs, its share of the collectives, and under tensor
parallelism its columns of the logits rank 0 samples from. It samples nothing and talks to nobody but
the group.

``python -m xengine.parallel.worker --rank R --world-size N --init-method tcp://HOST:PORT
--backend gloo --config-json JSON``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist

from graph.base import create_graph_runner
from graph.forward_context import forward_context
from memory.kv_layout import KVCacheSpec, PagedKVLayout
from ops.platforms import resolve_platform, set_platform
from xengine.api.config import EngineConfig, from_dict
from xengine.api.lifetime import set_parent_death_signal
from xengine.disagg.tp_transfer import KIND_KV_AGENT, KIND_KV_READ, RankTransfer, serve_worker_request
from xengine.models.info import read_model_info
from xengine.models.loader import load_model, resolve_dtype
from xengine.parallel.group import init_expert_parallel
from xengine.parallel.step_message import KIND_SETUP, KIND_STOP, receive
from xengine.parallel.tensor import get_tensor_parallel, kv_head_range
from xengine.runner.prompt_outputs import logit_slices

logger = logging.getLogger("xengine.parallel.worker")


@torch.inference_mode()
def run_worker(config: EngineConfig, rank: int, world_size: int, init_method: str, backend: str) -> int:
    platform = resolve_platform(config.device.device)
    set_platform(platform)
    ep = init_expert_parallel(rank, world_size, init_method, backend, config.parallel)
    info = read_model_info(config.model.model)
    dtype = resolve_dtype(platform, config.model.dtype, info.torch_dtype)
    device = platform.torch_device()
    model = load_model(config.model.model, dtype, device, config.model.quantization)
    tp = get_tensor_parallel()
    channel = tp.channel if tp is not None else None
    setup = receive(ep.control_group, device, channel)
    if setup.kind != KIND_SETUP:  # the engine failed to start after loading its model
        return 0 if setup.kind == KIND_STOP else 1
    num_blocks, block_size, max_model_len = setup.values
    model.set_max_model_len(max_model_len)
    kv_dtype = config.cache.kv_cache_dtype
    kv_heads = info.num_kv_heads if tp is None else kv_head_range(info.num_kv_heads, rank, world_size)[1]
    spec = KVCacheSpec(info.num_layers, kv_heads, info.head_dim, block_size, dtype, kv_dtype)
    layout = PagedKVLayout()
    kv_caches = layout.allocate(spec, num_blocks, device)
    caches = layout.attention_caches(kv_caches)
    caps = platform.capabilities
    execution = config.execution
    mode = caps.default_graph_mode if execution.graph_mode == "auto" else execution.graph_mode
    graph = create_graph_runner(mode, platform.name, model.forward_tokens)
    graph.bind_kv(caches, block_size, -(-max_model_len // block_size))
    graph.capture(execution.buckets(), device)
    transfer: RankTransfer | None = None
    logger.info("parallel worker rank %d/%d ready (pid %d)", rank, world_size, os.getpid())
    while True:
        msg = receive(ep.control_group, device, channel)
        if msg.kind == KIND_STOP:
            break
        if msg.kind in (KIND_KV_AGENT, KIND_KV_READ):  # PD: this rank's KV heads (tp_transfer.py)
            if transfer is None:
                first, _ = kv_head_range(info.num_kv_heads, rank, world_size) if tp is not None else (0, 0)
                ports = config.cache.transfer_ports()
                transfer = RankTransfer(kv_caches, first, kv_heads, block_size, port_range=ports)
            serve_worker_request(msg.kind, ep.control_group, transfer)
            continue
        inputs = msg.inputs
        assert inputs is not None
        ep.begin_step(msg.step_index, msg.eplb_action)
        layout.copy_blocks(kv_caches, msg.block_copies)
        with forward_context(inputs.meta, caches, inputs.num_tokens):
            hidden = graph.run(inputs.input_ids, inputs.positions)
        if tp is not None and len(inputs.logits_indices):  # this rank's vocabulary columns of the logits
            model.compute_logits(hidden[inputs.logits_indices])
        for first, n in logit_slices(inputs.prompt_spans) if tp is not None else ():  # prompt logprobs
            model.compute_logits(hidden[first : first + n])
        platform.synchronize()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xengine.parallel.worker", description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--config-json", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker[{args.rank}] %(message)s")
    set_parent_death_signal(signal.SIGKILL)  # never outlive the engine
    if args.parent_pid is not None and os.getppid() != args.parent_pid:
        return 1  # the engine died before the signal was armed
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    config = from_dict(EngineConfig, json.loads(args.config_json))
    try:
        return run_worker(config, args.rank, args.world_size, args.init_method, args.backend)
    except Exception:
        logger.exception("parallel worker rank %d failed", args.rank)
        return 1


if __name__ == "__main__":
    sys.exit(main())
