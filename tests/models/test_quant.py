"""Weight-only int8: quantization error bounds, the kernel against its reference, the model and the engine."""
import pytest
import torch
from torch import nn

from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams
from inferd.kernels.variants import cpu_flags
from inferd.models.quant import Int8Linear, SmallRowsInt8, dequantize_int8, quantize_int8
from inferd.kernels.variants import load_kernels
from tests.engine.test_engine import run
from tests.models.test_int4 import rounded_to
from tests.tiny import tiny_loaded_model

kernel = load_kernels()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C++ toolchain or no AVX2 here")


def test_quantize_round_trip_within_half_a_step_per_channel():
    w = torch.randn(37, 50) * torch.logspace(-3, 1, 37)[:, None]  # channels of very different ranges
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (37,)
    assert q.abs().max() <= 127 and (q.abs().amax(dim=1) == 127).all()  # each channel uses its full range
    err = (dequantize_int8(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()


def test_zero_channel_quantizes_to_zero():
    q, scale = quantize_int8(torch.zeros(3, 8))
    assert (q == 0).all() and torch.isfinite(scale).all()


def built(build: str | None):
    """The int8 kernel of a build ("native", "avx2": also on AVX-512; None: torch's op), skipped where it is not."""
    chosen = {"native": kernel, "avx2": load_kernels("avx2"), None: None}[build]
    if build and chosen is None:
        pytest.skip(f"the {build} build does not build or run here")
    return chosen


@pytest.mark.parametrize("build", [pytest.param("native", marks=needs_kernel), "avx2", None])  # None: torch's op
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 12, 13, 40])
@pytest.mark.parametrize("out_features,in_features,bias", [(48, 64, False), (37, 24, True), (5, 3, True),
                                                            (40, 576, True)])
def test_int8_linear_matches_dequantized_reference(build, rows, out_features, in_features, bias):
    """Exact up to float32 sums for the inputs it multiplies: 1-3 rows on AVX-512 VNNI (K a multiple of 32) round
    them to 16 bits a group of 32, every other path takes them as they are."""
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features, bias=bias)
    layer = Int8Linear(linear, built(build))
    q, scale = quantize_int8(linear.weight)
    x = torch.randn(rows, in_features)
    x[0, :32] = 0  # a group's step is 0
    rounds = build == "native" and rows <= 3 and in_features % 32 == 0 and "avx512_vnni" in cpu_flags()
    expected = nn.functional.linear(rounded_to(x, 32767).float() if rounds else x, dequantize_int8(q, scale),
                                    linear.bias).detach()
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x.view(1, rows, in_features)), expected.view(1, rows, -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("build", [pytest.param("native", marks=needs_kernel), "avx2", None])
@pytest.mark.parametrize("in_features", [24, 576])
def test_int8_linear_takes_no_rows(build, in_features):
    """lm_head of a step whose rows sample none (a prompt's chunks before its last) gets no rows."""
    layer = Int8Linear(nn.Linear(in_features, 40), built(build))
    assert layer(torch.empty(0, in_features)).shape == (0, 40)


def engine(quantization: str, **config) -> LLMEngine:
    return LLMEngine(tiny_loaded_model(), EngineConfig(dtype="float32", quantization=quantization, num_kv_blocks=64,
                                                       block_size=4, **config))


def test_int8_engine_prefills_a_long_prompt_in_chunks_as_in_one():
    """The chunks before a prompt's last sample no row, so its int8 lm_head runs on none: the 1-3 row loops on
    VNNI once read an empty buffer there and took the replica down (a 1,024-token prompt through inferd serve)."""
    reqs = {"long": (list(range(3, 40)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))}
    chunked = run(engine("int8", max_num_batched_tokens=8), reqs)[0]
    assert len(chunked["long"]) == 6 and chunked == run(engine("int8"), reqs)[0]


def test_int8_model_logits_close_to_fp32():
    fp32, int8 = engine("none"), engine("int8")
    assert not any(isinstance(m, nn.Linear) for m in int8.model.modules())
    ids = torch.randint(3, 384, (1, 24), generator=torch.Generator().manual_seed(0))[0].tolist()
    ref, out = (_prompt_logits(e, ids) for e in (fp32, int8))
    cosine = nn.functional.cosine_similarity(out, ref, dim=-1)
    assert cosine.min() > 0.999, cosine
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def _prompt_logits(e: LLMEngine, ids: list[int]) -> torch.Tensor:
    from inferd.models.llama import AttentionMetadata, PrefillChunk

    n = len(ids)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), num_decode_tokens=0, block_size=4, decode_blocks=None,
                             decode_lens=None, prefills=[PrefillChunk(0, n, torch.arange(-(-n // 4)), n)])
    return e.model(torch.tensor(ids), torch.arange(n), meta, e.runner.kv_cache, torch.arange(n))


def test_engine_greedy_with_int8_runs_and_mostly_agrees():
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": list(range(3 + i, 13 + 2 * i)) for i in range(6)}
    outputs = []
    for e in (engine("none"), engine("int8")):
        tokens = run(e, {rid: (ids, params) for rid, ids in prompts.items()})[0]
        assert all(len(t) == 12 for t in tokens.values())
        outputs.append(tokens)
    first_tokens_agree = sum(outputs[0][r][0] == outputs[1][r][0] for r in prompts)
    assert first_tokens_agree >= 5


def test_unknown_quantization_is_rejected():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")


@needs_kernel
def test_small_rows_int8_runs_int8_up_to_max_rows_and_the_dense_module_above():
    linear = nn.Linear(64, 40, bias=False)
    dense = nn.Linear(64, 40, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_(linear.weight)
    head = SmallRowsInt8(Int8Linear(linear, load_kernels()), dense, max_rows=3)
    q, scale = quantize_int8(linear.weight)
    for rows in (1, 3, 4):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        y = head(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 40)
        if rows <= 3:  # the int8 weights, fp32 products, rounded once
            torch.testing.assert_close(y, (x.float() @ (q.float() * scale[:, None]).t()).to(torch.bfloat16))
        else:
            torch.testing.assert_close(y, dense(x))
