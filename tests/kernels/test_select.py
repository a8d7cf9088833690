"""Which kernel runs, as a table: CPU class x dtype x weight format x rows -> the plan, with the CPUs' flags
injected, so it runs on any machine; and the layers built here run what the plan says."""
import pytest
import torch
from torch import nn

from inferd.kernels import select, variants
from tests.kernels.test_variants import SAPPHIRE_RAPIDS, SKYLAKE_X, V3, ZEN4

OLD = "sse4_2 avx"
CPUS = {"old": OLD, "avx2": V3, "skylake_x": SKYLAKE_X, "zen4": ZEN4, "sapphire_rapids": SAPPHIRE_RAPIDS}

# (cpu, dtype, format, rows, out_features) -> (linear, attention, decode loop)
TABLE = [
    # dense bf16: one row on our loop with AVX-512 BF16, 2-64 rows (and more, up to 1,024 outputs) on AMX tiles
    ("avx2", "bfloat16", "none", 1, 576, "onednn", "avx2", False),
    ("skylake_x", "bfloat16", "none", 1, 576, "onednn", "avx512", False),
    ("zen4", "bfloat16", "none", 1, 576, "one_row", "avx512_bf16_dot", True),
    ("zen4", "bfloat16", "none", 2, 576, "onednn", "avx512_bf16_dot", False),
    ("sapphire_rapids", "bfloat16", "none", 1, 576, "one_row", "avx512_split", True),
    ("sapphire_rapids", "bfloat16", "none", 64, 3072, "amx", "avx512_split", True),
    ("sapphire_rapids", "bfloat16", "none", 65, 576, "amx", "avx512_split", True),
    ("sapphire_rapids", "bfloat16", "none", 65, 3072, "onednn", "avx512_split", False),
    ("zen4", "float32", "none", 1, 576, "onednn", "avx512", False),
    ("old", "bfloat16", "none", 1, 576, "onednn", "torch", False),
    # int4, float32 rows: our AVX2 loops at every row count, int8 inputs from 4; dense above 192 with AVX-512
    ("avx2", "float32", "int4", 1, 576, "int4", "avx2", True),
    ("avx2", "float32", "int4", 4, 576, "int4_int8", "avx2", True),
    ("avx2", "float32", "int4", 4096, 576, "int4_int8", "avx2", True),
    ("skylake_x", "float32", "int4", 192, 576, "int4_int8", "avx512", True),
    ("skylake_x", "float32", "int4", 193, 576, "onednn", "avx512", False),
    ("old", "float32", "int4", 1, 576, "onednn", "torch", False),
    # int4, bf16 rows: ours with AVX-512 BF16 (dense above 64, above 24 on AMX CPUs); torch's elsewhere (1 or 4 rows)
    ("zen4", "bfloat16", "int4", 3, 576, "int4", "avx512_bf16_dot", True),
    ("zen4", "bfloat16", "int4", 4, 576, "int4_int8", "avx512_bf16_dot", True),
    ("zen4", "bfloat16", "int4", 65, 576, "onednn", "avx512_bf16_dot", False),
    ("sapphire_rapids", "bfloat16", "int4", 24, 576, "int4_int8", "avx512_split", True),
    ("sapphire_rapids", "bfloat16", "int4", 25, 576, "onednn", "avx512_split", False),
    ("avx2", "bfloat16", "int4", 1, 576, "int4_torch", "avx2", False),
    ("avx2", "bfloat16", "int4", 2, 576, "onednn", "avx2", False),
    ("skylake_x", "bfloat16", "int4", 1, 576, "int4_torch", "avx512", False),
    # int8
    ("avx2", "float32", "int8", 8, 576, "int8", "avx2", False),
    ("old", "float32", "int8", 8, 576, "int8_torch", "torch", False),
]


@pytest.mark.parametrize("cpu,dtype,fmt,rows,out,linear,attention,loop", TABLE)
def test_the_plan_of_each_cpu_dtype_format_and_rows(cpu, dtype, fmt, rows, out, linear, attention, loop):
    flags = frozenset(CPUS[cpu].split())
    assert select.plan(dtype, fmt, rows, out, flags=flags) == select.Plan(linear, attention, loop)


def test_without_the_cpp_kernels_torch_and_onednn_serve():
    flags = frozenset(ZEN4.split())
    assert select.plan("bfloat16", "int4", 1, ours=False, flags=flags) == select.Plan("int4_torch", "torch", False)
    assert select.plan("bfloat16", "int4", 5, ours=False, flags=flags).linear == "onednn"
    assert select.plan("bfloat16", "none", 1, ours=False, flags=flags).linear == "onednn"


@pytest.mark.parametrize("cpu,dtype,expected", [("avx2", "auto", "int4"), ("avx2", "bfloat16", "none"),
                                                ("zen4", "bfloat16", "int4"), ("zen4", "float32", "int4")])
def test_auto_quantization(cpu, dtype, expected):
    assert select.auto_quantization(dtype, frozenset(CPUS[cpu].split())) == expected


@pytest.mark.parametrize("cpu,expected", [("avx2", True), ("skylake_x", False), ("zen4", False),
                                          ("sapphire_rapids", False), ("old", False)])
def test_bf16_weights_for_float32_rows_where_avx2_is_the_widest(cpu, expected):
    assert select.bf16_weights(frozenset(CPUS[cpu].split())) is expected


needs_kernels = pytest.mark.skipif(variants.load_kernels() is None, reason="no C++ kernels built for this CPU")


@needs_kernels
def test_the_int4_layers_built_here_run_what_the_plan_says():
    from inferd.models.int4 import Int4Linear, takes
    from inferd.models.int4_kernel import load_int4_kernel

    kernel = load_int4_kernel()
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        if not takes(kernel, dtype):
            continue
        layer = Int4Linear(nn.Linear(64, 48), select.int4_rule(name, True)[1], kernel, dtype)
        for rows in (1, 2, 3, 4, 5, 24, 25, 64, 65, 192, 193, 1024):
            at = layer.kernel_at(rows)
            assert (at.__name__.replace("_linear", "") if at else "onednn") == select.plan(name, "int4", rows).linear


@needs_kernels
def test_the_bf16_layers_built_here_run_what_the_plan_says():
    from inferd.models.packed import PackedLinear, can_pack, one_row_ops

    if not can_pack(torch.bfloat16):
        pytest.skip("oneDNN packs no bf16 weights on this CPU")

    ops = one_row_ops(variants.load_kernels(), torch.bfloat16)
    for out in (48, 1040):
        layer = PackedLinear(nn.Linear(64, out).to(torch.bfloat16), ops)
        for rows in (1, 2, 64, 65):
            name = layer._row_kernel(rows, torch.bfloat16)
            expected = select.plan("bfloat16", "none", rows, out).linear
            amx_denied = expected == "amx" and not layer.amx  # the OS may refuse the tiles
            assert (name.removesuffix("_linear") if name else "onednn") == ("onednn" if amx_denied else expected)
