"""A bfloat16 model (``model.dtype=bfloat16``: weights, activations and KV cache) runs on the CPU C
kernels: RMSNorm, the SwiGLU gate, RoPE and decode attention never fall back to their torch references
(prefill-only steps keep the reference's SDPA), over both KV layouts, in steps that mix decodes with
prefill chunks. Tokens are checked for sanity against float32, not for equality."""

from __future__ import annotations

import random

import pytest

from ops.cpu_kernels import attention as kernel_attention
from ops.cpu_kernels import elementwise
from ops.cpu_kernels.build import kernel_library, unavailable_reason
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

pytestmark = pytest.mark.skipif(
    kernel_library("decode_attention") is None or kernel_library("elementwise") is None,
    reason=f"CPU kernels unavailable: {unavailable_reason('elementwise') or unavailable_reason('decode_attention')}",
)

MAX_TOKENS = 12
VOCAB_SIZE = 2048  # of the tiny checkpoints


@pytest.fixture
def no_fallback(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fail if an elementwise reference runs, or an attention reference runs a step with decodes;
    returns the list the attention module's kernel-library look-ups are recorded into (it looks the
    library up for every kernel call)."""

    class Refuse:
        def __getattr__(self, name: str):
            raise AssertionError(f"the reference {name} ran instead of the kernel")

    for module in ("ref_norm", "ref_act", "ref_rope"):
        monkeypatch.setattr(elementwise, module, Refuse())

    def prefill_only(reference):  # noqa: ANN001, ANN202
        def run(q, k, v, cache, meta, *args):  # noqa: ANN001, ANN202
            assert 1 not in meta.query_lens_cpu, "a step with decodes ran the attention reference"
            return reference(q, k, v, cache, meta, *args)

        return run

    for name in ("reference_attention", "reference_contiguous"):
        monkeypatch.setattr(kernel_attention, name, prefill_only(getattr(kernel_attention, name)))
    looked_up: list[str] = []

    def recorded(name: str):  # noqa: ANN202
        looked_up.append(name)
        return kernel_library(name)

    monkeypatch.setattr(kernel_attention, "kernel_library", recorded)
    return looked_up


def _generate(model_dir: str, dtype: str, kv_layout: str) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (1, 5, 17, 40, 100, 33, 8, 64)]
    llm = LLM(
        model_dir,
        dtype=dtype,
        kv_layout=kv_layout,
        graph_mode="eager",
        block_size=32,  # a bfloat16 K block of the tiny model: one 4 KiB page (xTensor)
        num_blocks=128,
        max_num_batched_tokens=64,  # chunked prefills share steps with decodes
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_bf16_generation_runs_on_the_kernels(make_model_dir, no_fallback) -> None:
    model_dir = str(make_model_dir("qwen3", "tiny"))
    tokens = {layout: _generate(model_dir, "bfloat16", layout) for layout in ("paged", "xtensor")}
    assert "decode_attention" in no_fallback, "no step ran the decode-attention kernel"
    paged = tokens["paged"]
    assert all(len(t) == MAX_TOKENS and all(0 <= i < VOCAB_SIZE for i in t) for t in paged)
    # both layouts compute in float32 over the same bfloat16 values (the decode kernels share code)
    assert tokens["xtensor"] == paged
    float32 = _generate(model_dir, "float32", "paged")
    # bfloat16 rounding may flip near-ties of a random model, but not most first tokens
    assert sum(a[0] == b[0] for a, b in zip(paged, float32)) >= 6
