"""4-bit Q4_1 weights: the quantizer gives a Q4_1 file's blocks back exactly, the kernel path against the plain
torch dequantized reference (odd shapes, both sides of max_rows), the engine with int4 and its settings."""
import logging
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine, resolve_dtype, resolve_quantization
from inferd.engine.request import SamplingParams
from inferd.kernels.select import auto_quantization, int4_rule, native_bf16
from inferd.models.quant import SmallRowsInt8
from inferd.kernels.variants import load_kernels
from inferd.models.int4 import GROUP, Int4Linear, dequantize_q4_1, int4_available, quantize_q4_1, takes
from inferd.models.int4_kernel import load_int4_kernel, pack_panels
from tests.engine.test_engine import run
from tests.tiny import tiny_loaded_model

pytestmark = pytest.mark.skipif(not int4_available(), reason="this torch has no _weight_int4pack_mm_for_cpu")


def q4_1_file_values(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights as llama.cpp's Q4_1 stores them (fp16 d and m, each group's min at q=0 and max at q=15) and as
    the GGUF loader dequantizes them (float32 d * q + m)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // GROUP, generator=g) * 0.02 + 1e-4).half().float()
    m = (-8 * d + torch.randn(n, k // GROUP, generator=g) * 1e-3).half().float()
    w = torch.from_numpy(d.numpy()[..., None] * q.numpy().astype(np.float32) + m.numpy()[..., None])
    return w.reshape(n, k), q.reshape(n, k), d, m


def test_quantizer_gives_q4_1_blocks_back_exactly():
    w, q, d, m = q4_1_file_values(40, 96)
    q2, d2, m2 = quantize_q4_1(w)
    assert torch.equal(q2.long(), q) and torch.equal(m2, m)
    torch.testing.assert_close(d2, d, rtol=1e-6, atol=0)
    torch.testing.assert_close(dequantize_q4_1(q2, d2, m2), w, rtol=0, atol=1e-6)


def test_quantizer_on_other_weights_stays_within_half_a_step():
    w = torch.randn(37, 64) * torch.logspace(-3, 1, 37)[:, None]
    q, d, m = quantize_q4_1(w)
    assert q.dtype == torch.uint8 and q.max() <= 15 and d.shape == m.shape == (37, 2)
    assert ((dequantize_q4_1(q, d, m) - w).abs() <= d.repeat_interleave(GROUP, 1) / 2 + 1e-6).all()
    q0, d0, _ = quantize_q4_1(torch.full((16, 32), 0.25))  # a constant group: d = 0, no division by it
    assert (q0 == 0).all() and (d0 == 0).all()


def test_packaged_model_linears_are_its_own_q4_1_blocks():
    from inferd.models.gguf import PlainArrayReader
    from inferd.models.loader import default_model_path, load_model

    try:
        path = default_model_path()
    except Exception as exc:  # noqa: BLE001 - the packaged model is optional in a dev checkout
        pytest.skip(str(exc))
    raw = next(t for t in PlainArrayReader(path).tensors if t.name == "blk.3.ffn_down.weight")
    assert raw.tensor_type.name == "Q4_1"
    n, k = int(raw.shape[1]), int(raw.shape[0])
    blocks = np.asarray(raw.data).reshape(n, k // GROUP, 20)  # fp16 d, fp16 m, 16 bytes of two nibbles each
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    nibbles = blocks[..., 4:]
    file_q = torch.from_numpy(np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(n, k).astype(np.int64))
    q, d2, m2 = quantize_q4_1(load_model(path, progress=False).weights["model.layers.3.mlp.down_proj.weight"])
    assert torch.equal(q.long(), file_q) and torch.equal(m2, m)
    torch.testing.assert_close(d2, d, rtol=1e-5, atol=0)


def takes_rows(dtype: torch.dtype, isa: str = "native") -> bool:
    kernel = load_int4_kernel(isa)
    return kernel is not None and takes(kernel, dtype)


def our(dtype: torch.dtype, isa: str = "native"):
    """(kernel build, rows' dtype) as a test parameter, skipped where that build takes no such rows."""
    reason = "no AVX-512 BF16 here" if dtype is torch.bfloat16 else "no C++ kernels or no AVX2 here"
    return pytest.param((isa, dtype), id=f"ours-{isa}-{dtype}".replace("torch.", ""),
                        marks=pytest.mark.skipif(not takes_rows(dtype, isa), reason=reason))


OURS = [our(torch.bfloat16), our(torch.float32), our(torch.float32, "avx2")]  # the AVX2 loops alone
TORCH = pytest.param((None, torch.bfloat16), id="torch")


@pytest.mark.parametrize("kernel", [*OURS, TORCH])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("out_features,in_features,bias", [(48, 64, False), (37, 96, True), (5, 32, False),
                                                           (16, 32, True)])
def test_int4_linear_matches_dequantized_reference(kernel, rows, out_features, in_features, bias):
    isa, dtype = kernel
    torch.manual_seed(rows * out_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    layer = Int4Linear(linear, max_rows=8, kernel=isa and load_int4_kernel(isa), dtype=dtype)
    int8 = getattr(layer.kernel_at(rows), "__name__", None) == "int4_linear_int8"
    low = 1e-2 if dtype is torch.bfloat16 or int8 else 2e-4  # float32 rows: 16-bit inputs
    assert (layer.kernel is None) == (isa is None)
    ref_weight = dequantize_q4_1(*quantize_q4_1(linear.weight))
    if isa is not None:  # ours: d and m in fp16, as a Q4_1 file keeps them
        q, d, m = quantize_q4_1(linear.weight)
        ref_weight = dequantize_q4_1(q, d.half().float(), m.half().float())
    x = torch.randn(rows, in_features).to(dtype)
    ref = nn.functional.linear(x.float(), ref_weight, None if linear.bias is None else linear.bias.detach().to(dtype).float())
    out = layer(x)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    tolerance = 2 * low * ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, atol=tolerance, rtol=low)
    torch.testing.assert_close(layer(x.view(1, rows, in_features)).float(), ref.view(1, rows, -1), atol=tolerance,
                               rtol=low)
    other = torch.float32 if dtype is torch.bfloat16 else torch.bfloat16  # a model of the other dtype's input
    torch.testing.assert_close(layer(x.to(other)).float(), ref, atol=max(tolerance, 2e-2 * ref.abs().max().item()),
                               rtol=1e-2)
    assert layer.exact is False  # random weights are not Q4_1 blocks


@pytest.mark.parametrize("kernel", OURS)
def test_our_kernel_takes_no_rows(kernel):
    """A step whose rows sample none calls lm_head on none; the layers' linears must take it too."""
    isa, dtype = kernel
    k = load_int4_kernel(isa)
    layer = Int4Linear(nn.Linear(64, 40), max_rows=8, kernel=k, dtype=dtype)
    x, args = torch.empty(0, 64, dtype=dtype), (layer.nibbles, layer.dm, layer.row_bias, 40)
    assert k.int4_linear(x, *args).shape == (0, 40)
    assert k.int4_linear_int8(x, *args).shape == (0, 40)


def rounded_to(x: torch.Tensor, steps: int) -> torch.Tensor:
    """Rows as our kernel rounds them (float32 rows on AVX2 and bf16 rows on AVX-512 VNNI to 32767 steps,
    int4_linear_int8 to 127): each group of 32 on `steps` steps of its largest |x|, in the kernel's float32
    arithmetic (a scale's inverse, a product, the nearest even)."""
    groups = x.float().view(x.shape[0], -1, GROUP)
    largest = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, torch.full_like(largest, float(steps)) / largest, 0.0)  # steps * (1 / t)
    return (torch.round(groups * inverse).double() * (largest / steps).double()).view(x.shape)


@pytest.mark.parametrize("kernel", OURS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
@pytest.mark.parametrize("n,k", [(16, 32), (17, 64), (1, 32), (100, 160), (960, 576)])
def test_our_kernel_on_q4_1_file_values_is_float32_accurate(kernel, rows, n, k):
    """Q4_1 weights as a file has them (fp16 d and m): our kernel multiplies them exactly by the inputs rounded to
    16 bits a group (the m term by their exact sum), so it is off by its float32 sums, that rounding and, bf16 rows,
    the bf16 rounding of its output."""
    isa, dtype = kernel
    w, q, d, m = q4_1_file_values(n, k, seed=rows + n)
    nibbles, dm = pack_panels(q.to(torch.uint8), d, m)
    g = torch.Generator().manual_seed(rows * 1000 + n)
    bias = torch.randn(nibbles.shape[0] * 16, generator=g)
    x = torch.randn(rows, k, generator=g).to(dtype)
    x[0, :GROUP] = 0  # a group's step is 0
    ref = x.double() @ w.double().t() + bias[:n].double()
    out = load_int4_kernel(isa).int4_linear(x, nibbles, dm, bias, n)
    assert out.shape == (rows, n) and out.dtype == dtype
    exact_for_rounded = rounded_to(x, 32767) @ (w.double() - m.double().repeat_interleave(GROUP, 1)).t() + (
        x.double().view(rows, -1, GROUP).sum(-1) @ m.double().t()) + bias[:n].double()
    if dtype is torch.float32:
        torch.testing.assert_close(out.double(), exact_for_rounded, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=2e-4 * ref.abs().max().item())
        return
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=1e-4 * ref.abs().max().item())
    torch.testing.assert_close(out, ref.bfloat16(), rtol=2 ** -7, atol=1e-4 * ref.abs().max().item())
    # float32 sums of the rounded inputs: the bf16 nearest their exact sum, all but ~1 in 30,000 (one off is allowed)
    assert (out != exact_for_rounded.bfloat16()).sum().item() <= max(1, out.numel() // 1000)


def int8_inputs() -> bool:
    kernel = load_int4_kernel()
    return kernel is not None and kernel.int4_linear_bf16_native()


@pytest.mark.skipif(not int8_inputs(), reason="no AVX-512 VNNI and BF16 here")
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17])
@pytest.mark.parametrize("n,k", [(16, 32), (17, 64), (1, 32), (100, 160), (960, 576)])
def test_int8_inputs_are_exact_for_the_rounded_inputs(rows, n, k):
    """int4_linear_int8 computes the file's weights times the inputs rounded to int8 a group exactly, up to its
    float32 sums and the bf16 rounding of its output; against the unrounded inputs it is off by their rounding."""
    w, q, d, m = q4_1_file_values(n, k, seed=rows + n)
    nibbles, dm = pack_panels(q.to(torch.uint8), d, m)
    bias = torch.randn(nibbles.shape[0] * 16)
    x = torch.randn(rows, k).bfloat16()
    x[0, :GROUP] = 0  # a group's step is 0
    out = load_int4_kernel().int4_linear_int8(x, nibbles, dm, bias, n)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    exact = rounded_to(x, 127) @ w.double().t() + bias[:n].double()
    torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-4 * exact.abs().max().item())
    ref = x.double() @ w.double().t() + bias[:n].double()
    assert (out.double() - ref).norm() <= 0.02 * ref.norm()


