"""The CUDA backend's quantized linear layers (``ops/cuda_kernels``) and the fp8 reference arithmetic
(``ops/quant/fp8.py``).

On CPU: the fp8 reference against the same arithmetic in float64; the CUDA layers' host-side logic
(padding of rows and dims, the transposed weight, scales, bias, output dtype, the row-wise and the
unit-scale fp8 paths) run on CPU tensors, where torch has CPU versions of ``_int_mm`` and
``_scaled_mm``, against ``reference_w8a8`` / ``ReferenceFP8Linear``; the dispatch by scheme and the
refusal of fp8 below sm89. ``@pytest.mark.cuda``: the same layers on the GPU against the references
(which run on the CPU), engines on the tiny model quantized w8a8 and fp8 against the unquantized
engine (teacher-forced agreement), and the CUDA float32 engine's greedy tokens against HF's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ops.cpu_kernels.linear_int8 import reference_w8a8
from ops.cuda_kernels.linear import check_capability, pack_linear
from ops.cuda_kernels.linear_fp8 import FP8Linear
from ops.cuda_kernels.linear_w8a8 import MIN_ROWS, W8A8Linear
from ops.cuda_kernels.quantize import TORCH_KERNELS, token_kernels
from ops.quant.fp8 import E4M3, E4M3_MAX, ReferenceFP8Linear, quantize_fp8_rows
from ops.quant.int8 import quantize_int8
from ops.quant.weights import LinearWeights
from ops.torch_ref import reference_ops

ROWS = (1, 7, 32, 300)
DIMS = ((64, 48), (72, 40), (100, 36), (37, 50))  # (k, n): multiples of 16 / 8 / 4 / neither
# relative to the largest output: float32 out = the same sums, rounded once; bf16 out = bf16 rounding
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _case(rows: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4  # rows of mixed ranges
    return x, torch.randn(n, k, generator=g) * 0.2, torch.randn(n, generator=g)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    scale = want.double().abs().max().item()
    assert (got.double().cpu() - want.double().cpu()).abs().max().item() <= tol * scale


# ------------------------------------------------------------------------------------ CPU: references


def test_fp8_rows_keep_each_row_within_an_e4m3_step() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(6, 50, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 1.0, 0.0])[:, None]
    q, scale = quantize_fp8_rows(t)
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (6,)
    assert scale[5].item() == 1.0 and torch.equal(q[5].float(), torch.zeros(50))  # all-zero row
    assert torch.equal(q[:5].float().abs().amax(dim=-1), torch.full((5,), E4M3_MAX))  # max |t| -> 448
    back = q.float() * scale[:, None]
    big = t.abs() >= scale[:, None] * 2**-6  # e4m3's normal range: 3 mantissa bits, half a step 2^-4
    assert ((back - t).abs() <= t.abs() * 2**-4 + 1e-12)[big].all()
    exact = torch.tensor([[448.0, -1.5, 0.25, 26.0]])
    q2, s2 = quantize_fp8_rows(exact)
    assert s2.item() == 1.0 and torch.equal(q2.float(), exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_fp8_is_the_dequantized_product(dtype: torch.dtype) -> None:
    x, w, b = _case(9, 40, 24, seed=1)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    layer = ReferenceFP8Linear(LinearWeights(w, b, False, "fp8", None))
    assert (layer.out_features, layer.float_output) == (24, False)
    xq, sx = quantize_fp8_rows(x)
    wq, sw = quantize_fp8_rows(w)
    want = (xq.double() * sx.double()[:, None]) @ (wq.double() * sw.double()[:, None]).T + b.double()
    got = layer(x.view(3, 3, 40))
    assert got.dtype == dtype and got.shape == (3, 3, 24)
    _close(got.reshape(9, 24), want, TOL[dtype])
    logits = ReferenceFP8Linear(LinearWeights(w, b, True, "fp8", None))(x)
    assert logits.dtype == torch.float32
    _close(logits, want, 1e-5)
    # a checkpoint's own e4m3 values and scales give the same layer
    stored = ReferenceFP8Linear(LinearWeights(wq.float(), b, True, "fp8", sw))
    assert torch.equal(stored(x), logits)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ReferenceFP8Linear(LinearWeights(w.float() + 0.01, b, True, "fp8", sw))


# ------------------------------------------------------------------------- CPU: the layers' host logic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("float_output", [False, True])
def test_w8a8_layer_matches_reference_on_cpu_tensors(dtype: torch.dtype, float_output: bool) -> None:
    for i, (rows, (k, n)) in enumerate((r, d) for r in ROWS for d in DIMS):
        x, w, b = _case(rows, k, n, seed=10 + i)
        bias = b.to(dtype) if i % 2 else None
        layer = pack_linear(LinearWeights(w.to(dtype), bias, float_output, "w8a8"))
        assert isinstance(layer, W8A8Linear) and layer.weight_t.shape == (-(-k // 8) * 8, -(-n // 8) * 8)
        got = layer(x.to(dtype))
        assert got.dtype == (torch.float32 if float_output else dtype) and got.shape == (rows, n)
        _close(got, reference_w8a8(x.to(dtype), w.to(dtype), bias), TOL[got.dtype])


@pytest.mark.parametrize("rowwise", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_layer_matches_reference_on_cpu_tensors(dtype: torch.dtype, rowwise: bool) -> None:
    for i, (rows, (k, n)) in enumerate((r, d) for r in ROWS for d in DIMS):
        x, w, b = _case(rows, k, n, seed=20 + i)
        bias = b.to(dtype) if i % 2 else None
        float_output = i % 3 == 0
        layer = FP8Linear(LinearWeights(w.to(dtype), bias, float_output, "fp8", None), rowwise=rowwise)
        assert layer.weight_t.shape == (-(-k // 16) * 16, -(-n // 16) * 16)
        assert layer.weight_t.stride() == (1, layer.weight_t.shape[0])  # column-major, as cuBLASLt wants
        got = layer(x.to(dtype))
        want = ReferenceFP8Linear(LinearWeights(w.to(dtype), bias, True, "fp8", None))(x.to(dtype))
        assert got.dtype == (torch.float32 if float_output else dtype) and got.shape == (rows, n)
        _close(got, want, TOL[got.dtype])


def test_checkpoint_values_pack_as_they_are() -> None:
    x, w, b = _case(5, 64, 32, seed=3)
    wq, sw = quantize_fp8_rows(w)
    _close(
        pack_linear(LinearWeights(wq.float(), b, True, "fp8", sw))(x),
        pack_linear(LinearWeights(w, b, True, "fp8"))(x),
        1e-6,
    )
    dense = pack_linear(LinearWeights(w, b, True, "w8a8"))
    int8_values = dense.weight_t.t()[:32, :64].float()
    stored = pack_linear(LinearWeights(int8_values, b, True, "w8a8", dense.weight_scale))
    assert torch.equal(stored(x), dense(x))
    with pytest.raises(ValueError, match="int8"):
        pack_linear(LinearWeights(w, b, True, "w8a8", sw))
    for scheme in ("w8a8", "fp8"):
        with pytest.raises(ValueError, match="zero point"):
            pack_linear(LinearWeights(w, b, False, scheme, zero=torch.zeros(32)))


def test_decode_rows_are_padded_for_int_mm() -> None:
    """``_int_mm`` wants more than 16 rows: a decode step's few rows are padded, and each row's
    result is the one it gets in a full batch (the int32 sums are exact and per row)."""
    x, w, b = _case(MIN_ROWS + 8, 64, 48, seed=4)
    layer = pack_linear(LinearWeights(w, b, True, "w8a8"))
    together = layer(x)
    for rows in (1, 3, 16, MIN_ROWS - 1):
        assert torch.equal(layer(x[:rows]), together[:rows])
    assert layer(x[:0]).shape == (0, 48)


def test_dispatch_by_scheme() -> None:
    w, b = torch.randn(16, 32), None
    assert pack_linear(LinearWeights(w, b, False, "none")) is None
    assert isinstance(pack_linear(LinearWeights(w, b, False, "w8a8")), W8A8Linear)
    assert isinstance(pack_linear(LinearWeights(w, b, False, "fp8")), FP8Linear)
    reference = reference_ops()["pack_linear"]
    for scheme in ("int8", "int4"):  # weight-only: whatever the reference backend does with them
        try:
            want = reference(LinearWeights(w, b, False, scheme, None))
        except ValueError as e:
            with pytest.raises(ValueError, match=str(e)[:30]):
                pack_linear(LinearWeights(w, b, False, scheme))
        else:
            assert type(pack_linear(LinearWeights(w, b, False, scheme))) is type(want)


def test_fp8_is_refused_below_sm89_naming_the_flag_and_device() -> None:
    fp8 = ((8, 9), "fp8 tensor cores")
    with pytest.raises(ValueError, match=r"--quantization fp8 .*sm89.*NVIDIA A100.*sm80"):
        check_capability("fp8", (8, 0), "NVIDIA A100", *fp8)
    for capability in ((8, 9), (9, 0), (10, 0)):
        check_capability("fp8", capability, "a newer GPU", *fp8)
    with pytest.raises(ValueError, match="--quantization w8a8"):
        check_capability("w8a8", (7, 0), "Tesla V100", (7, 5), "int8 tensor cores")


def test_cpu_tensors_keep_the_torch_kernels() -> None:
    """Layers on CPU tensors (these tests, a machine without Triton) round and scale in torch ops;
    the Triton kernels are for CUDA devices (checked on the GPU below)."""
    w = torch.randn(16, 32)
    for scheme in ("w8a8", "fp8"):
        assert pack_linear(LinearWeights(w, None, False, scheme)).kernels is TORCH_KERNELS
    assert token_kernels(torch.device("cpu")) is TORCH_KERNELS


def test_cuda_registers_the_quantized_pack_linear() -> None:
    from ops.cuda_kernels import linear as cuda_linear
    from ops.registry import get_op

    assert get_op("pack_linear", "cuda") is cuda_linear.pack_linear


# ----------------------------------------------------------------------------------------- on the GPU

# float32 out on the GPU: int8 sums are exact; Hopper's fp8 tensor cores accumulate with fewer bits
# than float32 (measured 2e-4 of the largest output at k=4096 on an H100), the reference in float32
FP32_TOL = {"w8a8": 2e-5, "fp8": 1e-3}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _reference_tokens(scheme: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The references' per-token rounding of ``x`` on the CPU: ``(q, scale [rows])``."""
    return (quantize_int8 if scheme == "w8a8" else quantize_fp8_rows)(x.cpu())


