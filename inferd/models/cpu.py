"""What this CPU can do fast, read once from /proc/cpuinfo: the one place the dtype rules look."""
from functools import cache


@cache
def cpu_flags() -> frozenset[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return frozenset()
    return frozenset(word for line in text.splitlines() if line.startswith("flags") for word in line.split())


def has_native_bf16() -> bool:
    """bf16 matmuls run natively (AMX or AVX-512 BF16); elsewhere they are emulated and slower than fp32."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())



def int4_max_rows(own_kernel: bool) -> int:
    """Rows of a linear up to which the int4 kernel beats a dense bf16 matmul on this CPU (above: dense);
    own_kernel: ours (inferd.models.int4_kernel) serves, not torch's.

    Measured on an AVX-512 BF16 EPYC (Zen 4, no AMX), SmolLM2's 120 layer linears: torch's kernel 0.5x bf16's
    time at 1-2 rows, even at 4, 1.4x at 8 (benchmarks/results/quant-zen4-avx512bf16.md); ours 0.28x at one row,
    0.56x at 8, 0.89x at 32, 0.93x at 64, even at 96 (benchmarks/results/int4-linear-zen4.md). Not measured on
    AMX, where dense bf16 is faster: 2 there. Without native bf16 auto does not pick int4; a forced one uses the
    kernel for one row only."""
    if "amx_bf16" in cpu_flags():
        return 2
    if has_native_bf16():
        return 64 if own_kernel else 4
    return 1


def auto_quantization(dtype: str) -> str:
    """The weight format `--quantization auto` picks for a `--dtype` setting: int4 (bf16 activations) where
    bf16 is native, int8 (fp32 activations) elsewhere; both pass the quality checks of
    benchmarks/quantization.py (perplexity within 3 % and 1 % of fp32)."""
    if dtype in ("auto", "bfloat16") and has_native_bf16():
        return "int4"
    return "int8" if dtype in ("auto", "float32") else "none"
