"""The API key from each source through the real CLI: ``--api-key`` (or the config file), ``--api-key-file``
and ``$XLLM_API_KEY``, their precedence, the refusals of a bad key file, and that the key is never printed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from xservice.config import ServiceConfig, load_config

ROOT = Path(__file__).resolve().parents[3]
TINY_PRESET = ROOT / "configs" / "cpu-tiny-test.yaml"
FLAG_KEY = "sk-flag-0123456789"
FILE_KEY = "sk-file-0123456789"
ENV_KEY = "sk-env-0123456789"


def env_with(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLLM_API_KEY"}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def xllm_serve(*args: str, env: dict[str, str], **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(TINY_PRESET), *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, **kw)


@contextmanager
def serving(model: Path, tmp_path: Path, *args: str, env: dict[str, str]) -> Iterator[tuple[str, Path]]:
    """``xllm serve`` with ``args``; yields its base URL and the file with everything it printed."""
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(TINY_PRESET), "--model", str(model)]
    cmd += ["--log-level", "info", *args]
    with log_path.open("w") as log:
        server = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            url = None
            for line in server.stdout:
                log.write(line)
                log.flush()
                if line.startswith("xllm serving"):
                    url = line.split(" at ", 1)[1].strip().removesuffix("/v1")
                    break
            assert url, f"server exited with {server.wait()}:\n{log_path.read_text()[-3000:]}"
            yield url, log_path
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                out, _ = server.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                out, _ = server.communicate()
            log.write(out)


def assert_key_required(url: str, key: str, wrong: tuple[str, ...]) -> None:
    body = {"prompt": "Hello", "max_tokens": 2}
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/health").status_code == 200  # open
        assert http.post("/v1/completions", json=body).status_code == 401
        for other in wrong:
            resp = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {other}"})
            assert resp.status_code == 401, other
        resp = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 200, resp.text


def key_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "api.key"
    path.write_text(text)
    path.chmod(mode)
    return path


# ---------------------------------------------------------------------- each source, through the CLI


@pytest.fixture(scope="module")
def model(make_model_dir: Callable[..., Path]) -> Path:
    return make_model_dir()


def test_flag_beats_the_environment(model: Path, tmp_path: Path) -> None:
    with serving(model, tmp_path, "--api-key", FLAG_KEY, env=env_with(XLLM_API_KEY=ENV_KEY)) as (url, log):
        assert_key_required(url, FLAG_KEY, wrong=(ENV_KEY,))
    assert FLAG_KEY not in log.read_text()


def test_key_file_beats_the_environment(model: Path, tmp_path: Path) -> None:
    path = key_file(tmp_path, f"  {FILE_KEY}\n\n")  # surrounding whitespace is not part of the key
    env = env_with(XLLM_API_KEY=ENV_KEY)
    with serving(model, tmp_path, "--api-key-file", str(path), env=env) as (url, log):
        assert_key_required(url, FILE_KEY, wrong=(ENV_KEY, FILE_KEY[:-1]))
    assert FILE_KEY not in log.read_text()


def test_key_from_the_environment(model: Path, tmp_path: Path) -> None:
    with serving(model, tmp_path, env=env_with(XLLM_API_KEY=ENV_KEY)) as (url, log):
        assert_key_required(url, ENV_KEY, wrong=("sk-other",))
    assert ENV_KEY not in log.read_text()


# ---------------------------------------------------------------------- refusals (no server starts)


@pytest.mark.parametrize(
    "make_args,words",
    [
        (lambda p: ["--api-key-file", str(p / "missing.key")], "cannot read the API key file"),
        (lambda p: ["--api-key-file", str(key_file(p, " \n"))], "is empty"),
        (lambda p: ["--api-key-file", str(key_file(p, FILE_KEY, 0o640))], "chmod 600"),
        (lambda p: ["--api-key-file", str(key_file(p, FILE_KEY, 0o604))], "accessible by group/others"),
        (lambda p: ["--api-key-file", str(p)], "cannot read the API key file"),  # a folder
        (lambda p: ["--api-key-file", str(key_file(p, FILE_KEY)), "--api-key", FLAG_KEY], "not both"),
    ],
    ids=["missing", "empty", "group-readable", "other-readable", "folder", "both"],
)
def test_bad_key_file_exits_2_with_one_line(tmp_path: Path, make_args, words: str) -> None:
    out = xllm_serve(*make_args(tmp_path), env=env_with(), timeout=60)
    assert out.returncode == 2, out.stderr
    assert words in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert FILE_KEY not in out.stderr and FLAG_KEY not in out.stderr


def test_config_file_key_file_and_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = key_file(tmp_path, FILE_KEY)
    config = tmp_path / "xllm.yaml"
    config.write_text(f"service:\n  api_key_file: {path}\n")
    monkeypatch.setenv("XLLM_API_KEY", ENV_KEY)
    assert load_config(config).service.api_key == FILE_KEY
    assert load_config(None).service.api_key == ENV_KEY
    assert load_config(None, {"service": {"api_key": FLAG_KEY}}).service.api_key == FLAG_KEY
    monkeypatch.setenv("XLLM_API_KEY", "")
    assert load_config(None).service.api_key is None  # empty means unset


def test_key_is_not_in_the_config_repr() -> None:
    cfg = ServiceConfig(api_key=FLAG_KEY)
    assert FLAG_KEY not in repr(cfg) and FLAG_KEY not in str(
        load_config(None, {"service": {"api_key": FLAG_KEY}})
    )
