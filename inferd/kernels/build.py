"""Building the kernels: the C++ files of csrc/ as one extension module, compiled at run time by torch's
cpp_extension for this machine's CPU (or INFERD_KERNEL_MARCH's) and cached per CPU and Python environment.

-ffast-math at compile time only (so that exp vectorizes; int4.cpp, int8.cpp and decode_loop.cpp, which never had it,
turn it off by pragma), not at link: no flush-to-zero start-up code in the process. Every function it exports
releases the GIL while it runs, as torch's own ops do (csrc/bindings.cpp). The kernel files include only the parts
of ATen they use (csrc/aten.h); bindings.cpp alone parses torch/extension.h.

`make install` builds the module once (`python -m inferd.kernels.build`, main below), so that `inferd serve`'s first
start finds it; a start on another CPU, or after a kernel changed, builds its own at the next `load()` (any test or
`inferd serve`). To rebuild it alone:

    PYTHONPATH=. .venv/bin/python -m inferd.kernels.build [march]
"""
import functools
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("norms.cpp", "decode_attention.cpp", "prefill_attention.cpp", "sampling.cpp", "linears_bf16.cpp",
           "int4.cpp", "int8.cpp", "decode_loop.cpp", "bindings.cpp")


def kernel_march(march: str = "native") -> str:
    """-march of a C++ kernel build: `march`, where "native" (this CPU's own) gives way to INFERD_KERNEL_MARCH,
    which benchmarks set to run another machine's loops here (haswell: AVX2 alone on an AVX-512 machine, beside
    ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2 and MKL_ENABLE_INSTRUCTIONS=AVX2 for oneDNN, torch and MKL:
    benchmarks/limits.py, ISA_LIMITS)."""
    return os.environ.get("INFERD_KERNEL_MARCH", "native") if march == "native" else march


def per_march(load):
    """A loader `load(march="native")`, cached per -march it builds for: "native" is resolved (kernel_march) before
    the cache, so that a build for INFERD_KERNEL_MARCH is never handed out later as this CPU's own, nor the other
    way round."""
    cached = functools.cache(load)

    @functools.wraps(load)
    def get(march: str = "native"):
        return cached(kernel_march(march))
    return get


@per_march
def load(march: str = "native"):
    """The kernels built for `march` (kernel_march's rule), or None where they cannot be built here (no compiler,
    no ninja): the callers' torch versions serve."""
    try:
        log.info("building the C++ kernels (cached after the first time)")
        return build(march)
    except Exception as e:
        log.warning("C++ kernels unavailable (%s); using torch ops", e)
        return None


def build(march: str = "native"):
    """The module built for `march`; raises where it cannot be built."""
    from torch.utils.cpp_extension import load as load_extension

    march = kernel_march(march)
    name = f"inferd_kernels_{cpu_tag()}" + ("" if march == "native" else f"_{march.replace('-', '_')}")
    _drop_stale_lock(name)
    return load_extension(name=name, sources=[str(CSRC / s) for s in SOURCES],
                          extra_cflags=["-O3", f"-march={march}", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"],
                          verbose=False)


def cpu_tag() -> str:
    """Part of the build's cache key: a -march=native build must not be loaded on another CPU, and each Python
    environment has its own build (two venvs' include paths differ, so each would rebuild over the other's)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(f"{flags}\n{sys.prefix}".encode()).hexdigest()[:10]


def _drop_stale_lock(name: str, max_age_s: float = 600.0) -> None:
    """A process killed while building leaves torch's build lock behind, and every later load waits on it
    forever; no build of these kernels takes 10 minutes."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    try:
        if time.time() - os.path.getmtime(lock) > max_age_s:
            log.warning("removing a stale build lock %s", lock)
            os.remove(lock)
    except FileNotFoundError:
        pass


def main(argv: list[str]) -> int:
    """`python -m inferd.kernels.build [march]`: the install's step (the Makefile runs it after pip), so that the first
    start does not build. A machine that cannot build them (no compiler) still runs inferd on torch's ops: one line
    says so and the install goes on."""
    try:
        path = build(*argv[:1]).__file__
    except Exception as e:
        print(f"inferd: C++ kernels not built ({type(e).__name__}: {str(e).strip().splitlines()[-1:]}); "
              "inferd will run torch's ops instead", file=sys.stderr)
        return 0
    print(f"inferd: C++ kernels built for this CPU: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
