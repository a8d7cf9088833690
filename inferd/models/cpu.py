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

