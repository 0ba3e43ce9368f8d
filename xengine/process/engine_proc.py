"""The engine process: one ``Engine`` behind two ZMQ sockets.

``python -m xengine.process.engine_proc --config-json JSON --input-addr ADDR --output-addr ADDR``

The service binds a PUSH socket at ``input-addr`` (``EngineInput`` frames) and a PULL socket at
``output-addr`` (``EngineOutput`` frames); this process connects to both. Frames are msgspec
msgpack, never pickle. The process sends ``Ready(info)`` once the model is loaded, then loops:
read every pending input (blocking briefly only when idle), run one ``engine.step()`` when there
is work, send its deltas. ``Shutdown`` or SIGTERM stops admission and drains running requests up
to a deadline, then exits 0. It exits too when its parent dies; an unexpected error is reported
with ``EngineDead`` and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import msgspec
import torch
import zmq

from xengine.api.config import EngineConfig, from_dict
from xengine.api.entrypoints import ENGINE_PROC_MODULE
from xengine.api.envs import ENGINE_LOG_LEVEL
from xengine.api.lifetime import set_parent_death_signal
from xengine.api.messages import (
    AbortRequests,
    AddRequest,
    CompletionDelta,
    EngineDead,
    EngineOutput,
    KVExport,
    KVImport,
    KVRelease,
    LoadLoRA,
    Ready,
    RegisterCatalog,
    Shutdown,
    StepOutputs,
    UnloadLoRA,
    UtilityCall,
    UtilityResult,
    make_encoder,
    make_input_decoder,
)
from xengine.process.store_binds import confine_store_binds

logger = logging.getLogger("xengine.process.engine_proc")

IDLE_POLL_MS = 100  # how long to block for input when there is nothing to step
DEFAULT_DRAIN_TIMEOUT_S = 10.0  # used for SIGTERM; Shutdown carries its own
SEND_LINGER_MS = 2000  # let the last frames (final deltas, EngineDead) reach the service


class EngineProc:
    """Runs the I/O loop around an engine object (see ``xengine.engine.Engine``).

    ``engine`` needs ``add_request``, ``abort_requests``, ``step``, ``has_unfinished_requests``,
    ``get_stats`` and ``reset_prefix_cache``.
    """

    def __init__(self, engine: Any, input_sock: zmq.Socket, output_sock: zmq.Socket, parent_pid: int | None):
        self._engine = engine
        self._in = input_sock
        self._out = output_sock
        self._parent_pid = parent_pid
        self._decoder = make_input_decoder()
        self._encoder = make_encoder()
        self._num_unfinished: dict[str, int] = {}  # req_id -> sequences not finished yet
        self._need_step = False  # an abort happened: step once to emit its deltas
        self._drain_deadline: float | None = None  # set once shutdown has begun
        self._parent_gone = False
        # inputs read while an interruptible step ran, handled after it (``xengine/colocation/interrupter.py``)
        self._read_ahead: list[Any] = []
        interrupter = getattr(engine, "interrupter", None)
        if interrupter is not None:
            interrupter.watch = self._watch

    # ------------------------------------------------------------------ loop

    def run(self) -> int:
        """Serve until shutdown; returns the process exit code. The loop runs in inference mode: this
        process only serves, and entering the mode per step costs ~50 µs with caches cold from the
        forward (``xengine/runner/inference.py``)."""
        try:
            with torch.inference_mode():
                return self._loop()
        except Exception as e:  # noqa: BLE001 - report any failure to the service before dying
            logger.error("engine loop failed:\n%s", traceback.format_exc())
            self.send(EngineDead(f"engine loop failed: {type(e).__name__}: {e}"))
            return 1

    def _loop(self) -> int:
        while not self._done():
            self._recv_inputs(0 if self._has_work() else self._idle_poll_ms())
            self._housekeeping()
            self._check_parent()
            self._engine.check_workers()  # an expert-parallel worker gone: the instance is down
            if self._has_work() and not self._parent_gone:
                self._step()
            elif not self._parent_gone and hasattr(self._engine, "idle"):
                self._engine.idle()  # data-parallel ranks: the others' forwards go on
            self._check_drain_deadline()
        return 0

    def begin_shutdown(self, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        """Stop admitting requests; running ones get ``drain_timeout_s`` to finish."""
        if self._drain_deadline is None:
            logger.info("shutting down: draining %d request(s)", len(self._num_unfinished))
            self._drain_deadline = time.monotonic() + max(0.0, drain_timeout_s)

    def send(self, msg: EngineOutput) -> None:
        self._out.send(self._encoder.encode(msg))

    def _has_work(self) -> bool:
        return self._need_step or self._engine.has_unfinished_requests()

    def _idle_poll_ms(self) -> int:
        """How long an idle loop waits for input before its next iteration."""
        parallel = getattr(self._engine, "parallel", None)
        return getattr(parallel, "idle_poll_ms", IDLE_POLL_MS)

    def _housekeeping(self) -> None:
        """Once per loop iteration, after inputs were read (a hook: the cluster engine server applies
        requests other threads made of the loop here)."""

    def _done(self) -> bool:
        if self._parent_gone:
            return True
        if self._drain_deadline is None or self._has_work():
            return False
        may_exit = getattr(self._engine, "may_exit", None)  # data-parallel ranks leave together
        return may_exit is None or may_exit()

    def _step(self) -> None:
        self._need_step = False
        deltas = self._engine.step()
        for d in deltas:
            if d.finish_reason is not None:
                self._mark_finished(d.req_id)
        if deltas:
            self.send(StepOutputs(deltas))

    def _mark_finished(self, req_id: str) -> None:
        left = self._num_unfinished.get(req_id)
        if left is None:
            return
        if left <= 1:
            del self._num_unfinished[req_id]
        else:
            self._num_unfinished[req_id] = left - 1

    def _check_drain_deadline(self) -> None:
        if self._drain_deadline is None or time.monotonic() < self._drain_deadline:
            return
        if self._num_unfinished:
            logger.warning("drain timeout: aborting %d request(s)", len(self._num_unfinished))
            self._engine.abort_requests(list(self._num_unfinished))
            self._step()
        self._num_unfinished.clear()
        self._need_step = False
        if self._engine.has_unfinished_requests():
            raise RuntimeError("requests still unfinished after aborting them at the drain deadline")

    def _check_parent(self) -> None:
        if self._parent_pid is not None and os.getppid() != self._parent_pid:
            logger.warning("parent process %d is gone; exiting", self._parent_pid)
            self._parent_gone = True

    # ------------------------------------------------------------------ inputs

    def _recv_inputs(self, timeout_ms: int) -> None:
        """Handle every pending input frame; wait up to ``timeout_ms`` for the first one."""
        if self._read_ahead:
            read, self._read_ahead = self._read_ahead, []
            for msg in read:
                self._handle(msg)
            timeout_ms = 0
        interrupter = getattr(self._engine, "interrupter", None)
        if interrupter is not None:
            interrupter.inputs_drained()
        if timeout_ms > 0 and not self._in.poll(timeout_ms, zmq.POLLIN):
            return
        for msg in self._read_frames():
            self._handle(msg)

    def _read_frames(self) -> list[Any]:
        """Every input frame available now, decoded (malformed ones are logged and dropped)."""
        out = []
        while True:
            try:
                frame = self._in.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(self._decoder.decode(frame))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("dropping malformed input frame: %s", e)

    def _watch(self, timeout_s: float, wake_fd: int) -> None:
        """While an interruptible (offline) step runs: read inputs until the step ends (``wake_fd``
        readable) or ``timeout_s``, keep them for after the step, and stop the step if an online
        request is among them."""
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        poller.register(wake_fd, zmq.POLLIN)
        ready = dict(poller.poll(max(1, int(timeout_s * 1000))))
        if self._in not in ready:
            return
        for msg in self._read_frames():
            self._read_ahead.append(msg)
            if isinstance(msg, AddRequest) and msg.priority == "online":
                self._engine.interrupter.online_arrived(msg.req_id)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequests):
            self._engine.abort_requests(list(msg.req_ids))
            self._need_step = True
        elif isinstance(msg, UtilityCall):
            self.send(self._call(msg))
        elif isinstance(msg, RegisterCatalog):
            self.send(self._register_catalog(msg))
        elif isinstance(msg, (LoadLoRA, UnloadLoRA)):
            self.send(self._lora_call(msg))
        elif isinstance(msg, Shutdown):
            self.begin_shutdown(msg.drain_timeout_s)
        elif isinstance(msg, (KVExport, KVImport, KVRelease)):
            self.send(self._kv_call(msg))

    def _add(self, req: AddRequest) -> None:
        if self._drain_deadline is not None:
            self._reject(req.req_id, "engine is shutting down")
            return
        if req.req_id in self._num_unfinished:
            self._reject(req.req_id, f"duplicate req_id {req.req_id!r}")
            return
        try:
            self._engine.add_request(req)
        except ValueError as e:
            self._reject(req.req_id, str(e))
            return
        self._num_unfinished[req.req_id] = max(1, req.params.n)

    def _reject(self, req_id: str, error: str) -> None:
        self.send(StepOutputs([CompletionDelta(req_id=req_id, finish_reason="error", error=error)]))

    def _call(self, call: UtilityCall) -> UtilityResult:
        try:
            if call.method == "ping":
                return UtilityResult(call_id=call.call_id)
            if call.method == "stats":
                return UtilityResult(call_id=call.call_id, stats=self._engine.get_stats())
            if call.method == "reset_prefix_cache":
                return UtilityResult(call_id=call.call_id, ok=bool(self._engine.reset_prefix_cache()))
            if call.method == "list_catalogs":
                return UtilityResult(call_id=call.call_id, catalogs=self._engine.list_catalogs())
            if call.method == "list_requests":  # the service audits for requests it waits on in vain
                return UtilityResult(call_id=call.call_id, req_ids=list(self._num_unfinished))
        except Exception as e:  # noqa: BLE001 - a failed utility call is reported, not fatal
            logger.error("utility call %r failed:\n%s", call.method, traceback.format_exc())
            return UtilityResult(call_id=call.call_id, ok=False, error=f"{type(e).__name__}: {e}")
        return UtilityResult(call_id=call.call_id, ok=False, error=f"unknown utility method {call.method!r}")

    def _kv_call(self, msg: KVExport | KVImport | KVRelease) -> UtilityResult:
        """PD KV transfer (``xengine/disagg/kv_transfer.py``); a failure is reported, not fatal."""
        try:
            if isinstance(msg, KVExport):
                info = self._engine.kv_export(msg.export_id, list(msg.token_ids), msg.next_token_id)
                return UtilityResult(call_id=msg.call_id, kv_export=info)
            if isinstance(msg, KVImport):
                result = self._engine.kv_import(
                    msg.source, list(msg.token_ids), msg.pin_id, msg.next_token_id
                )
                return UtilityResult(call_id=msg.call_id, kv_import=result)
            return UtilityResult(call_id=msg.call_id, ok=self._engine.kv_release(msg.export_id))
        except Exception as e:  # noqa: BLE001
            logger.error("%s failed:\n%s", type(msg).__name__, traceback.format_exc())
            return UtilityResult(call_id=msg.call_id, ok=False, error=f"{type(e).__name__}: {e}")

    def _lora_call(self, msg: LoadLoRA | UnloadLoRA) -> UtilityResult:
        """Register or drop a LoRA adapter; a failure (a bad folder, an unknown name) is reported."""
        lora = self._engine.lora
        if lora is None:
            return UtilityResult(call_id=msg.call_id, ok=False, error="this engine serves no LoRA adapters")
        try:
            if isinstance(msg, LoadLoRA):
                lora.register(msg.name, msg.path, msg.replace)
            else:
                lora.unregister(msg.name)
        except KeyError:
            return UtilityResult(call_id=msg.call_id, ok=False, error=f"unknown LoRA adapter {msg.name!r}")
        except (ValueError, OSError) as e:
            return UtilityResult(call_id=msg.call_id, ok=False, error=str(e))
        return UtilityResult(call_id=msg.call_id)

    def _register_catalog(self, msg: RegisterCatalog) -> UtilityResult:
        try:
            info = self._engine.register_catalog(msg.name, msg.items)
        except ValueError as e:  # a bad catalog is the caller's mistake: report it, keep serving
            return UtilityResult(call_id=msg.call_id, ok=False, error=str(e))
        return UtilityResult(call_id=msg.call_id, catalogs=[info])


# ---------------------------------------------------------------------- process setup


def apply_num_threads(config: EngineConfig) -> None:
    """Set the engine's intra-op threads through the platform, before the model loads. Unset, an
    engine process leaves room for the service it shares the host with."""
    from ops.platforms import resolve_platform

    platform = resolve_platform(config.device.device)
    num_threads = config.device.num_threads
    platform.set_num_threads(num_threads if num_threads is not None else platform.serving_num_threads())


def connect_sockets(ctx: zmq.Context, input_addr: str, output_addr: str) -> tuple[zmq.Socket, zmq.Socket]:
    """PULL from the service's input address, PUSH to its output address."""
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.RCVHWM, 0)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.setsockopt(zmq.LINGER, SEND_LINGER_MS)
    out.connect(output_addr)
    return inp, out


