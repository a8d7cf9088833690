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


# Shared by the kernel modules (prepended to their sources): how their loops split work across the threads.
TASKS = r"""
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

// Tasks [0, n) split across the threads as at::parallel_for splits a range: each thread takes its own from the front,
// and one whose own are done takes another's from the back. A thread that another process preempts then holds the
// call up by the task it is in, not by the rest of its share, as a static split does (the served path's gateway,
// HTTP loop and client run on the same cores as the step's threads).
class Tasks {
 public:
  struct alignas(64) Range { std::atomic<uint64_t> ends; };  // front in the low 32 bits, back in the high
  Tasks(Range* ranges, int64_t threads, int64_t self) : ranges_(ranges), threads_(threads), self_(self) {}
  int64_t take() {  // the next task for this thread, -1 when none is left
    if (const int64_t t = take_front(ranges_[self_]); t >= 0) return t;
    for (int64_t j = 1; j < threads_; ++j)
      if (const int64_t t = take_back(ranges_[(self_ + j) % threads_]); t >= 0) return t;
    return -1;
  }
  int64_t peek() const {  // the task this thread takes next from its own share, -1 if none: a hint for prefetches
    const uint64_t e = ranges_[self_].ends.load(std::memory_order_relaxed);
    return (e & 0xffffffffu) < (e >> 32) ? int64_t(e & 0xffffffffu) : -1;
  }

 private:
  static int64_t take_front(Range& r) {
    uint64_t e = r.ends.load(std::memory_order_relaxed);
    while ((e & 0xffffffffu) < (e >> 32))
      if (r.ends.compare_exchange_weak(e, e + 1, std::memory_order_relaxed)) return int64_t(e & 0xffffffffu);
    return -1;
  }
  static int64_t take_back(Range& r) {
    uint64_t e = r.ends.load(std::memory_order_relaxed);
    while ((e & 0xffffffffu) < (e >> 32))
      if (r.ends.compare_exchange_weak(e, e - (uint64_t(1) << 32), std::memory_order_relaxed)) return int64_t(e >> 32) - 1;
    return -1;
  }
  Range* ranges_;
  int64_t threads_, self_;
};

// body(tasks) on every thread, tasks.take() giving out [0, n) (class Tasks)
template <typename F> static void steal_for(int64_t n, F&& body) {
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::unique_ptr<Tasks::Range[]> ranges(new Tasks::Range[T]);
  for (int64_t t = 0; t < T; ++t) ranges[t].ends.store(uint64_t(n * t / T) | uint64_t(n * (t + 1) / T) << 32);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      Tasks tasks(ranges.get(), T, t);
      body(tasks);
    }
  });
}
"""

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
