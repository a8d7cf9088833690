"""Which kernel runs: `plan(dtype, fmt, rows)` of what the CPU reports (inferd.kernels.variants.cpu_flags, or flags
passed in), and the weight format and dtype that `auto` picks. The rules are the tables below, each row with the
result that chose it (under benchmarks/results/); docs/kernels.md tells the measurements behind them. The engine,
the linears (inferd.models.packed, int4, quant) and the decode loop ask here; nothing else reads the CPU's flags.
"""
from dataclasses import dataclass

from inferd.kernels.variants import best, cpu_flags

INF = 1 << 62


@dataclass(frozen=True)
class Plan:
    linear: str  # what a linear of the format runs these rows on (below)
    attention: str  # what decode attention runs on (attention())
    decode_loop: bool  # whether the C++ decode loop can call this linear (a step runs there where all its can)


# one_row, amx: our bf16 loops on the weights in pairs (packed.py); int4, int4_int8: our 4-bit kernel, its inputs
# rounded to 16 bits or to int8; int4_torch: torch's 4-bit kernel; int8: our int8 kernel; int8_torch: torch's;
# onednn: oneDNN's prepacked dense product (for int4: the layer's dense copy).
OURS = frozenset({"one_row", "amx", "int4", "int4_int8"})  # what the C++ decode loop calls

# Dense bf16: (the CPU has, rows from, rows to, at most this many outputs, kernel; the result that chose it).
# The first row that matches serves; none: oneDNN.
DENSE_BF16 = (
    ({"avx512_bf16"}, 1, 1, INF, "one_row"),  # benchmarks/linears.py, a Sapphire Rapids: 21-22 GB/s, oneDNN 18-19
    ({"amx_bf16"}, 2, 64, INF, "amx"),  # amx-linear-shapes-emr.md: decode rows, every linear
    ({"amx_bf16"}, 65, INF, 1024, "amx"),  # amx-linear-shapes-emr.md: 576 outputs 2,100-2,630 GFLOP/s vs 1,290-1,530
)

# int4: (the CPU has, rows' dtype, our kernel or torch's, int8 inputs from, dense above; the result that chose it).
# The first row that matches serves; None: never.
INT4 = (
    ({"avx512f"}, "float32", True, 4, 192),  # int4-linear-fp32-emr.md: 0.98x dense at 192 rows, 1.04x at 256
    ({"avx2", "fma"}, "float32", True, 4, None),  # int4-linear-fp32-avx2-code-emr.md: 0.69x dense at 1,024
    ({"amx_bf16"}, "bfloat16", True, 4, 24),  # int4-linear-emr-int8.md: 0.92x dense at 24 rows, 1.07x at 32
    ({"amx_bf16"}, "bfloat16", False, None, 24),  # int4-linear-emr-int8.md (torch's kernel: as ours)
    ({"avx512_bf16", "avx512_vnni"}, "bfloat16", True, 4, 64),  # int4-linear-zen4.md: 0.93x at 64;
    # int4-int8-inputs-after-int16-rows-zen4.md: int8 inputs 1.26x at 4 rows, 1.02-1.09x at 1-3
    ({"avx512_bf16"}, "bfloat16", False, None, 4),  # quant-zen4-avx512bf16.md: torch's 0.5x bf16 at 1-2 rows, even at 4
    (set(), "bfloat16", False, None, 1),  # bf16 emulated: torch's kernel for one row only
)

# int8 (lm_head of an int4 model): our kernel up to this many rows, oneDNN's bf16 above (cpu-kernels.json: 1.0 vs
# 2.7 ms at one row, 1.3 vs 2.3 at three, even at four, on a Zen 4)
INT8_HEAD_MAX_ROWS = 3


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """bf16 matmuls run natively (AMX or AVX-512 BF16); elsewhere they are emulated and slower than float32."""
    return bool({"amx_bf16", "avx512_bf16"} & (cpu_flags() if flags is None else flags))


