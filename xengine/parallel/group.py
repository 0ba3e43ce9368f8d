"""One engine instance as N processes: rank 0 is the engine itself, ranks 1..N-1 are workers it starts.

N is ``parallel.world_size``: the tensor-parallel ranks (``tensor.py``), which also split the experts of
an MoE model (``state.py``), or the expert-parallel ranks alone. ``ExpertParallelGroup.start`` spawns the workers (``python -m xengine.parallel.worker``), joins them in a
``torch.distributed`` group (the platform's backend for the MoE collectives; gloo for the control
broadcasts, which have no timeout because workers wait on them while the engine is idle) and then
supervises them: a worker that exits is noticed within ``POLL_S``; the engine's next step (or its idle
loop) raises ``WorkerDiedError`` and the instance goes down as a whole, so the service migrates or fails
its requests. A worker blocked in a collective with a dead peer gets a connection error at once (gloo),
and every worker dies with the engine (parent-death signal).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ops.platforms import Platform
from xengine.api.config import CacheConfig, EngineConfig, ParallelConfig
from xengine.api.envs import HOST_ID
from xengine.api.messages import MoeStatsMsg
from xengine.parallel.eplb import NONE, Eplb
from xengine.parallel.ray_ranks import RayRanks
from xengine.parallel.shm_channel import StepChannel
from xengine.parallel.shm_comm import DistCommunicator, ShmCommunicator, ShmUnavailableError
from xengine.parallel.state import ExpertParallel, set_expert_parallel
from xengine.parallel.step_message import KIND_SETUP, KIND_STOP, publish_control, publish_step
from xengine.parallel.tensor import TensorParallel, get_tensor_parallel, set_tensor_parallel
from xengine.runner.input_batch import ModelInputs

logger = logging.getLogger("xengine.parallel")

DATA_TIMEOUT = timedelta(seconds=300)  # one MoE collective: a peer that neither answers nor dies
CONTROL_TIMEOUT = timedelta(days=3650)  # workers wait for the next step as long as the engine idles
POLL_S = 0.2
STEP_CHANNEL_BYTES = 4 << 20  # a step message larger than this goes over gloo
A2A_SLOT_BYTES = 4 << 20  # one rank's share of one all-to-all round (larger exchanges take rounds)
STOP_WAIT_S = 10.0


class WorkerDiedError(RuntimeError):
    """An expert-parallel worker of this engine instance exited: the instance cannot run steps."""


def init_expert_parallel(
    rank: int, world_size: int, init_method: str, backend: str, cfg: ParallelConfig, host_id: str = ""
) -> ExpertParallel:
    """Join the group (blocks until every rank has) and make it this process's expert-parallel state
    and, with ``tensor_parallel_size > 1``, its tensor-parallel state. ``host_id``: this rank's host
    (ranks that all share one all-reduce through shared memory); default: this machine."""
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=DATA_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    hosts: list[object] = [None] * world_size
    dist.all_gather_object(hosts, host_id or this_host(), group=control)
    if cfg.tensor_parallel_size > 1:
        one_host = len(set(hosts)) == 1
        comm = _communicator(backend, rank, world_size, control, one_host)
        channel = None
        if isinstance(comm, ShmCommunicator):  # the step messages too
            channel = _or_none(lambda: StepChannel.create(control, rank, STEP_CHANNEL_BYTES, comm.is_aborted))
        set_tensor_parallel(TensorParallel(rank, world_size, comm, channel=channel))
    ep = ExpertParallel(
        rank,
        world_size,
        dist.group.WORLD,
        control,
        dual_batch_overlap=cfg.enable_dual_batch_overlap,
        num_redundant=cfg.num_redundant_experts,
        window=cfg.eplb_window if cfg.enable_eplb else 1,
    )
    if backend == "gloo" and len(set(hosts)) == 1:  # the MoE exchanges through shared memory too
        timeout = DATA_TIMEOUT.total_seconds()
        ep.a2a = _or_none(lambda: ShmCommunicator.create(control, rank, world_size, A2A_SLOT_BYTES, timeout))
    if cfg.enable_eplb:
        ep.eplb = Eplb(ep, cfg.eplb_interval)
    set_expert_parallel(ep)
    return ep


class ExpertParallelGroup:
    """Rank 0's handle on the group: publishes each step, supervises and stops the workers."""

    def __init__(self, ep: ExpertParallel, procs: list, ray: RayRanks | None = None) -> None:
        self.ep = ep
        self.ray = ray
        tp = get_tensor_parallel()
        self.tp = tp
        self.tensor_parallel_size = 1 if tp is None else tp.size
        self.procs = procs
        self.failure: str | None = None
        self._stopping = False
        self._monitor = threading.Thread(target=self._watch, name="ep-supervisor", daemon=True)
        self._monitor.start()

    @classmethod
    def start(cls, config: EngineConfig, backend: str) -> ExpertParallelGroup:
        """Start ``world_size - 1`` workers (processes here, or Ray actors) and join them as rank 0."""
        par = config.parallel
        world, threads = par.world_size, torch.get_num_threads()
        ray = (
            RayRanks(par.ray_address, world, par.placement_strategy, threads)
            if par.distributed_executor_backend == "ray"
            else None
        )
        host = "127.0.0.1" if ray is None else ray.host_ip
        init_method = f"tcp://{host}:{_free_port(host)}"
        config_json = json.dumps(dataclasses.asdict(config))
        procs: list = []
        try:
            for rank in range(1, world):
                cmd = [sys.executable, "-m", "xengine.parallel.worker", "--rank", str(rank), "--world-size"]
                cmd += [
                    str(world),
                    "--init-method",
                    init_method,
                    "--backend",
                    backend,
                    "--num-threads",
                    str(threads),
                ]
                cmd += ["--config-json", config_json]
                if ray is None:
                    procs.append(subprocess.Popen([*cmd, "--parent-pid", str(os.getpid())]))
                else:
                    procs.append(ray.start(rank, cmd, dict(os.environ, PYTHONPATH=_root_path())))
            logger.info("parallel: started %d worker(s) (pids %s)", len(procs), [p.pid for p in procs])
            host_id = "" if ray is None else ray.host_id
            ep = init_expert_parallel(0, world, init_method, backend, par, host_id)
        except BaseException:
            for p in procs:
                p.kill()
            if ray is not None:
                ray.close()
            raise
        return cls(ep, procs, ray)

    def check_model_and_cache(self, cache: CacheConfig) -> CacheConfig:
        """After the model is built: expert parallelism alone needs MoE layers; the KV layout is paged
        on every rank."""
        if not self.ep.layers and self.tensor_parallel_size == 1:
            raise ValueError(
                "expert_parallel_size > 1 needs a mixture-of-experts model (e.g. Qwen3MoeForCausalLM, "
                "DeepseekV3ForCausalLM); this one has no expert layers"
            )
        return dataclasses.replace(cache, kv_layout="paged")

    def stats(self) -> MoeStatsMsg:
        ep, eplb = self.ep, self.ep.eplb
        return MoeStatsMsg(
            expert_parallel_size=ep.world_size,
            tensor_parallel_size=self.tensor_parallel_size,
            num_all_reduces=self.tp.num_all_reduces if self.tp is not None else 0,
            all_reduce=_comm_name(self.tp.comm) if self.tp is not None else "",
            dual_batch_overlap=ep.dual_batch_overlap,
            num_moe_layers=len(ep.layers),
            num_steps=ep.comm.num_steps,
            comm_exposed_s=ep.comm.exposed_s,
            comm_bytes_sent=ep.comm.bytes_sent,
            eplb=eplb is not None,
            num_redundant_experts=ep.num_redundant,
            balancedness=list(eplb.balancedness) if eplb else [],
            balancedness_before=list(eplb.balancedness_before) if eplb else [],
            num_swaps=eplb.num_swaps if eplb else 0,
            last_swap_s=eplb.last_swap_s if eplb else 0.0,
            last_load_s=eplb.last_load_s if eplb else 0.0,
        )

    def setup(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        """Tell the workers the KV pool's geometry (rank 0 sized it) so every rank holds the same KV."""
        publish_control(
            self.ep.control_group, KIND_SETUP, (num_blocks, block_size, max_model_len), self._channel
        )

    def publish(self, inputs: ModelInputs, block_copies: list[tuple[int, int]]) -> None:
        """Before rank 0's forward: send the step to the workers, then begin it here as they do."""
        self.check()
        step = self.ep.step_index + 1
        action = self.ep.eplb.action_for(step) if self.ep.eplb is not None else NONE
        publish_step(self.ep.control_group, inputs, block_copies, step, action, self._channel)
        self.ep.begin_step(step, action)

    num_forwards = 0  # data-parallel ranks count their forwards (``data_parallel.py``)
    own_pools = False  # every rank builds its own KV and state pools (data-parallel ranks), or rank 0's
    # geometry is sent to workers that hold one paged pool

    def after_step(self, forwards_before: int, busy: bool) -> None:
        """After an engine step (data-parallel ranks: a round when it ran no forward)."""

    def idle(self) -> None:
        """An engine loop iteration without a step (data-parallel ranks: a round)."""

    def may_exit(self) -> bool:
        """Whether a drained engine may exit now (data-parallel ranks: once all may)."""
        return True

    def check(self) -> None:
        if self.scan() is not None:
            raise WorkerDiedError(self.failure)

    def scan(self, wait_s: float = 0.0) -> str | None:
        """Why the group is down (a worker exited), looking for up to ``wait_s``; None while all run."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and not self._stopping:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and self.failure is None:
                    self.failure = (
                        f"{self._kind} worker rank {rank} (pid {proc.pid}) exited with code {code}; "
                        "this engine instance is down"
                    )
                    logger.error("%s", self.failure)
                    if self.tp is not None:  # ranks waiting in a shared-memory collective give up now
                        self.tp.comm.abort(self.failure)
                    if self.ep.a2a is not None:
                        self.ep.a2a.abort(self.failure)
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        return self.failure

    @property
    def _channel(self) -> StepChannel | None:
        return self.tp.channel if self.tp is not None else None

    @property
    def _kind(self) -> str:
        return "tensor-parallel" if self.tensor_parallel_size > 1 else "expert-parallel"

    def _watch(self) -> None:
        while not self._stopping and self.scan() is None:
            time.sleep(POLL_S)

    def shutdown(self) -> None:
        """Stop the workers (a stop message, then a kill for any that does not exit) and leave the group."""
        if self._stopping:
            return
        self._stopping = True
        if self.failure is None:
            try:
                publish_control(self.ep.control_group, KIND_STOP, channel=self._channel)
            except Exception as e:  # noqa: BLE001 - a worker already gone: kill the rest below
                logger.warning("expert parallel: stop message failed: %s", e)
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.ray is not None:
            self.ray.close()
        set_expert_parallel(None)
        if self.ep.a2a is not None:
            self.ep.a2a.close()
        if self.tp is not None:
            self.tp.comm.close()
            if self.tp.channel is not None:
                self.tp.channel.close()
            set_tensor_parallel(None)
        if dist.is_initialized():
            dist.destroy_process_group()


def start_expert_parallel(config: EngineConfig, platform: Platform) -> ExpertParallelGroup | None:
    """The instance's worker group when ``parallel.world_size > 1``, else None."""
    if config.parallel.world_size == 1:
        return None
    if config.cache.kv_layout == "xtensor":
        raise ValueError(
            "cache.kv_layout 'xtensor' is not supported with expert or tensor parallelism yet (the workers' "
            "KV pools are paged); use --kv-layout paged"
        )
    spec = config.speculative_config
    if config.parallel.tensor_parallel_size > 1 and spec.enabled and spec.method != "ngram":
        raise ValueError(
            f"speculative_config.method {spec.method} is not supported with tensor_parallel_size > 1 yet "
            "(its draft head runs on one rank); use method ngram or tensor_parallel_size 1"
        )
    return ExpertParallelGroup.start(config, platform.capabilities.dist_backend)


def _communicator(backend: str, rank: int, world_size: int, control: object, one_host: bool) -> object:
    """Shared memory between ranks of one host on CPU (gloo); the platform's collectives (or gloo
    between hosts) else."""
    if backend == "gloo" and one_host:
        timeout = DATA_TIMEOUT.total_seconds()
        comm = _or_none(lambda: ShmCommunicator.create(control, rank, world_size, timeout_s=timeout))
        if comm is not None:
            return comm
    return DistCommunicator(dist.group.WORLD, world_size)


def _or_none(create: Callable[[], Any]) -> Any:
    """A shared-memory segment's user, or None (with a warning) when ``/dev/shm`` cannot hold it: the
    caller then uses gloo, as between hosts (slower, never wrong)."""
    try:
        return create()
    except ShmUnavailableError as e:
        logger.warning(
            "parallel: %s; using torch.distributed instead (enlarge /dev/shm, e.g. docker --shm-size)", e
        )
        return None


def _comm_name(comm: object) -> str:
    return "shared_memory" if isinstance(comm, ShmCommunicator) else "torch.distributed"


def this_host() -> str:
    """This machine's identity for choosing the all-reduce (``envs.HOST_ID`` where a launcher set it)."""
    if HOST_ID.get():
        return HOST_ID.get()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{socket.gethostname()}:{f.read().strip()}"
    except OSError:
        return socket.gethostname()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _root_path() -> str:
    """The folder holding the ``xengine`` package (a Ray actor's worker imports it from there)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    extra = os.environ.get("PYTHONPATH", "")
    return here + (os.pathsep + extra if extra else "")
