"""Stand-in for vLLM's ``tests/utils.py`` when vLLM's server tests run against ``xllm serve``.

Copied by ``ci/vllm_compat/run.py`` over vLLM's own ``tests/utils.py`` in the extracted suite. It
provides ``RemoteOpenAIServer`` (the fixture vLLM's server tests start their server with) as a real
``xllm serve`` process of the tiny checkpoint, served under the model name the test asks for; any
other name a test imports from ``tests.utils`` comes from vLLM's original module (kept as
``tests/vllm_utils.py``) when that imports in this environment.

vLLM server flags are translated: flags ``xllm serve`` has are passed on, flags without meaning
here (GPU memory, eager mode, dtype of a checkpoint that is float32 anyway) are dropped, and any
other flag makes the server refuse to start with the flag named, so the test fails for that reason.

Environment (set by run.py): ``XLLM_COMPAT_PYTHON`` (the interpreter with xllm's dependencies),
``XLLM_COMPAT_REPO`` (the xllm tree under test), ``XLLM_COMPAT_MODEL`` (the checkpoint folder),
``XLLM_COMPAT_LOG_DIR`` (server logs).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections import OrderedDict
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

VLLM_PATH = Path(__file__).resolve().parents[1]  # the extracted sdist's root (examples/, ...)
ROCM_EXTRA_ARGS: list[str] = []
multi_gpu_only = pytest.mark.skip(reason="needs several GPUs")
requires_fp8 = pytest.mark.skip(reason="needs FP8 hardware")

STARTUP_TIMEOUT_S = 600.0
MAX_LIVE_SERVERS = 2  # servers are reused across modules by configuration; the oldest is stopped beyond this

# vLLM flags that have no meaning for xllm on this machine: name -> number of values they take
DROPPED_FLAGS: dict[str, int] = {
    "--enforce-eager": 0,  # xllm's graph mode is its own setting; eager is the CPU default
    "--dtype": 1,  # the tiny checkpoint is float32 and runs so
    "--gpu-memory-utilization": 1,
    "--attention-backend": 1,
    "--load-format": 1,  # the checkpoint's weights are random anyway
    "--trust-remote-code": 0,  # the tiny checkpoint has no remote code (xllm never runs any)
    "--enable-chunked-prefill": 0,  # always on in xllm
    "--enable-prefix-caching": 0,  # on by default in xllm
    "--enable-prompt-tokens-details": 0,  # xllm always reports prompt_tokens_details
    "--enable-auto-tool-choice": 0,  # xllm offers tool_choice "auto" whenever the template renders tools
    "--tensor-parallel-size": 1,  # only "1" is used by these tests
    "--disable-log-stats": 0,
    "--disable-log-requests": 0,
    "--tokenizer": 1,  # every tokenizer name maps to the tiny checkpoint's
}
# vLLM flags of optional features xllm lacks (or configures otherwise): dropped, so the server starts
# and serves every other request; the requests that need the feature then fail on their own.
FEATURE_FLAGS: dict[str, str] = {
    "--enable-lora": "LoRA adapters (xllm has none: the base model is served, adapter names get 404)",
    "--lora-modules": "LoRA adapters",
    "--lora-module": "LoRA adapters",
    "--max-lora-rank": "LoRA adapters",
    "--max-cpu-loras": "LoRA adapters",
    "--reasoning-parser": "reasoning parsers (xllm returns the whole output as content)",
    "--reasoning-config": "reasoning parsers",
    "--tool-call-parser": "xllm picks its tool-call parser per model family",
    "--exclude-tools-when-tool-choice-none": "a vLLM prompt-rendering switch",
    "--enable-prompt-embeds": "prompt embeddings as input (refused by xllm)",
    "--limit-mm-per-prompt": "multimodal inputs (text-only models here)",
    "--chat-template-content-format": "multimodal content formatting",
    "--speculative-config": "speculative decoding settings",
    "--tool-server": "MCP / built-in tool servers for /v1/responses",
    "--skip-tokenizer-init": "xllm always detokenizes (text comes with the token ids)",
    "--enable-per-request-metrics": "vLLM's per-request 'metrics' response field",
    "--runner": "xllm serves generation and embeddings from the same server",
    "--structured-outputs-config": "xllm picks its structured-output backend itself",
}
# vLLM flag -> xllm flag with another name (None: the xllm flag takes no value)
RENAMED_FLAGS: dict[str, tuple[str, int]] = {
    "--no-enable-prefix-caching": ("--no-prefix-caching", 0),
    "--no-async-scheduling": ("--async-scheduling", -1),  # -1: add the value "false"
    "--async-scheduling": ("--async-scheduling", -2),  # -2: add the value "true"
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@cache
def _xllm_flags() -> frozenset[str]:
    """The flags ``xllm serve`` of the tree under test accepts (from its ``--help``)."""
    out = subprocess.run(
        [os.environ["XLLM_COMPAT_PYTHON"], "-m", "xservice", "serve", "--help"],
        capture_output=True,
        text=True,
        cwd=os.environ["XLLM_COMPAT_REPO"],
        env=_server_env(),
        check=True,
    ).stdout
    return frozenset(tok.strip("[],") for tok in out.split() if tok.startswith(("--", "[--")))


def _flag_arity(flag: str, args: list[str], i: int) -> int:
    """How many values follow ``args[i]`` (values never start with "--")."""
    n = 0
    while i + 1 + n < len(args) and not args[i + 1 + n].startswith("--"):
        n += 1
    return n


def translate_args(model: str, vllm_args: list[str]) -> tuple[list[str], str, list[str]]:
    """(xllm serve flags, served model name, unsupported vLLM flags) for ``vllm serve model *vllm_args``."""
    known = _xllm_flags()
    out: list[str] = []
    served = model
    unsupported: list[str] = []
    i = 0
    while i < len(vllm_args):
        arg = vllm_args[i]
        if not arg.startswith("--"):
            unsupported.append(arg)
            i += 1
            continue
        flag, _, inline = arg.partition("=")
        values = [inline] if inline else vllm_args[i + 1 : i + 1 + _flag_arity(flag, vllm_args, i)]
        i += 1 + (0 if inline else len(values))
        flag = flag.replace("_", "-")  # vLLM's parser accepts --max_model_len too
        base = flag.split(".")[0]  # --structured-outputs-config.backend
        if flag not in known and base in FEATURE_FLAGS:
            DROPPED.setdefault(base, FEATURE_FLAGS[base])
            continue
        if flag == "--served-model-name":
            served = values[0]  # xllm serves one name: the first (vLLM reports the first too)
        elif flag in ("--port", "--host", "--seed") or flag in DROPPED_FLAGS:
            continue  # port and host are ours; the seed is fixed below
        elif flag == "--max-model-len":
            out += [flag, str(_parse_len(values[0]))]
        elif flag in RENAMED_FLAGS:
            name, kind = RENAMED_FLAGS[flag]
            out += [name] + (["false"] if kind == -1 else ["true"] if kind == -2 else [])
        elif flag in known:
            out += [flag, *values]
        else:
            unsupported.append(flag)
    return out, served, unsupported


DROPPED: dict[str, str] = {}  # feature flags dropped so far (for the report): flag -> why


def _parse_len(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1000, "m": 1000**2}.get(text[-1:], 1)
    return int(float(text.rstrip("km")) * scale) if scale != 1 else int(text)


def _server_env() -> dict[str, str]:
    env = dict(os.environ)
    repo = os.environ["XLLM_COMPAT_REPO"]
    env["PYTHONPATH"] = repo  # not vLLM's source: the server imports xllm only
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class _XllmProcess:
    """One ``xllm serve`` process (with its engine process)."""

    def __init__(self, flags: list[str], served: str) -> None:
        self.port = _free_port()
        self.served = served
        log_dir = Path(os.environ.get("XLLM_COMPAT_LOG_DIR", tempfile.gettempdir()))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"xllm-serve-{self.port}.log"
        cmd = [
            os.environ["XLLM_COMPAT_PYTHON"], "-m", "xservice", "serve",
            "--model", os.environ["XLLM_COMPAT_MODEL"], "--served-model-name", served,
            "--host", "127.0.0.1", "--port", str(self.port), "--seed", "0", "--device", "cpu",
            "--log-level", "warning", *flags,
        ]  # fmt: skip
        self.cmd = cmd
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=os.environ["XLLM_COMPAT_REPO"],
                env=_server_env(),
                start_new_session=True,
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with httpx.Client(timeout=5.0) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    tail = self.log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(
                        f"xllm serve exited with {self.proc.returncode}: {' '.join(self.cmd)}\n{tail}"
                    )
                try:
                    if http.get(f"http://127.0.0.1:{self.port}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"xllm serve not ready after {STARTUP_TIMEOUT_S}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


_LIVE: OrderedDict[tuple[str, ...], _XllmProcess] = OrderedDict()


def _server_for(flags: list[str], served: str) -> _XllmProcess:
    key = (served, *flags)
    proc = _LIVE.get(key)
    if proc is not None and proc.proc.poll() is None:
        _LIVE.move_to_end(key)
        return proc
    while len(_LIVE) >= MAX_LIVE_SERVERS:
        _, oldest = _LIVE.popitem(last=False)
        oldest.stop()
    proc = _LIVE[key] = _XllmProcess(flags, served)
    return proc


@atexit.register
def stop_all() -> None:
    while _LIVE:
        _LIVE.popitem()[1].stop()


class RemoteOpenAIServer:
    """vLLM's ``RemoteOpenAIServer`` interface over a real ``xllm serve`` (see the module docstring)."""

    DUMMY_API_KEY = "token-abc123"

    def __init__(
        self,
        model: str,
        vllm_serve_args: list[str],
        *,
        env_dict: dict[str, str] | None = None,
        seed: int = 0,
        auto_port: bool = True,
        max_wait_seconds: float | None = None,
        override_hf_configs: dict[str, Any] | None = None,
    ) -> None:
        flags, served, unsupported = translate_args(model, list(vllm_serve_args))
        if override_hf_configs:
            unsupported.append("override_hf_configs")
        if unsupported:
            raise RuntimeError(f"xllm has no equivalent of these vLLM server flags: {' '.join(unsupported)}")
        self.api_key = self._api_key(vllm_serve_args)
        self._server = _server_for(flags, served)
        self.host, self.port, self.uds = "127.0.0.1", self._server.port, None
        self.show_hidden_metrics = False

    @staticmethod
    def _api_key(args: list[str]) -> str:
        for i, arg in enumerate(args):
            if arg == "--api-key" and i + 1 < len(args):
                return args[i + 1]
        return RemoteOpenAIServer.DUMMY_API_KEY

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass  # kept for the next module with the same configuration; stopped at the end

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.api_key, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.api_key, max_retries=0, **kwargs)


RemoteVLLMServer = RemoteOpenAIServer


def __getattr__(name: str) -> Any:
    """Anything else a test imports from ``tests.utils``: vLLM's original, if it imports here."""
    try:
        original = importlib.import_module("tests.vllm_utils")
    except Exception as exc:  # noqa: BLE001 - reported as the test's import error
        raise AttributeError(
            f"tests.utils.{name}: vLLM's tests/utils.py does not import here ({exc!r})"
        ) from exc
    return getattr(original, name)


def describe() -> str:
    return json.dumps({"live": [list(k) for k in _LIVE]})