@pytest.mark.skipif(not int8_inputs(), reason="no AVX-512 VNNI and BF16 here")
def test_a_layer_rounds_its_inputs_to_int8_from_int8_rows_up_to_max_rows():
    kernel = load_int4_kernel()
    layer = Int4Linear(nn.Linear(64, 40), max_rows=12, kernel=kernel, dtype=torch.bfloat16)
    assert layer.int8_rows == 4  # inferd.kernels.select's INT4 on a CPU with AVX-512 VNNI and BF16
    op, args = layer.op(torch.bfloat16), (layer.nibbles, layer.dm, layer.row_bias, 40)
    for rows, path in [(3, kernel.int4_linear), (4, kernel.int4_linear_int8), (12, kernel.int4_linear_int8),
                       (13, layer.dense)]:
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(op(x), path(x) if path is layer.dense else path(x, *args)), rows
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        kernel.int4_linear_int8(torch.randn(1, 64).half(), *args)
    avx2 = load_int4_kernel("avx2")
    assert not avx2.int4_linear_bf16_native()
    with pytest.raises(RuntimeError, match="VNNI"):
        avx2.int4_linear_int8(torch.randn(1, 64).bfloat16(), *args)


@pytest.mark.parametrize("kernel", OURS[1:])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17, 70])
@pytest.mark.parametrize("n,k", [(16, 32), (17, 64), (1, 32), (100, 160), (960, 576), (40, 1536)])
def test_float32_int8_inputs_are_exact_for_the_rounded_inputs(kernel, rows, n, k):
    """int4_linear_int8 of float32 rows (AVX2, vpmaddubsw): the file's weights times the inputs rounded to int8 a group
    exactly, up to its float32 sums, in row tiles of every size and panels past N."""
    w, q, d, m = q4_1_file_values(n, k, seed=rows + n)
    nibbles, dm = pack_panels(q.to(torch.uint8), d, m)
    g = torch.Generator().manual_seed(rows * 7 + k)
    bias = torch.randn(nibbles.shape[0] * 16, generator=g)
    x = torch.randn(rows, k, generator=g)
    x[0, :GROUP] = 0  # a group's step is 0
    out = load_int4_kernel(kernel[0]).int4_linear_int8(x, nibbles, dm, bias, n)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    exact = rounded_to(x, 127) @ w.double().t() + bias[:n].double()
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    ref = x.double() @ w.double().t() + bias[:n].double()
    assert (out.double() - ref).norm() <= 0.02 * ref.norm()


