"""Building a C++ module: the one place the four C++ files (cpu_kernels, quant, int4_kernel, decode_loop) build.

Each module is built with torch's cpp_extension for this machine's CPU and cached per CPU and Python environment.
Besides its functions it exports `addresses()`: each function's address, by name, through which another module
of the same build (decode_loop.py) calls them from C++ without a trip through Python.
Every function it exports releases the GIL while it runs, as torch's own ops do: a replica's event loop (HTTP,
detokenization, streaming) runs Python between the engine's ops, and a kernel that held the GIL would stop it for
the kernel's whole length.
"""
import hashlib
import logging
import os
import platform
import sys
import time

from inferd.models.cpu import kernel_march

log = logging.getLogger(__name__)


def build(prefix: str, source: str, functions: list[str], march: str = "native", cflags: tuple[str, ...] = ()):
    """The module `prefix` built from `source` for `march` (kernel_march's rule), exporting `functions`.
    Raises where it cannot be built (no compiler, no ninja); the caller chooses what serves instead."""
    from torch.utils.cpp_extension import load_inline

    march = kernel_march(march)
    name = f"{prefix}_{cpu_tag()}" + ("" if march == "native" else f"_{march.replace('-', '_')}")
    _drop_stale_lock(name)
    bindings = "\n".join(f'  m.def("{f}", torch::wrap_pybind_function_no_gil({f}), "{f}");' for f in functions)
    entries = ", ".join(f'{{"{f}", reinterpret_cast<int64_t>(&{f})}}' for f in functions)
    bindings += f'\n  m.def("addresses", []() {{ return std::map<std::string, int64_t>{{{entries}}}; }});'
    return load_inline(name=name, cpp_sources=[source, f"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{bindings}\n}}"],
                       extra_cflags=["-O3", f"-march={march}", "-fopenmp", *cflags], extra_ldflags=["-fopenmp"],
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