def _off_tie_mismatches(scheme: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> int:
    """How many of ``q``'s values differ from the CPU reference's where the reference's ``x / scale``
    is not within one float32 ulp of a tie (.5 for int8, a midpoint of e4m3's grid for fp8); at a
    near-tie the two may round apart, but by no more than one step of the grid."""
    want_q, want_scale = _reference_tokens(scheme, x)
    y = x.cpu().float() / want_scale[:, None]
    step = torch.ones_like(y)
    if scheme == "fp8":  # e4m3: 3 mantissa bits, subnormal below 2^-6
        step = torch.exp2(torch.clamp(torch.floor(torch.log2(y.abs())), min=-6.0) - 3)
    ulp = (torch.nextafter(y.abs(), torch.tensor(float("inf"))) - y.abs()).double()
    frac = (y.abs().double() / step.double()) % 1.0
    near_tie = (frac - 0.5).abs() * step.double() <= ulp
    diff = q.cpu().float() - want_q.float()
    assert (diff.abs() <= step * (1 + 1e-6)).all(), "a value rounded more than one step away"
    return int(((diff != 0) & ~near_tie).sum())


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("scheme", ["w8a8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_layers_quantize_tokens_with_triton_as_the_references_do(
    scheme: str, dtype: torch.dtype
) -> None:
    """A layer on the GPU runs the Triton kernels (a CPU one the torch ops); its per-token rounding
    gives the CPU reference's scales exactly and its values except within an ulp of a tie (the
    kernel divides exactly, as the CPU does: measured bit-equal). torch's ops on the GPU divide by
    127 / 448 as a multiply by the reciprocal, and miss the reference's scales in the last bit."""
    if scheme == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs a CUDA device of sm89 or newer")
    w = torch.randn(64, 4096)
    assert pack_linear(LinearWeights(w, None, False, scheme)).kernels.name == "torch"
    layer = pack_linear(LinearWeights(w.cuda(), None, False, scheme))
    assert layer.kernels.name == "triton"
    qdtype = torch.int8 if scheme == "w8a8" else E4M3
    for rows, k, k_pad, m_pad in ((300, 4096, 4096, 0), (1, 4096, 4096, MIN_ROWS), (7, 100, 112, 32)):
        x, _, _ = _case(rows, k, 8, seed=rows + k)
        if rows > 3:
            x[3] = 0.0  # an all-zero row: scale 1
        x = x.to(dtype)
        q, scale = layer.kernels.quantize(x.cuda(), qdtype, k_pad, m_pad)
        torch.cuda.synchronize()
        assert q.shape == (max(rows, m_pad), k_pad) and scale.shape == (max(rows, m_pad), 1)
        assert torch.equal(scale[:rows, 0].cpu(), _reference_tokens(scheme, x)[1])
        assert _off_tie_mismatches(scheme, x, q[:rows, :k], scale) == 0
        assert not q[:rows, k:].float().any() and not q[rows:].float().any()  # pad columns, pad rows


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("scheme", ["w8a8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_layers_match_the_references(scheme: str, dtype: torch.dtype) -> None:
    """The whole layer on the GPU (Triton quantize, the GEMM, the Triton epilogue or ``_scaled_mm``'s)
    against the per-token rounding of the CPU reference times the layer's own dequantized weight
    (rounded on the GPU, by torch, as before) in float64."""
    if scheme == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs a CUDA device of sm89 or newer")
    for i, (rows, (k, n)) in enumerate((r, d) for r in ROWS for d in ((4096, 1024), *DIMS)):
        x, w, b = _case(rows, k, n, seed=30 + i)
        bias = b.to(dtype) if i % 2 else None
        xq, sx = _reference_tokens(scheme, x.to(dtype))
        for float_output in (False, True):
            layer = pack_linear(
                LinearWeights(w.to(dtype).cuda(), None if bias is None else bias.cuda(), float_output, scheme)
            )
            assert layer.kernels.name == "triton"
            got = layer(x.to(dtype).cuda())
            torch.cuda.synchronize()
            weight = layer.dequantized_weight().double().cpu()
            want = (xq.double() * sx.double()[:, None]) @ weight.T
            want = want if bias is None else want + bias.double()
            assert got.dtype == (torch.float32 if float_output else dtype) and got.shape == (rows, n)
            _close(got, want, FP32_TOL[scheme] if got.dtype == torch.float32 else TOL[got.dtype])


def _engine_outputs(model: Path, prompts: list[list[int]], **kw: object) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of a CUDA engine, and its teacher-forced top-1 at every prompt position; asserts
    the decode steps replayed graphs where ``kw`` asks for them."""
    from xengine.api.messages import SamplingParams
    from xengine.llm import LLM

    llm = LLM(str(model), device="cuda", max_model_len=512, num_blocks=256, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    top1 = [max(d, key=d.get) for o in outs for d in o.prompt_logprobs[1:]]
    if kw.get("graph_mode") == "partial":
        assert llm.engine.get_stats().graph.num_replays > 0
    return [o.outputs[0].token_ids for o in outs], top1


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("scheme,min_agreement", [("w8a8", 0.85), ("fp8", 0.6)])
def test_quantized_cuda_engine_agrees_with_the_unquantized_one(
    tiny_qwen3: Path, scheme: str, min_agreement: float
) -> None:
    """Teacher-forced next-token agreement with the bf16 engine over 985 prompt positions. The tiny
    random checkpoint has many near-ties (its W8A8 agreement with fp32 on CPU is 0.89); measured on an
    H100: w8a8 0.8975, fp8 0.6569 (e4m3 keeps 3 mantissa bits: about 10 dB less signal to noise than
    per-token int8 on these wide activations). A wrong scale or layout agrees on almost nothing."""
    from tests.xengine.conftest import random_prompts

    if scheme == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs a CUDA device of sm89 or newer")
    prompts = random_prompts([200, 150, 300, 90, 250], seed=7)
    _, want = _engine_outputs(tiny_qwen3, prompts, dtype="bfloat16", graph_mode="eager")
    # piecewise graphs: the quantized layers run as opaque ops inside captured CUDA graphs
    partial = dict(graph_mode="partial", graph_batch_sizes="8")
    tokens, got = _engine_outputs(tiny_qwen3, prompts, dtype="bfloat16", quantization=scheme, **partial)
    assert all(len(t) == 12 for t in tokens)
    agreement = sum(a == b for a, b in zip(got, want)) / len(want)
    print(f"{scheme}: teacher-forced agreement with bf16 over {len(want)} positions: {agreement:.4f}")
    assert len(want) == sum(len(p) - 1 for p in prompts) and agreement >= min_agreement


@pytest.mark.cuda
@needs_gpu
def test_cuda_float32_engine_gives_hf_greedy_tokens(tiny_qwen3: Path) -> None:
    from tests.xengine.conftest import HFOracle, random_prompts

    prompts = random_prompts([5, 40, 120, 17], seed=3)
    tokens, _ = _engine_outputs(tiny_qwen3, prompts, dtype="float32", graph_mode="eager")
    oracle = HFOracle(tiny_qwen3)
    assert tokens == [oracle.greedy(p, 12) for p in prompts]
