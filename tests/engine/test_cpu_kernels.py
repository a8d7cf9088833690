"""The C++ ops of inferd.models.cpu_kernels against their torch versions (TorchKernels), float32 and bfloat16,
on random inputs: odd head counts, GQA ratios, contexts across block boundaries."""
import contextlib

import pytest
import torch

from inferd.models.cpu_kernels import TorchKernels, kernels_for
from inferd.kernels.variants import load_kernels
from inferd.models.packed import PackedLinear, PanelLinear, one_row_ops, panel_weights

cpp = load_kernels()
pytestmark = pytest.mark.skipif(cpp is None, reason="no C++ kernels built for this CPU")
DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype):  # bf16: both sides round once or twice to 8 bits of mantissa
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def randn(*shape, dtype, g):
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (5, 64), (33, 100)])
def test_norms_match_torch(dtype, rows, n):
    g = torch.Generator().manual_seed(rows)
    x, w = randn(rows, n, dtype=dtype, g=g), randn(n, dtype=dtype, g=g)
    torch.testing.assert_close(cpp.rms_norm(x, w, 1e-5), TorchKernels.rms_norm(x, w, 1e-5), **tol(dtype))
    residual = randn(rows, n, dtype=dtype, g=g)
    ours, theirs = residual.clone(), residual.clone()
    out = cpp.add_rms_norm(x, ours, w, 1e-5)
    torch.testing.assert_close(out, TorchKernels.add_rms_norm(x, theirs, w, 1e-5), **tol(dtype))
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)  # the residual stream rounds as a torch add


AVX2_TOO = ["native", pytest.param("avx2", marks=pytest.mark.skipif(
    cpp is None or "avx512f" not in open("/proc/cpuinfo").read(),
    reason="the AVX2 build is tested where the native one is AVX-512"))]


# The greedy pick against torch's: vocabularies off the vectors' width (a maximum in the tail), ties (the first wins,
# in one vector and across vectors), masked (-inf) tokens and a row of them only, one value throughout.
@pytest.mark.parametrize("build", AVX2_TOO)
def test_best_rows_takes_the_first_maximum_as_torch_does(build):
    ops = load_kernels(build)
    gen = torch.Generator().manual_seed(1)
    for vocab in (1, 7, 16, 45, 1000, 49152):
        logits = torch.randn(9, vocab, generator=gen) * 3
        logits[1, -1] = 100.0  # in the tail
        logits[2, [vocab // 3, vocab // 2, vocab - 1]] = 50.0  # equal maxima
        logits[3, torch.randperm(vocab, generator=gen)[:vocab // 2]] = float("-inf")
        logits[4] = float("-inf")
        logits[5] = 0.25
        torch.testing.assert_close(ops.best_rows(logits), TorchKernels.best_rows(logits), rtol=0, atol=0)


@pytest.mark.parametrize("build", AVX2_TOO)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(7, 96), (3, 1536), (2, 37)])  # whole vectors, and a scalar tail
def test_silu_mul_matches_torch(build, dtype, rows, n):
    g = torch.Generator().manual_seed(n)
    gate_up = randn(rows, 2 * n, dtype=dtype, g=g) * 4
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e4, -1e4, 88.0, -88.0])  # e^-|g| from 1 to 0
    kernels = cpp if build == "native" else load_kernels(build)
    torch.testing.assert_close(kernels.silu_mul(gate_up), TorchKernels.silu_mul(gate_up), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (4, 4, 16), (6, 2, 32)])
