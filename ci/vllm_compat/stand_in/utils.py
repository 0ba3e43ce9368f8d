"""Stand-in for vLLM's ``tests/utils.py`` when vLLM's server tests run against ``xllm serve``.

Copied by ``ci/vllm_compat/run.py`` over vLLM's own ``tests/utils.py`` in the extracted suite. It
provides ``RemoteOpenAIServer`` (the fixture vLLM's server tests start their server with) as a real
``xllm serve`` process of the tiny checkpoint, served under the model name the test asks for; any
other name a test imports from ``tests.utils`` comes from vLLM's original module (kept as
``tests/vllm_utils.py``) when that imports in this environment.

vLLM server flags are translated by the tables below (every flag the suite uses is in one, with its
reason): flags ``xllm serve`` has are passed on (renamed where needed), flags that only tune vLLM
internals are dropped, ``--chat-template`` becomes a checkpoint copy carrying the template (xllm reads
the template from the checkpoint), flags of features xllm lacks are either dropped with the feature
recorded for the test module (the server still serves everything else; classify.py attributes
unexplained failures there to the feature) or, where the feature is the module's subject, make
``RemoteOpenAIServer`` raise "xllm-missing: <feature>" without starting a server. A flag in no table
raises, so a new vLLM flag cannot be silently mistranslated.

Environment (set by run.py): ``XLLM_COMPAT_PYTHON`` (the interpreter with xllm's dependencies),
``XLLM_COMPAT_REPO`` (the xllm tree under test), ``XLLM_COMPAT_MODEL`` (the checkpoint folder),
``XLLM_COMPAT_LOG_DIR`` (server logs).
"""

from __future__ import annotations

import atexit
import hashlib
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

# --- vLLM server flags, as data -------------------------------------------------------------------
# Flags ``xllm serve`` has under the same name (values passed on unchanged).
SAME_FLAGS = frozenset(
    {
        "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--seed", "--api-key",
        "--trust-request-chat-template", "--tool-call-parser", "--max-logprobs", "--logprobs-mode",
        "--enable-per-request-metrics", "--enable-force-include-usage", "--return-tokens-as-token-ids",
        "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
        "--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras",
        "--allow-runtime-lora-updating", "--enable-prompt-embeds",
    }
)  # fmt: skip
# vLLM flag -> (xllm flag, fixed value or None to pass the vLLM value on)
RENAMED_FLAGS: dict[str, tuple[str, str | None]] = {
    "--no-enable-prefix-caching": ("--no-prefix-caching", ""),
    "--no-async-scheduling": ("--async-scheduling", "false"),
    "--async-scheduling": ("--async-scheduling", "true"),
    "--lora-module": ("--lora-modules", None),
}
# Flags that only tune vLLM internals (or this CI's hardware) and change no API behaviour: dropped.
DROPPED_FLAGS: dict[str, str] = {
    "--enforce-eager": "CUDA-graph switch; xllm on CPU runs eagerly by default (graph mode is its own setting)",
    "--gpu-memory-utilization": "GPU memory budget",
    "--attention-backend": "attention kernel choice",
    "--load-format": "weight loader choice (the tiny checkpoint is safetensors)",
    "--trust-remote-code": "the tiny checkpoint has no remote code (xllm never runs any)",
    "--enable-chunked-prefill": "always on in xllm",
    "--enable-prefix-caching": "on by default in xllm",
    "--enable-prompt-tokens-details": "xllm always reports usage.prompt_tokens_details",
    "--enable-auto-tool-choice": "xllm offers tool_choice 'auto' whenever the template renders tools",
    "--tensor-parallel-size": "parallelism (tests use 1)",
    "--disable-log-stats": "logging",
    "--disable-log-requests": "logging",
    "--tokenizer": "every tokenizer name resolves to the tiny checkpoint's tokenizer",
    "--port": "the stand-in picks a free port",
    "--host": "the stand-in binds 127.0.0.1",
    "--structured-outputs-config.backend": (
        "structured-output backend choice; xllm's one backend is llguidance ('guidance' in vLLM), "
        "request and response shapes are the same"
    ),
}
# Flags of features xllm lacks whose tests still talk to the server otherwise: the flag is dropped and
# the server starts, so each test is judged on its merits; a failure there that no more specific rule
# explains is classified "xllm-missing: <feature>" (classify.py reads the module -> features map).
SOFT_FEATURE_FLAGS: dict[str, str] = {
    "--reasoning-parser": "reasoning parsers",
    "--exclude-tools-when-tool-choice-none": "--exclude-tools-when-tool-choice-none",
    "--root-path": "--root-path (serving under a path prefix)",
}
# Flags whose feature is what the whole module tests: the server is not started and every test there
# errors with "xllm-missing: <feature>".
HARD_FEATURE_FLAGS: dict[str, str] = {
    "--speculative-config": "speculative decoding with a draft model or head from the model hub (none here)",
    "--tool-server": "MCP / built-in tool servers for /v1/responses",
    "--reasoning-config": "thinking-token budgets (reasoning config)",
    "--limit-mm-per-prompt": "multimodal inputs",
    "--chat-template-content-format": "multimodal content formatting",
    "--skip-tokenizer-init": "serving without a tokenizer",
    "--runner": "--runner pooling (a pooling-only server)",
    "--watermark-config": "output watermarking",
    "override_hf_configs": "overriding the checkpoint's config from the command line",
}
# --dtype values: passed on when xllm has them; fp16 checkpoints run as float32 on CPU in xllm
DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "auto": "auto", "float16": "auto", "half": "auto"}
TOOL_PARSERS = frozenset({"hermes", "auto", "none"})  # the families xllm has


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


