"""xllm's root conftest for vLLM's extracted ``tests/`` (replaces vLLM's own, which needs a GPU build).

- Model names: every Hugging Face model id a test names maps to the tiny checkpoint the server runs
  (``vllm.tokenizers.get_tokenizer`` and ``transformers.AutoTokenizer.from_pretrained``), so tests and
  server tokenize alike.
- Which tests talk to a server: a test whose fixtures (transitively) or body start a
  ``RemoteOpenAIServer``. The others test vLLM's own Python objects; they are deselected (recorded
  as "vllm-internal") unless ``XLLM_COMPAT_RUN_INTERNAL=1``.
- Results: every test's outcome, phase and failure text go to ``$XLLM_COMPAT_RESULTS`` (JSON).
"""

from __future__ import annotations

import inspect
import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

MODEL_DIR = os.environ["XLLM_COMPAT_MODEL"]
RESULTS: dict[str, dict[str, Any]] = {}
SERVER_MARK = "RemoteOpenAIServer"


def _redirect(name: Any) -> Any:
    """A hub model id (not a local folder) becomes the tiny checkpoint's folder."""
    if isinstance(name, str) and not os.path.isdir(name) and name.count("/") == 1:
        return MODEL_DIR
    return name


def _patch_tokenizer_loaders() -> None:
    import transformers

    auto = transformers.AutoTokenizer
    original = auto.from_pretrained.__func__

    def from_pretrained(cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        return original(cls, _redirect(name), *args, **kwargs)

    auto.from_pretrained = classmethod(from_pretrained)
    try:
        import vllm.tokenizers as vt
    except Exception:  # noqa: BLE001 - tests importing it then fail with the real error
        return
    real = vt.get_tokenizer

    def get_tokenizer(tokenizer_name: Any = None, *args: Any, **kwargs: Any) -> Any:
        if "tokenizer_name" in kwargs:
            kwargs["tokenizer_name"] = _redirect(kwargs["tokenizer_name"])
            return real(*args, **kwargs)
        return real(_redirect(tokenizer_name), *args, **kwargs)

    vt.get_tokenizer = get_tokenizer


def _patch_downloads() -> None:
    """Hub downloads: a model's weights resolve to the tiny checkpoint; a LoRA adapter to one generated
    for it (``xengine/tools/make_lora.py``, rank 8 on the attention projections, seeded by the name)."""
    import tempfile

    try:
        import vllm.model_executor.model_loader.weight_utils as wu
        import vllm.transformers_utils.repo_utils as ru
    except Exception:  # noqa: BLE001 - tests importing them then fail with the real error
        return

    real_api = ru.hf_api

    class _NoHub:
        """``snapshot_download`` as above; anything else from the real (offline) client, which reads
        the stand-in hub cache run.py prepares."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real_api(), name)

        def snapshot_download(self, repo_id: str, **kwargs: Any) -> str:
            repo = Path(os.environ["XLLM_COMPAT_REPO"])
            if not (
                repo / "xengine" / "tools" / "make_lora.py"
            ).is_file():  # a tree without LoRA: a placeholder
                path = Path(tempfile.gettempdir()) / "xllm-compat-lora-placeholder" / repo_id
                path.mkdir(parents=True, exist_ok=True)
                return str(path)
            path = Path(tempfile.gettempdir()) / "xllm-compat-lora" / repo_id
            if not (path / "adapter_config.json").is_file():
                import subprocess
                import zlib

                seed = str(zlib.crc32(repo_id.encode()) % 1000)
                cmd = [
                    os.environ["XLLM_COMPAT_PYTHON"],
                    "-m",
                    "xengine.tools.make_lora",
                    MODEL_DIR,
                    str(path),
                ]
                subprocess.run([*cmd, "--seed", seed], cwd=str(repo), check=True)
            return str(path)

    ru.hf_api = lambda: _NoHub()
    wu.download_weights_from_hf = lambda *args, **kwargs: MODEL_DIR


_patch_tokenizer_loaders()
_patch_downloads()


class _HfRunner:
    """vLLM's ``hf_runner`` fixture, as far as the server tests use it: the prompts' token embeddings of
    the served (tiny) checkpoint, computed with HF ``transformers`` in the test process."""

    def __init__(self, model_name: str, *args: Any, **kwargs: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
        self.model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)

    def __enter__(self) -> _HfRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def get_prompt_embeddings(self, prompts: list[str]) -> list[Any]:
        import torch

        with torch.no_grad():
            return [
                self.model.get_input_embeddings()(torch.tensor(self.tokenizer(p).input_ids)) for p in prompts
            ]


@pytest.fixture(scope="session")
def hf_runner() -> type[_HfRunner]:
    return _HfRunner


def _source(obj: Any) -> str:
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return ""


def _starts_server(item: pytest.Item, memo: dict[Any, bool]) -> bool:
    """Whether ``item``'s body or any fixture it uses (transitively) starts a ``RemoteOpenAIServer``."""

    def fixture_starts(defs: Any) -> bool:
        for d in defs:
            if d not in memo:
                memo[d] = False  # cycles
                deps = [item._fixtureinfo.name2fixturedefs.get(a, ()) for a in d.argnames]
                memo[d] = SERVER_MARK in _source(d.func) or any(fixture_starts(x) for x in deps)
            if memo[d]:
                return True
        return False

    if SERVER_MARK in _source(getattr(item, "function", None)):
        return True
    return any(fixture_starts(defs) for defs in item._fixtureinfo.name2fixturedefs.values())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    memo: dict[Any, bool] = {}
    run_internal = os.environ.get("XLLM_COMPAT_RUN_INTERNAL") == "1"
    keep, internal = [], []
    for item in items:
        if _starts_server(item, memo):
            keep.append(item)
        else:
            internal.append(item)
            RESULTS[item.nodeid] = {"outcome": "not-run", "kind": "vllm-internal"}
    if not run_internal:
        items[:] = keep
        config.hook.pytest_deselected(items=internal)
    for item in keep:
        RESULTS[item.nodeid] = {"outcome": "not-run", "kind": "server"}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = RESULTS.setdefault(report.nodeid, {"kind": "server"})
    if report.when == "call" or report.outcome != "passed":
        if entry.get("outcome") in ("failed", "error") and report.when == "teardown":
            return  # keep the first failure
        outcome = report.outcome
        if report.when != "call" and outcome == "failed":
            outcome = "error"
        entry["outcome"] = outcome
        entry["when"] = report.when
        if report.outcome != "passed":
            entry["message"] = _short(report)
    entry["duration_s"] = round(entry.get("duration_s", 0.0) + report.duration, 3)


def _short(report: pytest.TestReport) -> str:
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = report.longreprtext or ""
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    return "\n".join(lines[:12]) or text[-1500:]


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        RESULTS[report.nodeid] = {
            "outcome": "error",
            "when": "collect",
            "kind": "collect",
            "message": _short(report),
        }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests.utils import MODULE_FEATURES, stop_all

    out = os.environ.get("XLLM_COMPAT_RESULTS")
    if out:
        RESULTS["__module_features__"] = {"outcome": "meta", "kind": "meta", "modules": MODULE_FEATURES}
        Path(out).write_text(json.dumps(RESULTS, indent=1, sort_keys=True))

    stop_all()