def test_rope_cache_rotates_q_k_and_writes_the_cache(dtype, heads, kv_heads, hd):
    g = torch.Generator().manual_seed(heads)
    rows, slots, max_pos = 6, 40, 50
    qkv = randn(rows, (heads + 2 * kv_heads) * hd, dtype=dtype, g=g)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), torch.rand(hd // 2, generator=g))
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 3, 49, 7, 8, 20])
    slot_mapping = torch.randperm(slots, generator=g)[:rows]
    caches = [randn(slots, kv_heads, hd, dtype=dtype, g=g) for _ in range(2)]
    ours, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
    q = cpp.rope_cache(qkv, cos, sin, positions, *ours, slot_mapping, heads, kv_heads)
    expected = TorchKernels.rope_cache(qkv, cos, sin, positions, *theirs, slot_mapping, heads, kv_heads)
    torch.testing.assert_close(q, expected, **tol(dtype))
    torch.testing.assert_close(ours[0], theirs[0], **tol(dtype))
    torch.testing.assert_close(ours[1], theirs[1], atol=0, rtol=0)  # V is copied as it is
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    torch.testing.assert_close(ours[0][untouched], caches[0][untouched], atol=0, rtol=0)


def test_rope_cache_refuses_a_slot_out_of_range():
    qkv, cache = torch.zeros(1, 3 * 16), torch.zeros(4, 1, 16)
    cos = sin = torch.zeros(8, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        cpp.rope_cache(qkv, cos, sin, torch.tensor([0]), cache, cache.clone(), torch.tensor([4]), 1, 1)


def paged_decode_case(dtype, heads, kv_heads, hd, seed=0):
    g = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 4, 40
    k_cache = randn(num_blocks * block_size, kv_heads, hd, dtype=dtype, g=g)
    v_cache = randn(num_blocks * block_size, kv_heads, hd, dtype=dtype, g=g)
    lens = torch.tensor([1, 7, 16, 13, 37])  # one token, mid-block, a full last block, across blocks, a long one
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in lens])
    q = randn(len(lens), heads, hd, dtype=dtype, g=g) * 3  # peaked scores: softmax's exp far from 0 too
    return q, k_cache, v_cache, tables, lens, block_size, hd ** -0.5


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# head_dim 16..128 take the vector loops (tiles of 1-4 query heads: 9 / 1 is 4 + 4 + 1; bf16 at 32..128 on AVX-512
# takes tiles of 1-3, widened without a shuffle: 9 / 1 is 3 + 3 + 3, 10 / 2 is 3 + 2), 24 the scalar ones. The 5
# sequences on 1 thread: bf16 on its dot products where the CPU has AVX-512 BF16 (head_dim 32, 64, 128; a task a
# sequence); on 8 threads, fewer than twice as many sequences: widened to float32, a task a KV head.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 8])
@pytest.mark.parametrize("heads,kv_heads,hd", [(4, 2, 16), (4, 2, 32), (6, 6, 64), (9, 3, 64), (9, 1, 64), (10, 2, 128),
                                               (6, 2, 24), (3, 3, 8)])
def test_paged_decode_matches_torch(dtype, threads, heads, kv_heads, hd):
    args = paged_decode_case(dtype, heads, kv_heads, hd)
    with torch_threads(threads):
        ours = cpp.paged_decode(*args)
    torch.testing.assert_close(ours, TorchKernels.paged_decode(*args), **tol(dtype))


# Fewer (sequence, KV head) pairs than twice the threads: each context is cut into parts of whole blocks (at least
# 128 positions), attended apart and merged. Lengths off the block size; a short sequence beside a long one (not
# cut); blocks larger than a part (no cut where a part would be empty); the scalar loops (head_dim 24).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("heads,kv_heads,hd,lens,block_size", [(9, 3, 64, [300], 16), (4, 1, 32, [1000, 5], 16),
                                                               (9, 3, 64, [300], 256), (6, 2, 24, [777], 8)])
def test_paged_decode_of_few_long_sequences_cut_in_parts_matches_torch(dtype, threads, heads, kv_heads, hd, lens,
                                                                        block_size):
    g = torch.Generator().manual_seed(threads)
    width = -(-max(lens) // block_size)
    num_blocks = width * len(lens) + 3
    k_cache, v_cache = (randn(num_blocks * block_size, kv_heads, hd, dtype=dtype, g=g) for _ in range(2))
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in lens])
    q = randn(len(lens), heads, hd, dtype=dtype, g=g) * 3
    args = q, k_cache, v_cache, tables, torch.tensor(lens), block_size, hd ** -0.5
    with torch_threads(threads):
        ours = cpp.paged_decode(*args)
    torch.testing.assert_close(ours, TorchKernels.paged_decode(*args), **tol(dtype))