class MissingFeature(RuntimeError):
    """A vLLM server flag needs a feature xllm lacks (the message starts with "xllm-missing: ")."""


def translate_args(model: str, vllm_args: list[str]) -> tuple[list[str], str, list[str], dict[str, str]]:
    """For ``vllm serve model *vllm_args``: (xllm serve flags, served model name, flags needing a feature
    xllm lacks (hard: the server is not started), {flag: feature} of soft-missing features).

    Unknown flags raise: a new vLLM flag must be added to one of the tables above, with its reason."""
    out: list[str] = []
    served = model
    hard: list[str] = []
    soft: dict[str, str] = {}
    i = 0
    while i < len(vllm_args):
        arg = vllm_args[i]
        if not arg.startswith("--"):
            raise ValueError(f"unexpected positional vLLM server argument {arg!r}")
        flag, eq, inline = arg.partition("=")
        values = [inline] if eq else vllm_args[i + 1 : i + 1 + _flag_arity(vllm_args, i)]
        i += 1 + (0 if eq else len(values))
        flag = flag.replace("_", "-")  # vLLM's parser accepts --max_model_len too
        value = values[0] if values else ""
        if flag == "--served-model-name":
            served = value  # xllm serves one name: the first (vLLM reports the first too)
        elif flag == "--max-model-len":
            out += [flag, str(_parse_len(value))]
        elif flag == "--dtype" and "--dtype" in _xllm_flags():
            out += [flag, DTYPES[value]]
        elif flag == "--chat-template":
            out += ["--model", _model_with_template(value)]
        elif flag == "--tool-call-parser" and value not in TOOL_PARSERS:
            soft[flag] = f"tool-call parser '{value}'"
        elif flag == "--speculative-config":  # the same JSON; a draft or head from the hub is not here
            if "--speculative-config" not in _xllm_flags():
                soft[flag] = "xllm serve --speculative-config"
            elif _speculative_runs_here(value):
                out += [flag, value]
            else:
                hard.append(flag)
        elif flag in SAME_FLAGS or flag in RENAMED_FLAGS:
            name, fixed = RENAMED_FLAGS.get(flag, (flag, None))
            if name not in _xllm_flags():  # an older xllm tree (the "before" run)
                soft[flag] = f"xllm serve {name}"
            else:
                out += [name, *values] if fixed is None else [name, fixed] if fixed else [name]
        elif flag in DROPPED_FLAGS or flag == "--dtype":
            continue
        elif flag in SOFT_FEATURE_FLAGS:
            soft[flag] = SOFT_FEATURE_FLAGS[flag]
        elif flag in HARD_FEATURE_FLAGS:
            hard.append(flag)
        else:
            raise ValueError(f"vLLM server flag {flag} is in no table of ci/vllm_compat/stand_in/utils.py")
    return out, served, hard, soft


def _speculative_runs_here(value: str) -> bool:
    """Whether a ``--speculative-config`` JSON names nothing this machine lacks: n-gram, the checkpoint's
    own MTP layers, or a draft / head folder that exists."""
    try:
        spec = json.loads(value)
    except ValueError:
        return True  # xllm serve refuses it with its own message
    model = spec.get("model") if isinstance(spec, dict) else None
    return model is None or Path(str(model)).is_dir()


def _flag_arity(args: list[str], i: int) -> int:
    """How many values follow ``args[i]`` (values never start with "--")."""
    n = 0
    while i + 1 + n < len(args) and not args[i + 1 + n].startswith("--"):
        n += 1
    return n


def _model_with_template(template: str) -> str:
    """xllm takes the chat template from the checkpoint: a copy of the tiny checkpoint (weights linked)
    whose tokenizer config carries ``template`` (a file path or the template text, as vLLM accepts)."""
    path = Path(template)
    text = path.read_text() if len(template) < 4096 and path.is_file() else template
    src = Path(os.environ["XLLM_COMPAT_MODEL"])
    dst = (
        Path(tempfile.gettempdir()) / "xllm-compat-templates" / hashlib.sha256(text.encode()).hexdigest()[:16]
    )
    if not (dst / "tokenizer_config.json").is_file():
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name not in ("tokenizer_config.json", "chat_template.jinja") and not (dst / f.name).exists():
                (dst / f.name).symlink_to(f)
        cfg = json.loads((src / "tokenizer_config.json").read_text())
        cfg["chat_template"] = text
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(dst)


# test module -> {vLLM flag: missing feature} its servers were started without (for classify.py)
MODULE_FEATURES: dict[str, dict[str, str]] = {}


def _record_features(soft: dict[str, str]) -> None:
    current = os.environ.get("PYTEST_CURRENT_TEST", "")  # "path::test[...] (setup)"
    module = current.split("::")[0]
    if module:
        MODULE_FEATURES.setdefault(module, {}).update(soft)


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
        vllm_serve_args = list(vllm_serve_args)
        if env_dict and env_dict.get("VLLM_API_KEY") and "--api-key" not in vllm_serve_args:
            vllm_serve_args += ["--api-key", env_dict["VLLM_API_KEY"]]  # vLLM's env form of --api-key
        if (env_dict or {}).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"):
            vllm_serve_args += ["--allow-runtime-lora-updating"]  # vLLM's env switch of the LoRA routes
        flags, served, hard, soft = translate_args(model, vllm_serve_args)
        if override_hf_configs:
            hard.append("override_hf_configs")
        _record_features(soft)
        if hard:
            features = "; ".join(f"{HARD_FEATURE_FLAGS[f]} (vLLM server flag {f})" for f in hard)
            raise MissingFeature(f"xllm-missing: {features}")
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
