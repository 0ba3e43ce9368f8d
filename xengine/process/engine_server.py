"""An engine process that binds its own sockets and registers in the metadata store.

``python -m xengine.process.engine_server --config-json JSON --name N --role mixed --store URL``

Started by the cluster launchers and by ``xllm engine``. Unlike ``engine_proc`` (which connects to
the sockets of the one service that started it), it binds its PULL / PUSH sockets on ``--host`` and
advertises them through a ``ClusterAgent``; services find it in the store and connect. The I/O loop
is ``EngineProc``'s, plus: one service at a time (``Hello(service_id)``: a new service aborts its
predecessor's requests), frames to a service that went away dropped, and fencing of an incarnation
the cluster declared dead (``ServedEngineProc.fence``). See ``docs/cluster.md``.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from functools import partial
from typing import Any

import msgspec
import zmq

from xengine.api.cluster.keys import ROLES, TRANSFER_ROLES, InstanceRecord
from xengine.api.config import EngineConfig, from_dict, replace_section
from xengine.api.embed_messages import EMBED_CALLS
from xengine.api.entrypoints import ENGINE_SERVER_MODULE
from xengine.api.envs import ENGINE_LOG_LEVEL
from xengine.api.lifetime import set_parent_death_signal
from xengine.api.messages import (
    AddRequest,
    EngineOutput,
    Hello,
    StepOutputs,
    UtilityResult,
)
from xengine.api.security import ENV_KEY, ClusterKey, ZapGuard, read_key_file, secure_server, take_env_key
from xengine.process.cluster_agent import ClusterAgent
from xengine.process.engine_proc import SEND_LINGER_MS, EngineProc, apply_num_threads
from xengine.process.image_publisher import ImageHashTracker, ImagePublishingAgent
from xengine.process.observed_engine import ObservedEngine
from xengine.process.store_binds import confine_store_binds

logger = logging.getLogger("xengine.process.engine_server")
# a service's first call can arrive before its output connection completes (CURVE handshake): its
# reply waits that long for one, queued (the engine loop goes on), flushed every loop iteration
REPLY_WAIT_MS = 2000
REPLY_POLL_MS = 10  # an idle loop's input wait while replies are queued


class ServedEngineProc(EngineProc):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.service_id: str | None = None  # the service of the last Hello (None: none said hello)
        self._owner: dict[str, str | None] = {}  # req_id -> service id that added it (while unfinished)
        self._orphans: set[str] = set()  # aborted requests of a previous service: outputs dropped
        self.num_orphans_aborted = 0
        self.embeds: Any = None  # EPD: an EmbedTransferManager (image embeddings to / from peers)
        self.images: ImageHashTracker | None = None  # EPD: the image cache's hashes, for the store
        self._fence_requests: collections.deque[threading.Event] = collections.deque()  # agent thread
        self._await_hello = False  # fenced: every frame but a Hello is dropped until one arrives
        self._replies: collections.deque[tuple[bytes, float]] = collections.deque()  # (frame, give up at)

    def fence(self, timeout_s: float) -> bool:
        """(Any thread) The cluster fenced this incarnation off and failed its requests over: drop
        every request the engine runs, and every frame but a ``Hello`` until one arrives. True once
        the engine loop did so (within ``timeout_s``)."""
        done = threading.Event()
        self._fence_requests.append(done)
        return done.wait(timeout_s)

    def _housekeeping(self) -> None:
        while self._fence_requests:
            self._apply_fence()
            self._fence_requests.popleft().set()
        self._flush_replies()

    def _idle_poll_ms(self) -> int:
        return REPLY_POLL_MS if self._replies else super()._idle_poll_ms()

    def _apply_fence(self) -> None:
        dropped = list(self._num_unfinished)
        logger.warning(
            "fenced off: dropping %d request(s) of the previous incarnation and every frame until a "
            "service says hello", len(dropped),
        )  # fmt: skip
        if dropped:
            self._engine.abort_requests(dropped)
            self._orphans.update(dropped)
            self._need_step = True
        self._replies.clear()  # answers to the fenced incarnation's service
        self._engine.kv_transfer.release_all()  # PD pins of its requests: nobody will pull them now
        self._await_hello = True

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, Hello):
            self._await_hello = False
            self._hello(msg.service_id)
        elif self._await_hello:  # sent to the fenced incarnation before its service let it go
            logger.info("fenced: dropped a %s frame sent before the last hello", type(msg).__name__)
        elif isinstance(msg, EMBED_CALLS):
            from xengine.disagg.embed_transfer import embed_call

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
        frame = self._encoder.encode(msg)
        if isinstance(msg, UtilityResult):  # a reply waits a moment for its service's connection
            self._replies.append((frame, time.monotonic() + REPLY_WAIT_MS / 1000))
            self._flush_replies()
            return
        self._flush_replies()  # (frames leave in order)
        # step outputs of a service that went away are dropped at once; an EngineDead, the last
        # frame, waits for a connection like a reply
        wait_ms = 0 if isinstance(msg, StepOutputs) else REPLY_WAIT_MS
        if not send_or_drop(self._out, frame, wait_ms):
            logger.warning("no service connected: dropped a %s frame", type(msg).__name__)

    def _flush_replies(self) -> None:
        """Send the queued replies in order, as far as a service is connected; drop the ones that
        waited ``REPLY_WAIT_MS`` in vain."""
        now = time.monotonic()
        while self._replies:
            frame, give_up_at = self._replies[0]
            if not send_or_drop(self._out, frame, 0):
                if now < give_up_at:
                    return
                logger.warning("no service connected: dropped a UtilityResult frame")
            self._replies.popleft()


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
    if guard is not None:
        for sock in (inp, out):  # count refused handshakes ZAP never sees (peers with another key)
            guard.watch(sock)
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
        set_event_sink = getattr(getattr(engine, "kv", None), "set_event_sink", None)
        if set_event_sink is not None:  # the prefix cache's block events feed the service's index
            set_event_sink(agent.on_kv_events)
        if getattr(engine, "tiers", None) is not None:  # and what its KV tiers hold (docs/kv_tiers.md)
            engine.tiers.set_event_sink(agent.on_tier_events)
        proc = ServedEngineProc(ObservedEngine(engine, agent, guard), inp, out, args.parent_pid)
        proc.images = tracker
        agent.fence = proc.fence
        if image_cache is not None and args.role in TRANSFER_ROLES:
            from xengine.disagg.embed_transfer import EmbedTransferManager

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
    p = argparse.ArgumentParser(
        prog="python -m xengine.process.engine_server", description=__doc__.split("\n")[0]
    )
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


def confine_binds(args: argparse.Namespace, argv: list[str], config: EngineConfig) -> None:
    """PD roles run a Mooncake transfer engine, whose listeners bind the wildcard address and serve
    anyone: re-execute this process (same pid, same parent) with the ``memory.bind_host`` shim
    preloaded so they bind ``--host`` and refuse other local users' connections. Returns when there
    is nothing to do (other roles, already re-executed)."""
    if args.role not in TRANSFER_ROLES:
        confine_store_binds(config, ENGINE_SERVER_MODULE, argv, args.host)  # a KV store client's listeners
        return
    from memory.bind_host import exec_env
    from xengine.api.paths import cache_dir

    env = exec_env(args.host, os.environ, cache_dir())
    if env is None:
        return
    logger.info(
        "re-executing with LD_PRELOAD=%s so the KV transfer engine listens on %s and serves only this "
        "user's local connections", env["LD_PRELOAD"].split(":")[0], args.host,
    )  # fmt: skip
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", ENGINE_SERVER_MODULE, *argv], env)


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
        level=ENGINE_LOG_LEVEL.get().upper(),
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
    if config.kv_tiers.disk_path:  # one disk tier file per instance (it is locked while open)
        config = replace_section(config, "kv_tiers", disk_path=f"{config.kv_tiers.disk_path}.{args.name}")
    try:
        confine_binds(args, sys.argv[1:] if argv is None else argv, config)
    except (RuntimeError, ValueError) as e:
        print(f"xllm: error: {e}", file=sys.stderr)
        return 2
    return serve(config, args)


if __name__ == "__main__":
    sys.exit(main())
