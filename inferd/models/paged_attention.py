"""Decode attention read straight from the paged KV cache (fp32, C++ built on first use).

The torch path gathers every decode's K and V into a padded copy and then runs
SDPA over it: three passes over the context. This kernel walks each
sequence's block table and reads K and V once, one (sequence, KV head) per
task, all query heads of the group together. Built with torch's cpp_extension
for this machine's CPU (-march=native; -ffast-math at compile time only, so
that exp vectorizes, without the flush-to-zero start-up code a fast-math link
would add to the process) and cached; where it cannot be built,
the torch path serves.
"""
import functools
import hashlib
import logging
import os
import platform

log = logging.getLogger(__name__)

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// q: [D, H, hd]; k_cache, v_cache: [slots, KVH, hd]; block_tables: [D, nb] int64; context_lens: [D] int64
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens,
                           int64_t block_size, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32, "fp32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  const int64_t D = q.size(0), H = q.size(1), hd = q.size(2), KVH = k_cache.size(1);
  const int64_t G = H / KVH, nb = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t row = KVH * hd;  // floats per cache slot
  at::parallel_for(0, D * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t d = task / KVH, h = task % KVH, len = lens[d];
      scores.assign(G * len, 0.f);
      const float* qg = qp + (d * H + h * G) * hd;
      for (int64_t t = 0; t < len; ++t) {
        const float* k = kp + (bt[d * nb + t / block_size] * block_size + t % block_size) * row + h * hd;
        for (int64_t g = 0; g < G; ++g) {
          const float* qv = qg + g * hd;
          float acc = 0.f;
          #pragma omp simd reduction(+:acc)
          for (int64_t i = 0; i < hd; ++i) acc += qv[i] * k[i];
          scores[g * len + t] = acc * (float)scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * len;
        float mx = -std::numeric_limits<float>::max();  // finite: built with -ffast-math
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { s[t] = std::exp(s[t] - mx); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      float* og = op + (d * H + h * G) * hd;
      for (int64_t i = 0; i < G * hd; ++i) og[i] = 0.f;
      for (int64_t t = 0; t < len; ++t) {
        const float* v = vp + (bt[d * nb + t / block_size] * block_size + t % block_size) * row + h * hd;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + t];
          float* o = og + g * hd;
          #pragma omp simd
          for (int64_t i = 0; i < hd; ++i) o[i] += p * v[i];
        }
      }
    }
  });
  return out;
}
"""

@functools.cache
def load_kernel():
    """The compiled module, or None where it cannot be built here."""
    if os.environ.get("INFERD_NO_CPP_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        log.info("building the paged attention kernel (cached after the first time)")
        return load_inline(name=f"inferd_paged_attention_{_cpu_tag()}", cpp_sources=SOURCE, functions=["paged_decode"],
                           extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"],
                           verbose=False)
    except Exception as e:  # no compiler, no ninja: the torch path serves
        log.warning("paged attention kernel unavailable (%s); using the torch path", e)
        return None


def _cpu_tag() -> str:
    """Part of the build's cache key: a -march=native build must not be loaded on another CPU."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:10]
