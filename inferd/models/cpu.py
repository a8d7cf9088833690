"""What this CPU can do fast, read once from /proc/cpuinfo: the one place the dtype rules look."""
import functools
import os
import subprocess

from inferd.kernels.build import kernel_march

# the flags the rules below read, and the macro a compiler defines where -march has that instruction set
ISA_MACROS = {"avx2": "__AVX2__", "fma": "__FMA__", "avx512f": "__AVX512F__", "avx512_bf16": "__AVX512BF16__",
              "avx512_vnni": "__AVX512VNNI__", "amx_bf16": "__AMX_BF16__"}


def cpu_flags() -> frozenset[str]:
    """This CPU's flags; under INFERD_KERNEL_MARCH (another machine's code run here, kernel_march) those of its
    instruction sets that march lacks are left out, so that every rule picks what that machine would."""
    return _flags_for(kernel_march())


@functools.cache
def _flags_for(march: str) -> frozenset[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return frozenset()
    flags = frozenset(word for line in text.splitlines() if line.startswith("flags") for word in line.split())
    if march == "native":
        return flags
    try:
        macros = subprocess.run(["c++", f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                                text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # no compiler (no kernels either) or a march it does not know
        return flags
    return frozenset(f for f in flags if f not in ISA_MACROS or f"#define {ISA_MACROS[f]} " in macros)


def has_native_bf16() -> bool:
    """bf16 matmuls run natively (AMX or AVX-512 BF16); elsewhere they are emulated and slower than fp32."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())



def int4_max_rows(own_kernel: bool, float32_rows: bool = False) -> int | None:
    """Rows of a linear up to which the int4 kernel beats its dense copy on this CPU (above: dense; None: at every
    row count, no dense copy kept); own_kernel: ours (inferd.models.int4_kernel) serves, not torch's; float32_rows:
    the layers compute in float32 (our AVX2 loops), else bf16.

    bf16, measured on an AVX-512 BF16 EPYC (Zen 4, no AMX), SmolLM2's 120 layer linears: torch's kernel 0.5x
    bf16's time at 1-2 rows, even at 4, 1.4x at 8 (benchmarks/results/quant-zen4-avx512bf16.md); ours 0.28x at
    one row, 0.56x at 8, 0.89x at 32, 0.93x at 64, even at 96 (benchmarks/results/int4-linear-zen4.md). Where
    oneDNN multiplies dense bf16 on AMX tiles (an Emerald Rapids, 2026-12-05), ours with int8 inputs from 4 rows
    0.31x the dense time at one row, 0.53x at 8, 0.76x at 16, 0.92x at 24, 1.07x at 32, 1.66x at 64
    (benchmarks/results/int4-linear-emr-int8.md): 24 there. Without native bf16 a forced bf16 int4 uses the
    kernel for one row only. float32 rows, our AVX2 loops (int8 inputs from int4_int8_rows) against oneDNN's
    float32 product in AVX2 code on an Emerald Rapids: 0.24x its time at one row, 0.44x at 64, 0.69x at 1,024
    (benchmarks/results/int4-linear-fp32-avx2-code-emr.md; with 16-bit inputs, on a Zen 4, even from 32 rows):
    never dense. Where oneDNN multiplies float32 on AVX-512, the same machine without the limits: 0.68x at 64 rows,
    0.78x at 96, 0.92x at 128, 0.98x at 192, 1.04x at 256, 1.35x at 1,024 (benchmarks/results/int4-linear-fp32-emr.md):
    192."""
    if float32_rows:
        return 192 if "avx512f" in cpu_flags() else None
    if "amx_bf16" in cpu_flags():
        return 24
    if has_native_bf16():
        return 64 if own_kernel else 4
    return 1


def int4_int8_rows(float32_rows: bool = False) -> int | None:
    """Rows from which our int4 kernel rounds its rows to int8 a group of 32 and multiplies them as integers
    (int4_linear_int8, llama.cpp's Q4_1 x Q8_1) instead of to 16 bits; None: never. float32 rows (AVX2): vpmaddubsw,
    32 products of nibble and int8 input an instruction where vpmaddwd has 16; in AVX2 code on an Emerald Rapids,
    SmolLM2's 120 layer linears 0.87x the 16-bit rows' speed at one row, 1.08-1.12x at 2-3, 1.16x at 4, 1.41-1.86x
    at 6-64 (benchmarks/results/int4-int8-inputs-avx2-code-emr.md), at 0.5 % error against the file's weights
    (16 bits: 0.01 %): 4, as for bf16 rows. bf16 rows, on VNNI. On a Zen 4
    (AVX-512 BF16 + VNNI), SmolLM2's 120 layer linears from memory: 1.02-1.09x the bf16 rows' speed at 1-3 rows,
    1.26x at 4, 1.43-1.45x at 6-16 (benchmarks/results/int4-int8-inputs-after-int16-rows-zen4.md; 1.04-1.12x at
    1-4 against the bf16 rows' vdpbf16ps loops before 2026-12-05), at 3x their error against the file's weights
    (0.54 % against 0.17 %): below 4 rows the bf16 rows cost little. On an Emerald Rapids (AMX) alike: 1.16-1.28x at
    1-3 rows, 1.30x at 4, 1.31-1.42x at 6-24 (benchmarks/results/int4-int8-inputs-emr.md)."""
    flags = cpu_flags()
    if float32_rows:
        return 4 if {"avx2", "fma"} <= flags else None
    return 4 if {"avx512_vnni", "avx512_bf16"} <= flags else None


def auto_quantization(dtype: str) -> str:
    """The weight format `--quantization auto` picks for a `--dtype` setting: int4 with bf16 rows where bf16 is
    native, int4 with float32 rows for float32 (and for auto where bf16 is not native: inferd's AVX2 loops, int8
    inputs from 4 rows). In AVX2 code on an Emerald Rapids int4 1.60x int8's decode at one stream, 1.29-1.37x at
    8-64, 1.33x its prefill; with that machine's AVX-512 1.60x at one stream, 1.42-1.50x at 8-64, prefill 1.71x
    (benchmarks/results/engine-avx2-code-int8-inputs-emr.md, engine-float32-int8-vs-int4-emr.md); perplexity
    +1.2 % of fp32 against int8's -0.1 % (quant-quality-int4-int8-inputs-avx2-code-emr.md). Until 2026-12-06 float32
    took int8 where bf16 is native. Both pass the quality checks of benchmarks/quantization.py (perplexity within
    3 % of fp32 for 4-bit, 1 % for int8); int8 serves where our int4 kernel cannot be built
    (inferd.engine.engine.resolve_quantization)."""
    if dtype in ("auto", "float32") or (dtype == "bfloat16" and has_native_bf16()):
        return "int4"
    return "none"