@pytest.mark.parametrize("kernel", OURS[1:])
def test_float32_int8_inputs_at_their_largest_products_do_not_overflow(kernel):
    """A word of vpmaddubsw adds two products of nibble and int8 input (at most 2 x 15 x 127), and a group's 8 chunks
    add up in 16 bits: at most 30,480, short of 32,767. Nibbles of 15 against inputs all at +-127 reach it."""
    n, k = 32, 128
    q = torch.full((n, k), 15, dtype=torch.uint8)
    q[1::2] = 0  # every other output: all weights m alone
    d, m = torch.full((n, k // GROUP), 0.5).half().float(), torch.full((n, k // GROUP), -1.0)
    nibbles, dm = pack_panels(q, d, m)
    x = torch.ones(3, k)
    x[1] = -1
    x[2, ::3] = -1
    out = load_int4_kernel(kernel[0]).int4_linear_int8(x, nibbles, dm, torch.empty(0), n)
    ref = x.double() @ (q.double() * 0.5 - 1).t()
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-4)


@pytest.mark.skipif(not takes_rows(torch.float32, "avx2"), reason="no C++ kernels or no AVX2 here")
def test_a_float32_layer_takes_the_kernel_at_every_row_count_int8_inputs_from_4_rows(monkeypatch):
    """float32 rows on AVX2: 16-bit inputs below 4 rows, int8 ones from 4, at every row count (a prompt of 1,024
    too: inferd.kernels.select's INT4 has no dense rows there), and no dense copy of the weights kept."""
    monkeypatch.setenv("INFERD_KERNEL_ISA", "avx2")
    assert int4_rule("float32", True) == (4, None)
    kernel = load_int4_kernel("avx2")
    layer = Int4Linear(nn.Linear(64, 40), max_rows=None, kernel=kernel, dtype=torch.float32)
    assert layer.dense is None and layer.int8_rows == 4
    op, args = layer.op(torch.float32), (layer.nibbles, layer.dm, layer.row_bias, 40)
    for rows, path in [(1, kernel.int4_linear), (3, kernel.int4_linear), (4, kernel.int4_linear_int8),
                       (1024, kernel.int4_linear_int8)]:
        x = torch.randn(rows, 64)
        assert torch.equal(op(x), path(x, *args)), rows


@pytest.mark.parametrize("kernel", OURS[1:])
@pytest.mark.parametrize("fn", ["int4_linear", "int4_linear_int8"])  # inputs rounded to 16 bits, or to int8
def test_float32_rows_with_zero_tiny_and_huge_groups(kernel, fn):
    _, q, d, m = q4_1_file_values(24, 128)
    nibbles, dm = pack_panels(q.to(torch.uint8), d, m)
    x = torch.randn(4, 128)
    x[0, :32] = 0  # a group's step is 0: no division by it
    x[1, 32:64] *= 1e30
    x[2, 64:96] *= 1e-30
    x[3, 96:] *= 1e-37  # too small for a finite scale: counts as zero
    out = getattr(load_int4_kernel(kernel[0]), fn)(x, nibbles, dm, torch.empty(0), 24)
    ref = x.double() @ (q.double() * d.double().repeat_interleave(GROUP, 1) + m.double().repeat_interleave(GROUP, 1)).t()
    assert torch.isfinite(out).all()
    for r in range(4):
        if fn == "int4_linear":
            torch.testing.assert_close(out[r].double(), ref[r], rtol=1e-3, atol=2e-4 * ref[r].abs().max().item())
        else:
            assert (out[r].double() - ref[r]).norm() <= 0.02 * ref[r].norm()


@pytest.mark.skipif(not takes_rows(torch.float32, "avx2"), reason="no C++ kernels or no AVX2 here")
def test_our_kernel_refuses_what_it_cannot_take():
    _, q, d, m = q4_1_file_values(16, 64)
    nibbles, dm = pack_panels(q.to(torch.uint8), d, m)
    kernel = load_int4_kernel()
    with pytest.raises(RuntimeError, match="disagree on K"):
        kernel.int4_linear(torch.randn(1, 32), nibbles, dm, torch.empty(0), 16)
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        kernel.int4_linear(torch.randn(1, 64).half(), nibbles, dm, torch.empty(0), 16)
    with pytest.raises(RuntimeError, match="on N"):
        kernel.int4_linear(torch.randn(1, 64), nibbles, dm, torch.empty(0), 17)
    with pytest.raises(RuntimeError, match="AVX-512 BF16"):  # the AVX2 build has no bf16 rows
        load_int4_kernel("avx2").int4_linear(torch.randn(1, 64).bfloat16(), nibbles, dm, torch.empty(0), 16)


@pytest.mark.skipif(not takes_rows(torch.float32, "avx2"), reason="no C++ kernels or no AVX2 here")
def test_our_kernel_lets_other_python_threads_run():
    """The C++ kernels release the GIL while they run (inferd/kernels/csrc/bindings.cpp), as torch's ops do: a replica's
    event loop goes on while the engine's step is in a kernel."""
    _, q, d, m = q4_1_file_values(2048, 4096)
    nibbles, dm = pack_panels(q.to(torch.uint8), d, m)
    kernel, x = load_int4_kernel("avx2"), torch.randn(2048, 4096)
    done, ticks = threading.Event(), []
    worker = threading.Thread(target=lambda: (kernel.int4_linear(x, nibbles, dm, torch.empty(0), 2048), done.set()))
    start = time.perf_counter()
    worker.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
    worker.join()
    took = time.perf_counter() - start
    assert took > 0.05, "the call is too short to tell"
    assert any(start + took / 4 < t < start + 3 * took / 4 for t in ticks), "this thread stood still during the call"


@pytest.mark.parametrize("kernel", [*OURS, TORCH])
def test_kernel_and_dense_paths_agree(kernel):
    isa, dtype = kernel
    linear = nn.Linear(64, 48, bias=False)
    kernel_only = Int4Linear(linear, max_rows=1000, kernel=isa and load_int4_kernel(isa), dtype=dtype)
    dense_only = Int4Linear(linear, max_rows=0, kernel=isa and load_int4_kernel(isa), dtype=dtype)
    x = torch.randn(4, 64).to(dtype)
    torch.testing.assert_close(kernel_only(x).float(), dense_only(x).float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", ["auto", "float32"])  # auto: the CPU's rows; float32: on our AVX2 loops where they build
def test_int4_engine_runs_and_agrees_with_fp32(dtype):
    model = tiny_loaded_model()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": list(range(3 + i, 13 + 2 * i)) for i in range(10)}  # 10 decodes
    outputs = []
    for config in (dict(dtype="float32"), dict(dtype=dtype, quantization="int4")):
        e = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=4, **config))
        for layer in (m for m in e.model.modules() if isinstance(m, Int4Linear) and m.max_rows is not None):
            layer.max_rows = 4  # the prompts and the 10 decodes on the dense copy, 4 decodes left on the kernel
        tokens = run(e, {rid: (ids, params) for rid, ids in prompts.items()})[0]
        assert all(len(t) == 8 for t in tokens.values())
        outputs.append(tokens)
    layers = [m for m in e.model.modules() if isinstance(m, Int4Linear)]
    assert e.dtype == resolve_dtype(dtype, "int4") and layers
    assert {layer.dtype for layer in layers} == {e.dtype if takes_rows(e.dtype) else torch.bfloat16}
    assert isinstance(e.model.lm_head, nn.Module) and not isinstance(e.model.lm_head, Int4Linear)
    assert sum(outputs[0][r][0] == outputs[1][r][0] for r in prompts) >= 8


