"""An engine process that binds its own sockets and registers in the metadata store.

``python -m xengine.engine_server --config-json JSON --name N --role mixed --store URL``

Used by the cluster launchers (local subprocess or Ray actor) and by ``xllm engine`` (a standalone
instance that outlives any service). Unlike ``engine_proc`` (which connects to sockets its one
service bound), this process binds a PULL socket (inputs) and a PUSH socket (outputs) on ``--host``
(free ports, or ``--port`` and ``--port + 1``), and advertises them, its role, its engine info and
a fresh incarnation id in the store through a ``ClusterAgent``; services discover it there and
connect. The I/O loop is ``engine_proc.EngineProc``'s; frames to a service that went away are
dropped instead of blocking the engine.

One service at a time: a service's first frame is ``Hello(service_id)``. A hello from another
service id than the current one (the previous service died and a new one took over) aborts every
request the engine still runs for other services and drops their remaining outputs, so a
restarted service neither waits on nor sees its predecessor's requests.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback
import uuid
from functools import partial
from typing import Any

import msgspec
import zmq

from xengine.api.cluster.keys import ROLES, TRANSFER_ROLES, InstanceRecord
from xengine.api.config import EngineConfig, from_dict
from xengine.api.embed_messages import EMBED_CALLS
from xengine.api.messages import AddRequest, CompletionDelta, EngineOutput, EngineStats, Hello, StepOutputs
from xengine.api.security import ENV_KEY, ClusterKey, ZapGuard, read_key_file, secure_server, take_env_key
from xengine.cluster_agent import ClusterAgent
from xengine.engine_proc import SEND_LINGER_MS, EngineProc, apply_num_threads, set_parent_death_signal
from xengine.image_publisher import ImageHashTracker, ImagePublishingAgent

logger = logging.getLogger("xengine.engine_server")
# a service's first call can arrive before its output connection completes (CURVE handshake)
REPLY_WAIT_MS = 2000


class _ObservedEngine:
    """Wraps the engine to time first tokens and output tokens for the agent's load report, to hand
    it the raw prefill and step samples of the service's performance models, and to report refused
    handshakes in its stats.

    A prefill sample is taken at a request's first token: its uncached prompt tokens, its queue time
    (the engine's ``queue_time_s``, which comes on its first delta) and the rest of its time to
    first token as compute. Requests whose first token comes without a queue time (beam search
    sends none) give no prefill sample."""

    def __init__(self, engine: Any, agent: ClusterAgent, guard: ZapGuard | None = None) -> None:
        self._engine = engine
        self._agent = agent
        self._guard = guard
        self._started: dict[str, float] = {}
        self._first: dict[str, tuple[float, int]] = {}  # req_id -> (first token time, tokens since)
        self._queue_s: dict[str, float] = {}  # req_id -> queue time, until its first token

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def add_request(self, req: AddRequest) -> None:
        received = time.monotonic()  # not after: the engine's queue time starts inside add_request
        self._engine.add_request(req)
        self._started[req.req_id] = received

    def get_stats(self) -> EngineStats:
        stats = self._engine.get_stats()
        if self._guard is not None:
            stats.num_auth_denied = self._guard.num_denied
        return stats

    def step(self) -> list[CompletionDelta]:
        deltas = self._engine.step()
        now = time.monotonic()
        self._observe_steps()
        for d in deltas:
            if d.queue_time_s is not None and d.req_id in self._started:
                self._queue_s[d.req_id] = d.queue_time_s
        for d in deltas:
            if d.req_id in self._started and d.new_token_ids:
                ttft_s = now - self._started.pop(d.req_id)
                self._agent.observe_ttft(ttft_s * 1000)
                queue_s = self._queue_s.pop(d.req_id, None)
                if queue_s is not None:
                    uncached = d.num_prompt_tokens - d.num_cached_tokens
                    self._agent.observe_prefill(uncached, queue_s, max(0.0, ttft_s - queue_s))
                self._first[d.req_id] = (now, len(d.new_token_ids) - 1)
            elif d.req_id in self._first:
                t0, n = self._first[d.req_id]
                self._first[d.req_id] = (t0, n + len(d.new_token_ids))
            if d.finish_reason is not None:
                self._started.pop(d.req_id, None)
                self._queue_s.pop(d.req_id, None)
                t0, n = self._first.pop(d.req_id, (now, 0))
                if n > 0:
                    self._agent.observe_tpot((now - t0) * 1000 / n)
        return deltas

    def _observe_steps(self) -> None:
        timing = self._engine.last_step_timing
        for s in timing.completed if timing is not None else ():
            self._agent.observe_step(s.num_seqs, s.context_tokens, s.prefill_tokens, s.step_s)


class ServedEngineProc(EngineProc):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.service_id: str | None = None  # the service of the last Hello (None: none said hello)
        self._owner: dict[str, str | None] = {}  # req_id -> service id that added it (while unfinished)
        self._orphans: set[str] = set()  # aborted requests of a previous service: outputs dropped
        self.num_orphans_aborted = 0
        self.embeds: Any = None  # EPD: an EmbedTransferManager (image embeddings to / from peers)
        self.images: ImageHashTracker | None = None  # EPD: the image cache's hashes, for the store

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, Hello):
            self._hello(msg.service_id)
        elif isinstance(msg, EMBED_CALLS):
            from xengine.embed_transfer import embed_call

            self.send(embed_call(self.embeds, msg, self.images.saw if self.images is not None else None))
        else:
            super()._handle(msg)

    def _hello(self, service_id: str) -> None:
        if service_id == self.service_id:
            return
        orphans = [r for r in self._num_unfinished if self._owner.get(r) != service_id]
        logger.info(
            "service %s connected (previous: %s); aborting %d request(s) of previous services",
            service_id, self.service_id, len(orphans),
        )  # fmt: skip
        self.service_id = service_id
        if orphans:
            self._engine.abort_requests(orphans)
            self._orphans.update(orphans)
            self.num_orphans_aborted += len(orphans)
            self._need_step = True

    def _add(self, req: AddRequest) -> None:
        super()._add(req)
        if req.req_id in self._num_unfinished:
            self._owner[req.req_id] = self.service_id
            if req.images and self.images is not None:
                self.images.saw(im.content_hash for im in req.images)

    def send(self, msg: EngineOutput) -> None:
        if isinstance(msg, StepOutputs) and self._owner:
            deltas = msg.deltas
            if self._orphans:
                deltas = [d for d in deltas if d.req_id not in self._orphans]
                self._orphans.intersection_update(self._num_unfinished)
            for d in msg.deltas:
                if d.finish_reason is not None and d.req_id not in self._num_unfinished:
                    self._owner.pop(d.req_id, None)
            if not deltas:
                return
            msg = StepOutputs(deltas) if deltas is not msg.deltas else msg
        # step outputs of a service that went away are dropped at once; a reply (to a call that a
        # service just sent) waits a moment for that service's output connection to come up
        wait_ms = 0 if isinstance(msg, StepOutputs) else REPLY_WAIT_MS
        if not send_or_drop(self._out, self._encoder.encode(msg), wait_ms):
            logger.warning("no service connected: dropped a %s frame", type(msg).__name__)


def send_or_drop(sock: zmq.Socket, frame: bytes, wait_ms: int) -> bool:
    """Send ``frame`` without blocking the engine; with no peer connected, wait up to ``wait_ms``
    for one. False: nobody connected in time, the frame is dropped."""
    try:
        sock.send(frame, zmq.NOBLOCK)
        return True
    except zmq.Again:
        if wait_ms <= 0 or not sock.poll(wait_ms, zmq.POLLOUT):
            return False
    try:
        sock.send(frame, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def bind_sockets(
    ctx: zmq.Context, host: str, port: int = 0, key: ClusterKey | None = None
) -> tuple[zmq.Socket, zmq.Socket, str, str]:
    """Input (PULL) on ``port``, output (PUSH) on ``port + 1``; free ports when ``port`` is 0.

    With ``key`` both are CURVE servers that admit only clients holding the cluster key (the caller runs
    the context's ``ZapGuard``)."""
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.RCVHWM, 0)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.setsockopt(zmq.LINGER, SEND_LINGER_MS)
    for sock in (inp, out):
        if key is not None:
            secure_server(sock, key)
    inp.bind(f"tcp://{host}:{port}")
    out.bind(f"tcp://{host}:{port + 1 if port else 0}")
    addrs = [s.getsockopt(zmq.LAST_ENDPOINT).decode() for s in (inp, out)]
    return inp, out, addrs[0], addrs[1]


def resolve_key(args: argparse.Namespace) -> ClusterKey | None:
    """The cluster key from ``XLLM_CLUSTER_KEY`` or ``--auth-key-file`` (None with ``--no-auth``)."""
    env_key = take_env_key()
    if args.no_auth:
        return None
    if env_key is not None:
        return env_key
    if args.auth_key_file:
        return read_key_file(args.auth_key_file)
    raise ValueError(
        f"no cluster key: set {ENV_KEY}, pass --auth-key-file FILE, or --no-auth on an isolated network"
    )


def serve(config: EngineConfig, args: argparse.Namespace) -> int:
    from xengine.engine import Engine

    try:
        key = resolve_key(args)
    except ValueError as e:
        print(f"xllm: error: {e}", file=sys.stderr)
        return 2
    ctx = zmq.Context()
    guard = ZapGuard(ctx, key) if key is not None else None
    try:
        inp, out, input_addr, output_addr = bind_sockets(ctx, args.host, args.port, key)
    except zmq.ZMQError as e:
        if guard is not None:
            guard.stop()
        ctx.term()
        print(
            f"xllm: error: cannot bind {args.host}:{args.port or 'free ports'} ({e}); pass another --port",
            file=sys.stderr,
        )
        return 2
    if key is None:
        logger.warning(
            "engine plane authentication is OFF (--no-auth): any peer reaching %s can drive it", args.host
        )
    agent = None
    try:
        apply_num_threads(config)
        engine = Engine(config)
        if args.role in TRANSFER_ROLES:  # register the KV memory with Mooncake up front
            engine.kv_transfer.host = args.host
            engine.kv_transfer.start()
        image_cache = getattr(getattr(engine, "runner", None), "images", None)
        tracker = ImageHashTracker(image_cache) if image_cache is not None else None
        record = InstanceRecord(
            name=args.name,
            role=args.role,
            incarnation=uuid.uuid4().hex,
            input_addr=input_addr,
            output_addr=output_addr,
            pid=os.getpid(),
            info=msgspec.to_builtins(engine.info),
            started_at=time.time(),
        )
        # a vision-language model also publishes its image cache's hashes (EPD routing)
        make_agent = partial(ImagePublishingAgent, tracker=tracker) if tracker is not None else ClusterAgent
        agent = make_agent(
            args.store,
            args.key_prefix,
            record,
            engine.get_stats,
            args.lease_ttl_s,
            args.heartbeat_interval_s,
            key,
            replaces=args.replaces,
        )
        prefix_cache = getattr(getattr(engine, "kv", None), "prefix_cache", None)
        if prefix_cache is not None and hasattr(prefix_cache, "event_sink"):
            prefix_cache.event_sink = agent.on_kv_events
        proc = ServedEngineProc(_ObservedEngine(engine, agent, guard), inp, out, args.parent_pid)
        proc.images = tracker
        if image_cache is not None and args.role in TRANSFER_ROLES:
            from xengine.embed_transfer import EmbedTransferManager

            proc.embeds = EmbedTransferManager(image_cache, engine.kv_transfer.start)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: proc.begin_shutdown())
        agent.start()
        logger.info("engine %s (%s) serving at %s / %s", args.name, args.role, input_addr, output_addr)
        return proc.run()
    except Exception:  # noqa: BLE001
        logger.error("engine server failed:\n%s", traceback.format_exc())
        return 1
    finally:
        if agent is not None:
            agent.stop()
        inp.close(linger=0)
        out.close()
        if guard is not None:
            guard.stop()
        ctx.term()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m xengine.engine_server", description=__doc__.split("\n")[0])
    p.add_argument("--config-json", required=True, help="EngineConfig as JSON (dataclasses.asdict).")
    p.add_argument("--name", required=True, help="Instance name (unique in the cluster).")
    p.add_argument("--role", default="mixed", choices=ROLES, help="Instance role.")
    p.add_argument("--store", required=True, help="etcd://HOST:PORT or embedded+tcp://HOST:PORT")
    p.add_argument("--key-prefix", default="/xllm", help="Key prefix in the metadata store.")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind the ZMQ sockets to.")
    p.add_argument("--port", type=int, default=0, help="Input port (output: port + 1); 0: free ports.")
    p.add_argument("--lease-ttl-s", type=float, default=3.0, help="Registration lease TTL.")
    p.add_argument("--heartbeat-interval-s", type=float, default=0.5, help="Heartbeat period.")
    p.add_argument(
        "--replaces",
        default=None,
        help="Incarnation id of this name's exited process (a supervisor's relaunch): take the name over "
        "at once instead of waiting for its lease to expire.",
    )
    p.add_argument(
        "--auth-key-file",
        default=None,
        help=f"Cluster key file (mode 0600) authenticating the service (default: ${ENV_KEY}).",
    )
    p.add_argument(
        "--no-auth", action="store_true", help="Accept unauthenticated peers (isolated networks only)."
    )
    p.add_argument(
        "--parent-pid", type=int, default=None, help="Exit when this process is no longer the parent."
    )
    p.add_argument(
        "--nice", type=int, default=0, help="Run every thread at this nice value (0-19; 0: unchanged)."
    )
    args = p.parse_args(argv)
    if not 0 <= args.nice <= 19:
        p.error(f"--nice must be in 0..19 (raising priority needs privileges), got {args.nice}")
    return args


