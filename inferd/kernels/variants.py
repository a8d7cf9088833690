"""The kernels' builds, one per x86-64 family, and the one this process runs.

`pip install` (setup.py) compiles csrc/ once per variant below into its own extension module,
`inferd/kernels/_C_<variant>`; the running process imports the best one its CPU reports, as llama.cpp's CPU
backends are chosen. A wheel built with `pip wheel .` therefore runs on any x86-64 machine with AVX2, without a
compiler; on one without AVX2 (or where no variant was built) torch's ops serve. This module is also the one place
that reads the CPU's flags: everything that asks what the CPU can do asks `cpu_flags()`.

INFERD_KERNEL_ISA caps the variant (e.g. `avx2` on an AVX-512 machine, to run an AVX2 machine's code here) and the
flags `cpu_flags()` reports with it, so every rule picks what that machine would. INFERD_NO_CPP_KERNELS turns the
compiled kernels off.

Working on a kernel: `make kernels` rebuilds the variants this CPU runs, in place, recompiling only what changed.
"""
import functools
import importlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("norms.cpp", "decode_attention.cpp", "prefill_attention.cpp", "sampling.cpp", "linears_bf16.cpp",
           "linears_f32.cpp", "int4.cpp", "int8.cpp", "decode_loop.cpp", "bindings.cpp")
# -ffast-math at compile time only (so that exp vectorizes; int4.cpp, int8.cpp and decode_loop.cpp turn it off by
# pragma), not at link: no flush-to-zero start-up code in the process.
COMMON_FLAGS = ("-O3", "-g0", "-fopenmp", "-ffast-math", "-fvisibility=hidden")  # -g0: Python's build flags carry -g

# x86-64-v3, as /proc/cpuinfo names its parts
V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
BF16 = V4 | {"avx512_vnni", "avx512_bf16"}
AMX = BF16 | {"amx_tile", "amx_bf16", "amx_int8"}
# name: (the CPU flags it needs, the compiler's flags), from the least to the most
VARIANTS = {
    "avx2": (V3, ("-march=x86-64-v3",)),
    "avx512": (V4, ("-march=x86-64-v4",)),
    "avx512_bf16": (BF16, ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16")),
    "amx": (AMX, ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8")),
}
ISA_FLAGS = AMX  # the flags a variant may need: the ones INFERD_KERNEL_ISA can hide


@functools.cache
def host_flags() -> frozenset[str]:
    """The flags /proc/cpuinfo reports for this CPU (none where it cannot be read)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return frozenset()
    return frozenset(word for line in text.splitlines() if line.startswith("flags") for word in line.split()[2:])


def runnable(flags: frozenset[str]) -> list[str]:
    """The variants a CPU with `flags` runs, from the least to the most."""
    return [name for name, (needs, _) in VARIANTS.items() if needs <= flags]


def isa_cap() -> str | None:
    """INFERD_KERNEL_ISA, checked: the most capable variant this process may use."""
    cap = os.environ.get("INFERD_KERNEL_ISA") or None
    if cap is not None and cap not in VARIANTS:
        raise ValueError(f"INFERD_KERNEL_ISA={cap!r}: expected one of {', '.join(VARIANTS)}")
    return cap


def cpu_flags(host: frozenset[str] | None = None, cap: str | None = None) -> frozenset[str]:
    """What the rules may use: the host's flags (this CPU's by default), less the instruction sets above `cap`
    (INFERD_KERNEL_ISA's by default)."""
    host = host_flags() if host is None else host
    cap = isa_cap() if cap is None else cap
    return host if cap is None else host - (ISA_FLAGS - VARIANTS[cap][0])


def best(flags: frozenset[str] | None = None) -> str | None:
    """The most capable variant these flags (cpu_flags() by default) run; None below AVX2."""
    names = runnable(cpu_flags() if flags is None else flags)
    return names[-1] if names else None


def resolve(isa: str = "native") -> str | None:
    """A variant's name: "native" is the best this process may run."""
    if isa == "native":
        return best()
    if isa not in VARIANTS:
        raise ValueError(f"unknown kernel variant {isa!r}: expected native or one of {', '.join(VARIANTS)}")
    return isa if isa in runnable(host_flags()) else None


def load_kernels(isa: str = "native"):
    """The compiled kernels of a variant ("native": the best this CPU runs), or None where there are none: turned
    off, a CPU below AVX2 or one without that variant's instructions, or not built (torch's ops serve)."""
    if os.environ.get("INFERD_NO_CPP_KERNELS"):
        return None
    name = resolve(isa)
    return None if name is None else _import(name)


@functools.cache
def _import(name: str):
    import torch  # noqa: F401  (the module links torch's libraries, which importing torch loads)

    try:
        module = importlib.import_module(f"inferd.kernels._C_{name}")
    except ImportError as e:
        log.warning("the C++ kernels for %s are not built (%s); torch's ops serve (reinstall inferd where a C++ "
                    "compiler is, or in a source checkout run `make kernels`)", name, e)
        return None
    checkout = (CSRC.parents[2] / "setup.py").exists()  # a source tree (make kernels), not an installed wheel
    stale = [p.name for p in CSRC.glob("*") if p.stat().st_mtime > Path(module.__file__).stat().st_mtime]
    if checkout and stale:
        log.warning("the C++ kernels for %s are older than %s: `make kernels` rebuilds them", name, ", ".join(stale))
    return module
