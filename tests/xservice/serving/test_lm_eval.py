"""lm-evaluation-harness against a real ``xllm serve``: a multiple-choice loglikelihood task on a local
jsonl, run with ``--model local-completions`` (prompts sent as token ids, several per request, scored
with ``echo`` + ``logprobs``); every choice's loglikelihood equals HF's on the same weights within 1e-4.

Cost: the ``lm_eval`` CLI (datasets, pandas, scikit-learn, ... imported) takes ~15 s of a 2-core box.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.xengine.conftest import HFOracle

DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "a fish"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five", "the moon", "22"], "answer": 0},
    {"question": "Water freezes at", "choices": ["zero degrees", "a hundred degrees"], "answer": 0},
    {"question": "Cats like to", "choices": [" sleep", "bark at the mailman every morning"], "answer": 0},
]
TASK = """\
task: xllm_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def run_lm_eval(tmp_path: Path, server, model_dir: Path) -> list[dict]:
    """Run the harness CLI on the task; its logged samples (one per doc)."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    model_args = (
        f"model={server.model_name},base_url={server.base_url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={model_dir},num_concurrent=1,max_retries=1"
    )
    cmd = [
        *(sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args),
        *("--tasks", "xllm_tiny_mc", "--include_path", str(tmp_path), "--batch_size", "4"),
        *("--log_samples", "--output_path", str(tmp_path / "out")),
    ]
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (samples,) = (tmp_path / "out").rglob("samples_xllm_tiny_mc_*.jsonl")
    return [json.loads(line) for line in samples.read_text().splitlines()]


def test_multiple_choice_loglikelihoods_equal_hf(tmp_path: Path, server, model_dir: Path) -> None:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    samples = run_lm_eval(tmp_path, server, model_dir)
    # the harness's own tokenization of each (context, continuation) pair: the ids it sent
    harness = LocalCompletionsAPI(
        model="unused",
        base_url="http://127.0.0.1:1",
        tokenizer_backend="huggingface",
        tokenizer=str(model_dir),
    )
    hf = HFOracle(model_dir)
    assert sorted(s["doc_id"] for s in samples) == list(range(len(DOCS)))
    num_checked = 0
    for sample in samples:
        args = sample["arguments"]
        assert len(args) == len(DOCS[sample["doc_id"]]["choices"])
        for key, resp in zip(sorted(args, key=lambda k: int(k.rsplit("_", 1)[1])), sample["resps"]):
            context, continuation = args[key]["arg_0"], args[key]["arg_1"]
            ctx_ids, cont_ids = harness._encode_pair(context, continuation)
            ids = ctx_ids + cont_ids
            logprobs = hf.logits(ids).log_softmax(-1)
            want = sum(logprobs[len(ctx_ids) + j - 1, t].item() for j, t in enumerate(cont_ids))
            greedy = all(logprobs[len(ctx_ids) + j - 1].argmax().item() == t for j, t in enumerate(cont_ids))
            got, is_greedy = float(resp[0][0]), resp[0][1] == "True"
            assert got == pytest.approx(want, abs=1e-4), (context, continuation)
            assert is_greedy == greedy
            num_checked += 1
    assert num_checked == sum(len(d["choices"]) for d in DOCS)