def serve(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int | None) -> int:
    """Load the engine, announce ``Ready`` and run the loop; returns the exit code."""
    ctx = zmq.Context()
    inp, out = connect_sockets(ctx, input_addr, output_addr)
    encoder = make_encoder()
    try:
        try:
            apply_num_threads(config)
            from xengine.engine import Engine

            engine = Engine(config)
        except Exception as e:  # noqa: BLE001 - tell the service why startup failed
            if isinstance(e, ValueError):  # a configuration the engine refuses: its message says why
                logger.error("engine failed to start: %s", e)
            else:
                logger.error("engine failed to start:\n%s", traceback.format_exc())
            out.send(encoder.encode(EngineDead(f"engine failed to start: {type(e).__name__}: {e}")))
            return 1
        proc = EngineProc(engine, inp, out, parent_pid)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: proc.begin_shutdown())
        proc.send(Ready(engine.info))
        logger.info("engine ready (pid %d)", os.getpid())
        try:
            return proc.run()
        finally:
            engine.shutdown()
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m xengine.process.engine_proc", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config-json", required=True, help="EngineConfig as JSON (dataclasses.asdict).")
    p.add_argument("--input-addr", required=True, help="ZMQ address the service pushes EngineInput to.")
    p.add_argument("--output-addr", required=True, help="ZMQ address the service pulls EngineOutput from.")
    p.add_argument(
        "--parent-pid", type=int, default=None, help="Exit when this process is no longer the parent."
    )
    return p.parse_args(argv)


def config_to_json(config: EngineConfig) -> str:
    """Inverse of the ``--config-json`` parsing."""
    return json.dumps(dataclasses.asdict(config))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=ENGINE_LOG_LEVEL.get().upper(),
        format=f"%(asctime)s xengine[{os.getpid()}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if args.parent_pid is not None:
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != args.parent_pid:  # the parent died before prctl took effect
            return 0
    config = from_dict(EngineConfig, json.loads(args.config_json))
    config.validate()
    try:
        confine_store_binds(config, ENGINE_PROC_MODULE, sys.argv[1:] if argv is None else argv)
    except (RuntimeError, ValueError) as e:
        print(f"xllm: error: {e}", file=sys.stderr)
        return 2
    return serve(config, args.input_addr, args.output_addr, args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