def confine_binds(args: argparse.Namespace, argv: list[str]) -> None:
    """PD roles run a Mooncake transfer engine, whose listeners bind the wildcard address: re-execute
    this process (same pid, same parent) with the ``memory.bind_host`` shim preloaded so they bind
    ``--host``. Returns when there is nothing to do (other roles, already confined, wildcard host)."""
    if args.role not in TRANSFER_ROLES:
        return
    from memory.bind_host import exec_env
    from xengine.api.paths import cache_dir

    env = exec_env(args.host, os.environ, cache_dir())
    if env is None:
        return
    logger.info(
        "re-executing with LD_PRELOAD=%s so the KV transfer engine listens on %s only, not on every "
        "interface", env["LD_PRELOAD"].split(":")[0], args.host,
    )  # fmt: skip
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "xengine.engine_server", *argv], env)


def lower_priority(nice: int) -> None:
    """Every thread of this process to nice value ``nice`` (absolute: the re-exec of ``confine_binds``
    does not add it twice; on Linux a nice value is per thread, and new threads inherit it)."""
    tids = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("XLLM_ENGINE_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s xengine[{args.name}:{os.getpid()}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if args.nice:  # before torch starts its threads: they inherit it
        lower_priority(args.nice)
    if args.parent_pid is not None:
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != args.parent_pid:
            return 0
    config = from_dict(EngineConfig, json.loads(args.config_json))
    config.validate()
    try:
        confine_binds(args, sys.argv[1:] if argv is None else argv)
    except (RuntimeError, ValueError) as e:
        print(f"xllm: error: {e}", file=sys.stderr)
        return 2
    return serve(config, args)


if __name__ == "__main__":
    sys.exit(main())