# bf16 decode attention on the engine's blocks of 16 (and 32): contexts of one position, ending mid-block, at a
# block's end and one past it; 9 query heads on 3 KV heads, 16 and 18 on one; one key far above the rest; every slot
# no context covers holding NaN (a kernel that read one, for a score or a value, would turn the output NaN).
@pytest.mark.parametrize("hd", [64, 32])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (16, 1), (18, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_with_blocks_of_16_and_unused_slots_of_nan_matches_torch(hd, heads, kv_heads, block_size):
    g = torch.Generator().manual_seed(hd + heads + block_size)
    lens = [1, 15, 16, 17, 33, 200, 301]
    width = -(-max(lens) // block_size)
    num_blocks = width * len(lens)
    tables = torch.randperm(num_blocks, generator=g).view(len(lens), width)
    k_cache = torch.full((num_blocks * block_size, kv_heads, hd), float("nan"), dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    for table, n in zip(tables, lens):
        slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        k_cache[slots] = randn(n, kv_heads, hd, dtype=torch.bfloat16, g=g)
        v_cache[slots] = randn(n, kv_heads, hd, dtype=torch.bfloat16, g=g)
    k_cache[tables[5, 3] * block_size + 5] *= 8  # a key of the 200-position context far above the others
    q = randn(len(lens), heads, hd, dtype=torch.bfloat16, g=g) * 3
    args = q, k_cache, v_cache, tables, torch.tensor(lens), block_size, hd ** -0.5
    ours = cpp.paged_decode(*args)
    clean = q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), *args[3:]  # torch's 0 x NaN would be NaN
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, TorchKernels.paged_decode(*clean), **tol(torch.bfloat16))


# what the AMX tiles' kernel (bf16, head_dim 32 and 64, where the CPU has AMX) does besides the cases above: the
# engine's blocks of 16, contexts of many 32-key blocks ending mid-block, and a running max that moves after the
# first block (a later key scoring far above the earlier ones, by more than the 2^8 it lets probabilities reach) or
# by hundreds (the earlier keys' weights vanish)
@pytest.mark.parametrize("hd", [64, 32])
@pytest.mark.parametrize("n,ctx,boost", [(100, 100, 1.0), (45, 301, 1.0), (70, 200, 8.0), (33, 97, 60.0)])
def test_prefill_attention_with_blocks_of_16_and_a_moving_max_matches_torch(hd, n, ctx, boost):
    g = torch.Generator().manual_seed(ctx)
    block_size, num_blocks = 16, 3 + -(-ctx // 16)
    k = randn(num_blocks * block_size, 3, hd, dtype=torch.float32, g=g)
    v = randn(num_blocks * block_size, 3, hd, dtype=torch.float32, g=g)
    blocks = torch.randperm(num_blocks, generator=g)[:-(-ctx // block_size)]
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:ctx]
    k[slots[40::37]] *= boost  # every 37th key from the 41st: each outscores all before it for the queries that agree
    q = randn(n, 9, hd, dtype=torch.float32, g=g)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    args = (blocks, ctx, block_size, hd ** -0.5)
    expected = TorchKernels.prefill_attention(q.float(), k.float(), v.float(), *args)
    torch.testing.assert_close(cpp.prefill_attention(q, k, v, *args).float(), expected, **tol(torch.bfloat16))


@pytest.mark.skipif(not (cpp is not None and "avx512f" in open("/proc/cpuinfo").read()),
                    reason="the AVX2 build is tested where the native one is AVX-512")
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_avx2_loops_match_torch(dtype):
    avx2 = load_kernels("avx2")
    for heads, kv_heads, hd in [(9, 3, 64), (10, 2, 128), (4, 4, 8)]:
        args = paged_decode_case(dtype, heads, kv_heads, hd)
        torch.testing.assert_close(avx2.paged_decode(*args), TorchKernels.paged_decode(*args), **tol(dtype))


def prefill_case(dtype, heads, kv_heads, hd, n, ctx, seed=0):
    g = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 4, 2 + -(-ctx // 4)
    k_cache = randn(num_blocks * block_size, kv_heads, hd, dtype=dtype, g=g)
    v_cache = randn(num_blocks * block_size, kv_heads, hd, dtype=dtype, g=g)
    blocks = torch.randperm(num_blocks, generator=g)[:-(-ctx // block_size)]
    q = randn(n, heads, hd, dtype=dtype, g=g) * 3
    return q, k_cache, v_cache, blocks, ctx, block_size, hd ** -0.5


# the flash loops (a task: 16 positions of a group; keys 64 at a time) take fp32 on AVX-512 and bf16 with AVX-512 BF16
# for head_dim 16-256, 24 takes the gather and SDPA (as AVX2 takes every case); chunks whose context is longer than
# their queries (chunked prefill), contexts ending mid-block and mid-chunk, positions not a multiple of 16
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,hd,n,ctx", [(9, 3, 64, 37, 37), (9, 3, 64, 20, 150), (9, 3, 64, 64, 64),
                                                     (6, 1, 128, 5, 70), (8, 2, 16, 17, 40), (4, 4, 32, 1, 1),
                                                     (2, 1, 256, 33, 33), (10, 2, 128, 48, 129), (6, 2, 24, 10, 30)])
def test_prefill_attention_matches_torch(dtype, heads, kv_heads, hd, n, ctx):
    q, k_cache, v_cache, *rest = prefill_case(dtype, heads, kv_heads, hd, n, ctx)
    expected = TorchKernels.prefill_attention(q.float(), k_cache.float(), v_cache.float(), *rest)
    torch.testing.assert_close(cpp.prefill_attention(q, k_cache, v_cache, *rest).float(), expected, **tol(dtype))


@pytest.mark.skipif(not (cpp is not None and "avx512f" in open("/proc/cpuinfo").read()),
                    reason="the AVX2 build is tested where the native one is AVX-512")
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_in_the_avx2_build_matches_torch(dtype):  # SDPA there, the build's fallback
    avx2 = load_kernels("avx2")
    for case in [(9, 3, 64, 37, 37), (9, 3, 64, 20, 150), (10, 2, 128, 48, 129), (4, 4, 8, 3, 9)]:
        q, k_cache, v_cache, *rest = prefill_case(dtype, *case)
        expected = TorchKernels.prefill_attention(q.float(), k_cache.float(), v_cache.float(), *rest)
        torch.testing.assert_close(avx2.prefill_attention(q, k_cache, v_cache, *rest).float(), expected, **tol(dtype))


needs_one_row = pytest.mark.skipif(cpp is None or not cpp.one_row_linear_native(),
                                   reason="no AVX-512 BF16 here: the one-row loop is not used")


def row_layer(out_features: int, in_features: int, bias: bool) -> tuple[torch.nn.Linear, PackedLinear]:
    """A random bf16 linear and its PackedLinear with the C++ row ops (the weights in pairs)."""
    torch.manual_seed(out_features + in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    return linear, PackedLinear(linear, one_row_ops(cpp, torch.bfloat16))


def assert_rows_match_torch(linear: torch.nn.Linear, layer: PackedLinear, counts: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(linear.in_features)
    for rows in counts:
        x = randn(rows, linear.in_features, dtype=torch.bfloat16, g=g)
        expected = torch.nn.functional.linear(x.float(), linear.weight.float(),
                                              None if linear.bias is None else linear.bias.float())
        torch.testing.assert_close(layer(x).float(), expected, **tol(torch.bfloat16))


@needs_one_row
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features,in_features", [(576, 576), (37, 6), (16, 1536), (49, 10)])
def test_one_row_linear_matches_torch(out_features, in_features, bias):
    linear, layer = row_layer(out_features, in_features, bias)
    assert_rows_match_torch(linear, layer, (1, 3))  # 3: oneDNN's packed weights, or AMX's tiles where the CPU has AMX
    with pytest.raises(RuntimeError, match="one contiguous bfloat16 row"):
        cpp.one_row_linear(torch.zeros(2, in_features, dtype=torch.bfloat16), layer.pairs, layer.row_bias)
    with pytest.raises(RuntimeError, match="w must be"):
        cpp.one_row_linear(torch.zeros(1, in_features + 2, dtype=torch.bfloat16), layer.pairs, layer.row_bias)


needs_amx = pytest.mark.skipif(cpp is None or not cpp.amx_linear_native(),
                               reason="no AMX here: a few bf16 rows run on oneDNN")


@needs_amx
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features,in_features", [(576, 576), (40, 64), (16, 1536), (50, 96), (600, 576),
                                                     (40, 608)])
def test_amx_linear_matches_torch_at_any_rows(out_features, in_features, bias):
    linear, layer = row_layer(out_features, in_features, bias)
    assert all(layer.kernel_call(rows, torch.bfloat16) is not None for rows in (1, 2, 64, 65, 512))
    # every count of tiles up to 64 (K in 2-3 chunks at 48-64 rows of 576-608 inputs: chunks of equal and of unequal
    # steps, groups of panels whole and short); above, blocks of 32 rows and pairs of panels, the last block short or
    # whole
    assert_rows_match_torch(linear, layer, (2, 3, 15, 16, 17, 33, 48, 63, 64, 65, 80, 96, 100, 129))
    with pytest.raises(RuntimeError, match="contiguous bfloat16 rows"):
        cpp.amx_linear(torch.zeros(in_features, 3, dtype=torch.bfloat16).t(), layer.pairs, layer.row_bias)
    with pytest.raises(RuntimeError, match="w must be"):
        cpp.amx_linear(torch.zeros(2, in_features + 32, dtype=torch.bfloat16), layer.pairs, layer.row_bias)


@needs_amx
def test_a_prefills_rows_of_a_wide_linear_stay_on_onednn():  # inferd.kernels.select.DENSE_BF16: faster there
    linear, layer = row_layer(1040, 64, True)
    assert layer.kernel_call(64, torch.bfloat16) is not None and layer.kernel_call(65, torch.bfloat16) is None
    assert_rows_match_torch(linear, layer, (64, 65, 100))
    g = torch.Generator().manual_seed(1)
    x = randn(100, 64, dtype=torch.bfloat16, g=g)  # the kernel itself takes them
    torch.testing.assert_close(cpp.amx_linear(x, layer.pairs, layer.row_bias)[:, :1040].float(),
                               torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float()),
                               **tol(torch.bfloat16))


@needs_amx
def test_amx_rows_need_k_a_multiple_of_32():
    linear, layer = row_layer(16, 48, False)
    assert layer.kernel_call(1, torch.bfloat16) is not None and layer.kernel_call(4, torch.bfloat16) is None
    assert_rows_match_torch(linear, layer, (4,))  # oneDNN serves its rows above one


@needs_one_row
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features,in_features", [(3072, 576), (64, 64), (96, 608), (32, 1536)])
def test_a_gated_projection_is_its_linear_then_silu_mul_bit_for_bit(out_features, in_features, bias):
    linear, layer = row_layer(out_features, in_features, bias)
    gated, plain = layer.gated_op(torch.bfloat16, cpp.silu_mul), layer.op(torch.bfloat16)
    g = torch.Generator().manual_seed(out_features)
    counts = (1, 2, 3, 15, 16, 17, 33, 47, 48, 49, 63, 64, 65, 100, 129) if cpp.amx_linear_native() else (1, 2, 65)
    for rows in counts:  # every count of tiles, K in chunks or not, groups of units whole and short; oneDNN above 64
        x = randn(rows, in_features, dtype=torch.bfloat16, g=g)
        assert torch.equal(gated(x), cpp.silu_mul(plain(x))), rows
    assert layer.kernel_call(1, torch.bfloat16, gated=True)[3] == out_features // 2
    assert layer.kernel_call(65, torch.bfloat16, gated=True) is None  # a prefill's: oneDNN, then silu_mul
    if cpp.amx_linear_native():  # the kernel itself takes a prefill's rows too
        x = randn(100, in_features, dtype=torch.bfloat16, g=g)
        assert torch.equal(cpp.amx_gated(x, layer.pairs, layer.row_bias),
                           cpp.silu_mul(cpp.amx_linear(x, layer.pairs, layer.row_bias)))


@needs_one_row
@pytest.mark.parametrize("out_features,in_features", [(4000, 576), (40, 64)])
def test_logits_are_written_in_float32_unrounded(out_features, in_features):
    linear, layer = row_layer(out_features, in_features, True)
    logits = layer.float_op(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    counts = (1, 2, 17, 48, 64, 65) if cpp.amx_linear_native() else (1, 2, 65)
    for rows in counts:  # 65: oneDNN's bf16 outputs, cast
        x = randn(rows, in_features, dtype=torch.bfloat16, g=g)
        y = logits(x)
        expected = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
        assert y.dtype == torch.float32 and y.shape == (rows, out_features)
        rounded = rows > 64 or rows > 1 and not cpp.amx_linear_native()
        torch.testing.assert_close(y, expected, **(tol(torch.bfloat16) if rounded else {"rtol": 1e-5, "atol": 1e-5}))


@needs_one_row
def test_a_projection_whose_halves_are_not_whole_panels_is_not_gated_in_one_op():
    linear, layer = row_layer(48, 64, False)  # halves of 24 outputs
    assert layer.kernel_call(1, torch.bfloat16, gated=True) is None and layer.kernel_call(1, torch.bfloat16)
    x = randn(1, 64, dtype=torch.bfloat16, g=torch.Generator().manual_seed(0))
    assert torch.equal(layer.gated_op(torch.bfloat16, cpp.silu_mul)(x), cpp.silu_mul(layer(x)))
    with pytest.raises(RuntimeError, match="halves must be whole panels"):
        cpp.one_row_gated(x, layer.pairs[:3].contiguous(), torch.empty(0))


needs_bf16w = pytest.mark.skipif(cpp is None or not cpp.bf16w_linear_native(), reason="no C++ kernels built here")


def panel_layer(out_features: int, in_features: int, bias: bool) -> tuple[torch.nn.Linear, PanelLinear]:
    """A random float32 linear whose weights are bf16 values, and its PanelLinear (the weights kept in bf16)."""
    torch.manual_seed(out_features + in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    linear.weight.data = linear.weight.data.bfloat16().float()
    return linear, PanelLinear(linear, cpp)


@needs_bf16w
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features,in_features", [(576, 576), (40, 6), (16, 1536), (49, 10)])
def test_float32_rows_on_bf16_weights_match_float64(out_features, in_features, bias):
    linear, layer = panel_layer(out_features, in_features, bias)
    g = torch.Generator().manual_seed(in_features)
    for rows in (0, 1, 2, 3, 4, 5, 8, 13, 70):  # none (a prefill chunk wanting no logits), blocks of 4 and each tail
        x = randn(rows, in_features, dtype=torch.float32, g=g)
        expected = torch.nn.functional.linear(x.double(), linear.weight.double(),
                                              None if linear.bias is None else linear.bias.double())
        y = layer(x)
        assert y.dtype == torch.float32 and y.shape == (rows, out_features)
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="contiguous float32 rows"):
        cpp.bf16w_linear(torch.zeros(in_features, 2).t(), layer.panels, layer.bias)
    with pytest.raises(RuntimeError, match="w must be"):
        cpp.bf16w_linear(torch.zeros(1, in_features + 1), layer.panels, layer.bias)


@needs_bf16w
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_a_gated_projection_on_bf16_weights_is_its_linear_then_silu_mul(rows):
    _, layer = panel_layer(2 * 48, 64, True)
    x = randn(rows, 64, dtype=torch.float32, g=torch.Generator().manual_seed(rows))
    # the same float32 sums and vector silu; -ffast-math may contract the products differently where it is inlined
    torch.testing.assert_close(layer.gated_op(torch.float32, cpp.silu_mul)(x), cpp.silu_mul(layer(x)), rtol=1e-6,
                               atol=1e-7)
    _, odd = panel_layer(2 * 40, 64, False)  # halves that are not whole panels: its linear, then silu_mul
    assert odd.kernel_call(1, torch.float32, gated=True) is None
    assert torch.equal(odd.gated_op(torch.float32, cpp.silu_mul)(x), cpp.silu_mul(odd(x)))


def test_panel_weights_put_each_panels_outputs_in_the_widening_order():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)  # output o, input k: 3 o + k
    panels = panel_weights(w)
    assert panels.shape == (2, 3, 16) and panels.dtype == torch.bfloat16
    assert panels[0, 1].tolist() == [3 * o + 1 for o in (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)]
    assert panels[1, 0, :4].tolist() == [48, 51, 54, 57] and not panels[1, :, 4:].any()  # outputs 16-19, then zeros


def test_one_row_weights_only_for_bf16_on_the_cpp_ops():
    assert one_row_ops(TorchKernels, torch.bfloat16) is None
    assert one_row_ops(cpp, torch.float32) is None
    assert (one_row_ops(cpp, torch.bfloat16) is cpp) == cpp.one_row_linear_native()


def test_ops_refuse_other_dtypes_and_the_engine_falls_back():
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpp.silu_mul(torch.zeros(2, 4, dtype=torch.float16))
    assert kernels_for(torch.float16) is TorchKernels
    assert kernels_for(torch.bfloat16, cpp=False) is TorchKernels
    assert kernels_for(torch.bfloat16) is cpp


def test_ops_refuse_mismatched_shapes_instead_of_reading_past_them():
    with pytest.raises(RuntimeError, match=r"weight: \[n\]"):
        cpp.rms_norm(torch.zeros(2, 8), torch.zeros(4), 1e-5)
    with pytest.raises(RuntimeError, match="2 I"):
        cpp.silu_mul(torch.zeros(2, 7))
    cache = torch.zeros(8, 1, 4)
    with pytest.raises(RuntimeError, match="block table and a context length per query"):
        cpp.paged_decode(torch.zeros(2, 1, 4), cache, cache, torch.zeros(1, 2, dtype=torch.long),
                         torch.tensor([1, 1]), 4, 1.0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpp.paged_decode(torch.zeros(1, 1, 4), cache, cache, torch.tensor([[5]]), torch.tensor([3]), 4, 1.0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpp.prefill_attention(torch.zeros(3, 1, 4), cache, cache, torch.tensor([0, 9]), 6, 4, 1.0)
    with pytest.raises(RuntimeError, match="n <= ctx"):
        cpp.prefill_attention(torch.zeros(3, 1, 4), cache, cache, torch.tensor([0]), 2, 4, 1.0)


def test_the_engine_on_torch_ops_and_on_the_cpp_ops_gives_the_same_greedy_tokens():
    from tests.engine.test_engine import greedy, make_engine, prompts, run
    reqs = {f"r{i}": (p, greedy(10)) for i, p in enumerate(prompts(5, seed=41))}
    torch_ops, _, _ = run(make_engine(cpp_kernels=False), reqs)  # one RoPE rotation per forward, all layers
    assert make_engine(cpp_kernels=False).runner.model.kernels is TorchKernels
    assert torch_ops == run(make_engine(), reqs)[0]
