"""The ``xllm`` command line: help, config errors, make-tiny, and a real ``serve`` + ``chat`` session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from xservice.cli import build_parser, load_cli_config, main

ROOT = Path(__file__).resolve().parents[2]
TINY_PRESET = ROOT / "configs" / "cpu-tiny-test.yaml"
SERVE_FLAGS = [
    "--model", "--host", "--port", "--config", "--api-key", "--device", "--dtype", "--max-model-len",
    "--block-size", "--num-blocks", "--kv-cache-memory-gb", "--max-num-seqs", "--max-num-batched-tokens",
    "--no-prefix-caching", "--no-chunked-prefill", "--served-model-name", "--max-pending-requests",
]  # fmt: skip


def xllm(*args: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "xservice", *args], env=env, cwd=ROOT, capture_output=True, text=True, **kw
    )


def test_xllm_help_lists_the_commands() -> None:
    out = xllm("--help", timeout=60)
    assert out.returncode == 0
    for command in ("serve", "chat", "model"):
        assert command in out.stdout


def test_serve_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in SERVE_FLAGS:
        assert flag in text, flag
    assert "Tokens per KV block (the prefix-cache" in text  # help comes from the dataclass field metadata
    assert "--kv-layout" in text and "--engine-max-restarts" in text


def test_flags_override_the_config_file() -> None:
    args = build_parser().parse_args(
        ["serve", "--config", str(TINY_PRESET), "--block-size", "32", "--no-prefix-caching", "--port", "9"]
    )
    cfg = load_cli_config(args)
    assert (cfg.cache.block_size, cfg.cache.enable_prefix_caching, cfg.service.port) == (32, False, 9)
    assert cfg.cache.num_blocks == 64 and cfg.device.num_threads == 1  # kept from the file


def test_kv_transfer_port_range_flag() -> None:
    def load(value: str):
        args = ["serve", "--config", str(TINY_PRESET), "--kv-transfer-port-range", value]
        return load_cli_config(build_parser().parse_args(args))

    assert load("20000-20100").cache.transfer_ports() == (20000, 20100)
    assert load("").cache.transfer_ports() is None  # Mooncake's default range
    with pytest.raises(Exception, match="cache.kv_transfer_port_range .* ephemeral"):
        load("40000-40100")


def test_bad_config_key_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler:\n  max_num_seq: 4\n")
    out = xllm("serve", "--config", str(bad), timeout=60)
    assert out.returncode == 2
    assert "unknown config key 'scheduler.max_num_seq'" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_missing_model_folder_exits_2(tmp_path: Path) -> None:
    out = xllm("serve", "--model", str(tmp_path / "nope"), timeout=60)
    assert out.returncode == 2
    assert "--model" in out.stderr and "Traceback" not in out.stderr


def test_port_in_use_exits_2(make_model_dir: Callable[..., Path]) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = xllm("serve", "--model", str(make_model_dir()), "--port", str(port), timeout=60)
    assert out.returncode == 2
    assert f"127.0.0.1:{port}" in out.stderr and "--port" in out.stderr and "Traceback" not in out.stderr


def test_make_tiny_writes_a_loadable_folder(tmp_path: Path) -> None:
    from safetensors import safe_open

    from xengine.api.text.tokenizer import Tokenizer
    from xengine.models.info import read_model_info

    out = tmp_path / "llama-tiny"
    assert (
        main(["model", "make-tiny", "--arch", "llama", "--size", "tiny", "--out", str(out), "--quiet"]) == 0
    )
    info = read_model_info(out)
    tok = Tokenizer.from_dir(out)
    assert info.vocab_size >= tok.vocab_size > 0
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert any("embed_tokens" in name for name in weights.keys())


def test_serve_chat_and_graceful_sigint(make_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    """``xllm serve`` answers HTTP, ``xllm chat`` talks to it, Ctrl-C stops both processes cleanly."""
    model = make_model_dir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    log = (tmp_path / "serve.log").open("w")
    cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(TINY_PRESET), "--model", str(model)]
    server = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        url = wait_for_ready_line(server, tmp_path / "serve.log")
        models = httpx.get(f"{url}/models", timeout=30).json()
        assert models["data"][0]["id"] == model.name
        engine_pid = httpx.get(f"{url}/admin/stats", timeout=30).json()["engine_pid"]

        chat = xllm("chat", "--url", url, "--max-tokens", "4", input="hello\n/exit\n", timeout=120)
        assert chat.returncode == 0, chat.stderr
        assert f"chatting with {model.name}" in chat.stdout and "assistant> " in chat.stdout

        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0
        assert wait_for_exit(engine_pid, 30.0)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdout.close()
        log.close()


def test_serve_answers_503_once_the_supervisor_gives_up(
    make_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    """With restarts off (--engine-max-restarts 0) a dead engine stays dead: 503s, failing probes, exit 1."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    log_path = tmp_path / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "xservice",
        "serve",
        "--config",
        str(TINY_PRESET),
        "--model",
        str(make_model_dir()),
        "--engine-max-restarts",
        "0",
    ]
    with log_path.open("w") as log:
        server = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            url = wait_for_ready_line(server, log_path)
            engine_pid = httpx.get(f"{url}/admin/stats", timeout=30).json()["engine_pid"]
            os.kill(engine_pid, signal.SIGKILL)
            base = url.removesuffix("/v1")
            for _ in range(300):  # bounded: the watcher notices within ~0.2 s
                if httpx.get(f"{base}/health/ready", timeout=30).status_code == 503:
                    break
                time.sleep(0.1)
            ready = httpx.get(f"{base}/health/ready", timeout=30)
            assert ready.status_code == 503
            resp = httpx.post(f"{url}/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert resp.status_code == 503 and "Retry-After" in resp.headers
            for _ in range(300):  # bounded: the supervisor gives up within ~0.2 s
                if httpx.get(f"{base}/health/live", timeout=30).status_code == 503:
                    break
                time.sleep(0.1)
            assert httpx.get(f"{base}/health/live", timeout=30).status_code == 503
            assert server.poll() is None  # still up
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=60) == 1  # exit status tells a supervisor the engine died
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
            server.stdout.close()
    assert "giving up" in log_path.read_text()


def wait_for_ready_line(server: subprocess.Popen, log: Path) -> str:
    for line in server.stdout:
        if line.startswith("xllm serving"):
            return line.split(" at ", 1)[1].strip()
    server.wait()
    raise AssertionError(f"server exited with {server.returncode}:\n{log.read_text()[-3000:]}")


def wait_for_exit(pid: int, timeout_s: float) -> bool:
    """True once ``pid`` is gone (or a zombie nobody reaps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X") or time.monotonic() >= deadline:
            return state in ("Z", "X")
        time.sleep(0.1)