def bf16_weights(flags: frozenset[str] | None = None) -> bool:
    """`--dtype auto` without quantization keeps the linears' weights in bf16 and runs float32 rows on them (our
    bf16w_linear, every row count) where bf16 is not native and the CPU has AVX2 without AVX-512 (faster than oneDNN's
    float32 product at every row count measured, 1-1,024: bf16w-linear-zen3-avx2.md). Not measured where AVX-512
    widens oneDNN's float32 product: float32 weights there."""
    flags = cpu_flags() if flags is None else flags
    return {"avx2", "fma"} <= flags and "avx512f" not in flags and not native_bf16(flags)


def int4_rule(dtype: str, ours: bool, flags: frozenset[str] | None = None) -> tuple[int | None, int | None] | None:
    """(int8 inputs from, dense above) of an int4 linear with `dtype` rows on our kernel (ours) or torch's; None where
    that kernel does not take such rows."""
    flags = cpu_flags() if flags is None else flags
    for needs, rows_dtype, own, int8_from, dense_above in INT4:
        if needs <= flags and rows_dtype == dtype and own == ours:
            return int8_from, dense_above
    return None


def plan(dtype: str, fmt: str, rows: int, out_features: int = 0, ours: bool = True,
         flags: frozenset[str] | None = None) -> Plan:
    """The kernels for `rows` rows of `dtype` ("bfloat16", "float32") through linears in `fmt` ("none", "int4",
    "int8") of `out_features` outputs, where the C++ kernels are there (ours) or not, on a CPU with `flags`."""
    flags = cpu_flags() if flags is None else flags
    variant = best(flags) if ours else None
    ours = variant is not None
    linear = "onednn"
    if fmt == "none" and dtype == "bfloat16" and ours:
        linear = next((kernel for needs, low, high, max_out, kernel in DENSE_BF16
                       if needs <= flags and low <= rows <= high and out_features <= max_out), "onednn")
    elif fmt == "int4":
        rule = int4_rule(dtype, True, flags) if ours else None
        own = rule is not None  # ours takes float32 rows on AVX2, bf16 rows with AVX-512 BF16; else torch's (bf16)
        if rule is None and dtype == "bfloat16":
            rule = int4_rule(dtype, False, flags)
        if rule is not None:
            int8_from, dense_above = rule
            if dense_above is None or rows <= dense_above:
                linear = "int4_torch" if not own else "int4_int8" if int8_from and rows >= int8_from else "int4"
    elif fmt == "int8":
        linear = "int8" if ours else "int8_torch"
    return Plan(linear, attention(dtype, variant), linear in OURS)


def attention(dtype: str, variant: str | None) -> str:
    """What decode attention runs on for `variant` (csrc/decode_attention.cpp chooses by its build): bf16 dot
    products with AVX-512 BF16 where there are at least twice as many sequences as threads (else the AVX-512
    loops), widened keys without a shuffle on AMX CPUs, the vector loops of the variant elsewhere; torch's gather and
    SDPA without the C++ kernels."""
    if variant is None:
        return "torch"
    if dtype == "bfloat16" and variant == "avx512_bf16":
        return "avx512_bf16_dot"
    if dtype == "bfloat16" and variant == "amx":
        return "avx512_split"
    return "avx2" if variant == "avx2" else "avx512"


def auto_quantization(dtype: str, flags: frozenset[str] | None = None) -> str:
    """The weight format `--quantization auto` picks for a `--dtype` setting: int4 with bf16 rows where bf16 is
    native, int4 with float32 rows for float32 (and for auto where bf16 is not native). engine-avx2-code-int8-inputs-
    emr.md: int4 1.29-1.60x int8's decode; quant-quality-int4-int8-inputs-avx2-code-emr.md: perplexity +1.2 %."""
    if dtype in ("auto", "float32") or (dtype == "bfloat16" and native_bf16(flags)):
        return "int4"
    return "none"