@pytest.mark.skipif(load_kernels() is None, reason="no C++ kernels or no AVX2 here")
def test_int4_engine_head_is_int8_for_one_sequence_and_agrees_with_its_dense_copy():
    model = tiny_loaded_model()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    e = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=4, quantization="int4"))
    head = e.model.lm_head
    assert isinstance(head, SmallRowsInt8) and head.max_rows >= 1
    h = torch.randn(1, model.config.hidden_size).to(e.dtype)
    torch.testing.assert_close(head(h).float(), head.dense(h).float(), atol=0.05, rtol=0.05)
    one = run(e, {"one": (list(range(3, 15)), params)})[0]["one"]  # one sequence: the int8 head every step
    head.max_rows = 0
    dense = run(e, {"dense": (list(range(3, 15)), params)})[0]["dense"]
    assert len(one) == 8 and one[:4] == dense[:4]


def test_auto_dtype_follows_the_weight_format():
    int4_rows = torch.bfloat16 if native_bf16() or load_int4_kernel() is None else torch.float32
    assert resolve_dtype("auto", "int4") == int4_rows and resolve_dtype("auto", "int8") == torch.float32


def test_auto_picks_by_cpu_and_dtype():
    native = native_bf16()
    assert auto_quantization("float32") == "int4" and auto_quantization("float16") == "none"
    assert auto_quantization("auto") == "int4" and auto_quantization("bfloat16") == ("int4" if native else "none")
    assert resolve_quantization("int8", "auto") == "int8"
    assert resolve_quantization("auto", "auto") in ("int4", "int8", "none")


@pytest.mark.skipif(not takes_rows(torch.float32, "avx2"), reason="no C++ kernels or no AVX2 here")
def test_float32_int4_engine_on_avx2_says_its_kernel_serves_every_row_count(caplog, monkeypatch):
    monkeypatch.setenv("INFERD_KERNEL_ISA", "avx2")  # the rules and kernels as on an AVX2 machine
    caplog.set_level(logging.INFO, logger="inferd.models.int4")
    e = LLMEngine(tiny_loaded_model(), EngineConfig(num_kv_blocks=64, block_size=4, dtype="float32",
                                                    quantization="int4"))
    layers = [m for m in e.model.modules() if isinstance(m, Int4Linear)]
    assert layers and all(layer.max_rows is None and layer.dense is None for layer in layers)
    assert "the int4 kernel at every row count" in caplog.text
