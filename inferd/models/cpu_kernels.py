"""The decoder's small ops, in C++ for float32 and bfloat16 (built on first use), or in plain torch.

A decode step of a small model is mostly small ops: at one sequence, most of SmolLM2's ATen calls
per step were these (norms decomposed into casts, pow, mean and rsqrt; RoPE through complex views; two index_copy_ for
the cache; the gather, mask and SDPA of decode attention), and their dispatch cost as much as the
weight reads. Here each of these is one call:

- `rms_norm(x, w, eps)`, and `add_rms_norm(x, residual, w, eps)`: residual += x (in place), then its norm;
- `rope_cache(qkv, cos, sin, positions, k_cache, v_cache, slots, heads, kv_heads)`: RoPE on q and k
  (pairs side by side, see inferd.models.llama.interleave_halves), k and v written to their cache slots,
  the rotated q returned as [T, heads, head_dim];
- `silu_mul(gate_up)`: silu(gate) * up of the fused [T, 2I] projection (bf16 rows on the pairs' kernels take it in
  the projection's own op: `amx_gated`, `one_row_gated`, the same bits);
- `paged_decode(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)`: decode attention
  read straight from the cache blocks, one (sequence, KV head) per task, all query heads of its group
  together, K and V read once (the torch path gathers a padded copy of every context, then runs SDPA).
  Its loops are written on this CPU's vectors (AVX-512 or AVX2, chosen when it is built; scalar loops
  elsewhere and for a head_dim that is not a multiple of the width), the next block's keys and this one's
  values prefetched: 3.7-3.8x its plain-loop version in bf16 at batch 8-64, 2.1-2.6x in fp32, with K/V
  from memory (benchmarks/paged_decode.py). bf16 where the CPU has AVX-512 BF16 (head_dim 32, 64, 128) and
  there are at least twice as many sequences as threads runs on its dot products instead, K and V never
  widened, a task a whole sequence (its blocks read as one): in the engine 0.85-0.89x the attention's time at
  8-64 streams of 512 positions (benchmarks/README.md, "Decode attention on bf16 dot products"). Elsewhere on AVX-512 (AMX
  CPUs), bf16 at head_dim 32, 64, 128 is widened without a shuffle and its scores summed 8 keys at a time
  (attend_split): 0.92x the attention's time in a 64-stream decode step on an Emerald Rapids. In every loop a task's PV
  fetches the thread's next task's keys into L2 (Ahead): 1.11-1.16x with the cache in memory.
- `prefill_attention(q, k_cache, v_cache, blocks, ctx, block_size, scale)`: causal attention of a prompt chunk over
  its context, read from the cache blocks, as a flash attention on AVX-512: in bf16 on its bf16 dot products
  (vdpbf16ps, where the CPU has AVX-512 BF16), 2.4-3.7x the gather + SDPA path at SmolLM2's shapes; in fp32 on
  FMAs, 1.5-1.8x (benchmarks/prefill_attention.py). Where the CPU has AMX, bf16 at head_dim 32 and 64 runs on its
  tiles instead (SDPA's tiles were 2.3-3.6x the bf16 loops there): 1.6-2.3x the gather + SDPA path on an Emerald
  Rapids, prompts of 512-2,048 and chunks of 512 over 1,024-2,048 (the fp32 loops stay: 1.2-1.5x SDPA there). Elsewhere
  that gather + SDPA: on AVX2 the same fp32 loops were 0.7-1.1x SDPA.

Every op computes in float32 and rounds once to the tensor's dtype. `TorchKernels` is the same ops in
torch: the reference the C++ ones are tested against (tests/engine/test_cpu_kernels.py), and the path
where they cannot be built (no compiler, INFERD_NO_CPP_KERNELS set, or a dtype they do not take).
Built with torch's cpp_extension for this machine's CPU (-march=native: AVX2, AVX-512 or AVX-512 BF16,
whatever it has; -ffast-math at compile time only, so that exp vectorizes, without the flush-to-zero
start-up code a fast-math link would add to the process) and cached per CPU.
"""
import logging
import os

import torch
import torch.nn.functional as F

from inferd.models.cpp_build import build
from inferd.models.cpu import per_march

log = logging.getLogger(__name__)

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <limits>
#include <vector>
#include <atomic>
#include <cstring>
#include <optional>
#include <type_traits>

using bf16 = uint16_t;  // bfloat16 as its bits

static inline float ld(float x) { return x; }
static inline float ld(bf16 x) { return __builtin_bit_cast(float, uint32_t(x) << 16); }
template <typename T> static inline T to(float x);
template <> inline float to<float>(float x) { return x; }
template <> inline bf16 to<bf16>(float x) {  // round to nearest even, as torch rounds
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  return bf16((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename T> static T* ptr(const torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// f(T{}) with T the element type of t: float or bf16
template <typename F> static void by_dtype(const torch::Tensor& t, F&& f) {
  if (t.scalar_type() == torch::kFloat32) f(float{});
  else if (t.scalar_type() == torch::kBFloat16) f(bf16{});
  else TORCH_CHECK(false, "float32 or bfloat16 only, got ", t.scalar_type());
}

static void check(const torch::Tensor& t, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have the dtype of the input");
}

template <typename T> static void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
  #pragma omp simd reduction(+:ss)
  for (int64_t i = 0; i < n; ++i) { const float v = ld(x[i]); ss += v * v; }
  const float r = 1.f / std::sqrt(ss / n + eps);
  #pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = to<T>(ld(x[i]) * r * ld(w[i]));
}

// x: [T, n], w: [n]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.numel() == x.size(1), "x: [rows, n], weight: [n]");
  check(x, x, "x"); TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type(), "weight: contiguous, x's dtype");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty_like(x);
  by_dtype(x, [&](auto z) {
    using T = decltype(z);
    const T *xp = ptr<T>(x), *wp = ptr<T>(w); T* op = ptr<T>(out);
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) norm_row(xp + r * n, wp, op + r * n, n, (float)eps);
    });
  });
  return out;
}

// residual += x, rounded to the dtype as a torch add would; returns rms_norm(residual)
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.numel() == x.size(1), "x: [rows, n], weight: [n]");
  check(x, x, "x"); check(residual, x, "residual");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type(), "weight: contiguous, x's dtype");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must have the shape of x");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty_like(x);
  by_dtype(x, [&](auto z) {
    using T = decltype(z);
    const T *xp = ptr<T>(x), *wp = ptr<T>(w); T *rp = ptr<T>(residual), *op = ptr<T>(out);
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        T* res = rp + r * n; const T* xr = xp + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; ++i) res[i] = to<T>(ld(res[i]) + ld(xr[i]));
        norm_row(res, wp, op + r * n, n, (float)eps);
      }
    });
  });
  return out;
}

// qkv: [T, (H + 2 KVH) hd]; cos, sin: [positions, hd/2] float32; positions, slots: [T] int64;
// k_cache, v_cache: [slots, KVH, hd]. Rotates each pair (2i, 2i+1) of q and k by its angle i, writes k and v
// to their slots and returns q: [T, H, hd].
torch::Tensor rope_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                         torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, int64_t H, int64_t KVH) {
  check(qkv, qkv, "qkv"); check(k_cache, qkv, "k_cache"); check(v_cache, qkv, "v_cache");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && cos.is_contiguous() && sin.is_contiguous(), "float32 cos, sin");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slots.scalar_type() == torch::kInt64, "int64 positions, slots");
  const int64_t rows = qkv.size(0), hd = k_cache.size(2), half = hd / 2, width = qkv.size(1);
  TORCH_CHECK(qkv.dim() == 2 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(), "qkv: [T, width], caches: [slots, KVH, hd]");
  TORCH_CHECK(width == (H + 2 * KVH) * hd && k_cache.size(1) == KVH, "qkv's width must be (heads + 2 kv_heads) head_dim");
  TORCH_CHECK(positions.numel() == rows && slots.numel() == rows, "one position and slot per row");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == half, "cos, sin: [positions, head_dim / 2]");
  const int64_t num_slots = k_cache.size(0), num_positions = cos.size(0);
  auto q = torch::empty({rows, H, hd}, qkv.options());
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t *pos = positions.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(0 <= pos[t] && pos[t] < num_positions && 0 <= slot[t] && slot[t] < num_slots, "position or slot out of range");
  by_dtype(qkv, [&](auto z) {
    using T = decltype(z);
    const T* src = ptr<T>(qkv); T *qp = ptr<T>(q), *kp = ptr<T>(k_cache), *vp = ptr<T>(v_cache);
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const T* row = src + t * width;
        const float *c = cp + pos[t] * half, *s = sp + pos[t] * half;
        for (int64_t head = 0; head < H + KVH; ++head) {
          const T* x = row + head * hd;
          T* y = head < H ? qp + (t * H + head) * hd : kp + (slot[t] * KVH + head - H) * hd;
          #pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float a = ld(x[2 * i]), bb = ld(x[2 * i + 1]);
            y[2 * i] = to<T>(a * c[i] - bb * s[i]);
            y[2 * i + 1] = to<T>(a * s[i] + bb * c[i]);
          }
        }
        const T* v = row + (H + KVH) * hd; T* vo = vp + slot[t] * KVH * hd;
        for (int64_t i = 0; i < KVH * hd; ++i) vo[i] = v[i];
      }
    });
  });
  return q;
}

// Decode attention's inner loops on whole vectors of this CPU (AVX-512: 16 floats, AVX2: 8), where head_dim is a
// multiple of the width: each K or V row is loaded and widened to float32 once for the query heads of its group
// (up to 4 at a time, their q and accumulators in registers), softmax's exp is a polynomial on whole vectors.
#if defined(__AVX512F__)
#include <immintrin.h>
#define INFERD_VEC 16
using vec = __m512;
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vload(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline vec vset(float x) { return _mm512_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
static inline float vhmax(vec a) { return _mm512_reduce_max_ps(a); }
static inline int vfind(vec a, float v) {  // the first lane equal to v, or -1
  const __mmask16 m = _mm512_cmp_ps_mask(a, _mm512_set1_ps(v), _CMP_EQ_OQ);
  return m ? __builtin_ctz(m) : -1;
}
static inline vec vround(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vpow2i(vec p, vec n) { return _mm512_scalef_ps(p, n); }  // p 2^n
static inline vec vrecip(vec a) {  // 1 / a to float32's precision: a 14-bit estimate and one Newton step (no divide)
  const vec r = _mm512_rcp14_ps(a);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(a, r, _mm512_set1_ps(2.f)));
}
static inline vec vneg_where(vec x, vec a, vec b) { return _mm512_mask_blend_ps(_mm512_movepi32_mask(_mm512_castps_si512(x)), a, b); }
static inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
static inline void vstore(bf16* p, vec a) {  // rounded to nearest even, as to<bf16>
#if defined(__AVX512BF16__)
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(a));  // one instruction where the CPU has it
#else
  const __m512i u = _mm512_castps_si512(a), one = _mm512_set1_epi32(1);
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
#endif
}
static inline vec vzero_where(vec a, vec x, float bad) {  // a, with 0 where x is bad (an integer compare of the bits:
  const __mmask16 m = _mm512_cmpeq_epi32_mask(_mm512_castps_si512(x), _mm512_set1_epi32(__builtin_bit_cast(int32_t, bad)));
  return _mm512_maskz_mov_ps(~m, a);  // -ffast-math may drop a float compare with an infinity)
}
#if defined(__AVX512BF16__)
// two bf16 broadcast to every lane as a pair; vdpbf16ps: each float32 lane plus the products of its two bf16 pairs
static inline __m512i pair(const bf16* p) { int32_t x; std::memcpy(&x, p, 4); return _mm512_set1_epi32(x); }
static inline __m512 dot2(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INFERD_VEC 8
using vec = __m256;
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vload(const bf16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline vec vset(float x) { return _mm256_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vhmax(vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline int vfind(vec a, float v) {  // the first lane equal to v, or -1
  const int m = _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(v), _CMP_EQ_OQ));
  return m ? __builtin_ctz(m) : -1;
}
static inline vec vround(vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vpow2i(vec p, vec n) {  // p 2^n for integral n >= -126 (exp's argument is clamped above that)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline vec vrecip(vec a) {  // 1 / a to about float32's precision: a 12-bit estimate and one Newton step
  const vec r = _mm256_rcp_ps(a);
  return _mm256_mul_ps(r, _mm256_fnmadd_ps(a, r, _mm256_set1_ps(2.f)));
}
static inline vec vneg_where(vec x, vec a, vec b) { return _mm256_blendv_ps(a, b, x); }
static inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
static inline void vstore(bf16* p, vec a) {  // rounded to nearest even, as to<bf16>
  const __m256i u = _mm256_castps_si256(a), one = _mm256_set1_epi32(1);
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), one))), 16);
  _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
static inline vec vzero_where(vec a, vec x, float bad) {
  const __m256i m = _mm256_cmpeq_epi32(_mm256_castps_si256(x), _mm256_set1_epi32(__builtin_bit_cast(int32_t, bad)));
  return _mm256_andnot_ps(_mm256_castsi256_ps(m), a);
}
#endif

#ifdef INFERD_VEC
constexpr int W = INFERD_VEC;

// e^x for x <= 0: 2^(x log2 e) = 2^n 2^f with n the nearest integer, |f| <= 1/2, 2^f by its Taylor series to
// degree 6 (relative error below 2e-7); arguments below -87 give e^-87, whose weight is nil beside the max's 1
static inline vec vexp(vec x) {
  const vec t = vmul(vmax(x, vset(-87.f)), vset(1.44269504f)), n = vround(t), f = vsub(t, n);
  vec p = vset(1.5403530e-4f);
  p = vfma(p, f, vset(1.3333558e-3f)); p = vfma(p, f, vset(9.6181291e-3f)); p = vfma(p, f, vset(5.5504109e-2f));
  p = vfma(p, f, vset(2.4022651e-1f)); p = vfma(p, f, vset(6.9314718e-1f)); p = vfma(p, f, vset(1.f));
  return vpow2i(p, n);
}

// silu(g) u = g sigmoid(g) u on whole vectors, sigmoid from e = e^-|g| (never above 1): 1 / (1 + e) for g >= 0,
// e / (1 + e) below
static inline vec silu_times(vec g, vec u) {
  const vec e = vexp(vsub(vset(0.f), vmax(g, vsub(vset(0.f), g)))), s = vrecip(vadd(vset(1.f), e));
  return vmul(vmul(g, vneg_where(g, s, vmul(e, s))), u);
}
template <typename T> static int64_t silu_mul_vec(const T* g, const T* u, T* o, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(o + i, silu_times(vload(g + i), vload(u + i)));
  return i;
}
#endif

// gate_up: [T, 2I] -> silu(gate) * up: [T, I]
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check(gate_up, gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up: [rows, 2 I]");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  by_dtype(gate_up, [&](auto z) {
    using T = decltype(z);
    const T* gp = ptr<T>(gate_up); T* op = ptr<T>(out);
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T *g = gp + r * 2 * n, *u = g + n; T* o = op + r * n;
        int64_t i = 0;
#ifdef INFERD_VEC
        i = silu_mul_vec(g, u, o, n);
#endif
        for (; i < n; ++i) { const float x = ld(g[i]); o[i] = to<T>(x / (1.f + std::exp(-x)) * ld(u[i])); }
      }
    });
  });
  return out;
}

// The keys of the thread's next decode-attention task, or none (k null). A task reads its keys (QK, its values fetched
// into L2 meanwhile), then its values (PV) from L2: during PV the memory idled, so PV fetches the next task's keys into
// L2 as it goes, as far as its own context reaches. On an Emerald Rapids with the cache in memory (more than its L3:
// benchmarks/paged_decode.py --layers 64), 64 streams of 192 positions ran 1.13x as fast in bf16, fp32 1.11-1.14x at
// 32-64, 1.11-1.13x in AVX2 code, 1.07-1.16x in attend_bf16 (cooperlake code); unchanged where the cache fits L3. The
// engine's bf16 decode 1.055x / 1.058x at 32 / 64 streams (benchmarks/results/engine-ahead-ab-emr.json).
// k: the keys of the KV head the PV at hand reads (a PV fetches as many bytes a key as it reads a value).
struct Ahead { const void* k = nullptr; const int64_t* blocks = nullptr; int64_t len = 0; };

#ifdef INFERD_VEC
template <int HINT> static inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char*)p + b, (_mm_hint)HINT);
}

// The next task's keys in the block at t0 (null: none). PV fetches them into L2 a key at a time, between its own
// loads: a block's keys at once at its start left the time unchanged, and so did a test per key of whether it was
// one its pass should fetch.
template <typename T>
static inline const T* ahead_keys(const Ahead& a, int64_t t0, int64_t block_size, int64_t row) {
  return a.k && t0 < a.len ? (const T*)a.k + a.blocks[t0 / block_size] * block_size * row : nullptr;
}

// the scores of GT query heads (q: their rows, float32, scaled) against one sequence's keys, for one KV head:
// s[g * stride + t]
template <int C, int GT, typename T>
static void qk_tile(const float* q, int64_t hd, const T* cache, const T* vcache, const int64_t* blocks,
                    int64_t block_size, int64_t row, int64_t len, float* s, int64_t stride) {
  vec qv[GT][C];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = vload(q + g * hd + c * W);
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const T* block = cache + blocks[t0 / block_size] * block_size * row;
    const int64_t n = std::min(block_size, len - t0);
    // a head's row is hd * sizeof(T) bytes of every KVH times as many, in blocks anywhere: the next block's keys are
    // fetched ahead, and this one's values into L2 for pv_tile
    const T* next = t0 + block_size < len ? cache + blocks[t0 / block_size + 1] * block_size * row : nullptr;
    const T* values = vcache + blocks[t0 / block_size] * block_size * row;
    for (int64_t i = 0; i < n; ++i) {
      const T* k = block + i * row;
      if (next) prefetch<_MM_HINT_T0>(next + i * row, C * W * sizeof(T));
      prefetch<_MM_HINT_T1>(values + i * row, C * W * sizeof(T));
      vec kv[C];
      for (int c = 0; c < C; ++c) kv[c] = vload(k + c * W);
      for (int g = 0; g < GT; ++g) {
        vec acc = vmul(qv[g][0], kv[0]);
        for (int c = 1; c < C; ++c) acc = vfma(qv[g][c], kv[c], acc);
        s[g * stride + t0 + i] = vsum(acc);
      }
    }
  }
}

// out[g] = sum_t p[g * stride + t] v_t for GT query heads, then times inv[g]; the next task's keys fetched (Ahead)
template <int C, int GT, typename T>
static void pv_tile(const float* p, int64_t stride, const T* cache, const int64_t* blocks, int64_t block_size,
                    int64_t row, int64_t len, const float* inv, float* out, int64_t hd, const Ahead& ahead) {
  vec acc[GT][C];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = vset(0.f);
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const T* block = cache + blocks[t0 / block_size] * block_size * row;
    const int64_t n = std::min(block_size, len - t0);
    const T* keys = ahead_keys<T>(ahead, t0, block_size, row);
    for (int64_t i = 0; i < n; ++i) {
      const T* v = block + i * row;
      if (keys) prefetch<_MM_HINT_T1>(keys + i * row, C * W * sizeof(T));
      vec vv[C];
      for (int c = 0; c < C; ++c) vv[c] = vload(v + c * W);
      for (int g = 0; g < GT; ++g) {
        const vec w = vset(p[g * stride + t0 + i]);
        for (int c = 0; c < C; ++c) acc[g][c] = vfma(w, vv[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < C; ++c) vstore(out + g * hd + c * W, vmul(acc[g][c], vset(inv[g])));
}

// softmax's numerators in place, returning their sum; the row's max in *max
static float exp_row(float* s, int64_t len, float* max) {
  vec m = vset(-std::numeric_limits<float>::max());
  int64_t t = 0;
  for (; t + W <= len; t += W) m = vmax(m, vload(s + t));
  float mx = vhmax(m);
  for (; t < len; ++t) mx = std::max(mx, s[t]);
  vec sum = vset(0.f);
  for (t = 0; t + W <= len; t += W) { const vec e = vexp(vadd(vload(s + t), vset(-mx))); vstore(s + t, e); sum = vadd(sum, e); }
  float total = vsum(sum);
  for (; t < len; ++t) { s[t] = std::exp(s[t] - mx); total += s[t]; }
  *max = mx;
  return total;
}

// one (sequence, KV head): its G query heads in tiles of up to 4, for head_dim C vectors; each head's scores' max
// and the sum of their exponentials into stats[2 g], stats[2 g + 1] (merge_parts)
template <int C, typename T>
static void attend_vec(const float* qf, int64_t G, int64_t hd, const T* kc, const T* vc, const int64_t* blocks,
                       int64_t block_size, int64_t row, int64_t len, float* scores, int64_t stride, float* out,
                       float* stats, const Ahead& next) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gt = std::min<int64_t>(4, G - g0);
    const float* q = qf + g0 * hd; float* s = scores + g0 * stride;
    switch (gt) {
      case 1: qk_tile<C, 1>(q, hd, kc, vc, blocks, block_size, row, len, s, stride); break;
      case 2: qk_tile<C, 2>(q, hd, kc, vc, blocks, block_size, row, len, s, stride); break;
      case 3: qk_tile<C, 3>(q, hd, kc, vc, blocks, block_size, row, len, s, stride); break;
      default: qk_tile<C, 4>(q, hd, kc, vc, blocks, block_size, row, len, s, stride);
    }
    float inv[4];
    for (int64_t g = 0; g < gt; ++g) {
      float* st = stats + 2 * (g0 + g);
      st[1] = exp_row(s + g * stride, len, &st[0]);
      inv[g] = 1.f / st[1];
    }
    float* o = out + g0 * hd;
    const Ahead ahead = g0 == 0 ? next : Ahead{};  // the first tile's PV fetches them
    switch (gt) {
      case 1: pv_tile<C, 1>(s, stride, vc, blocks, block_size, row, len, inv, o, hd, ahead); break;
      case 2: pv_tile<C, 2>(s, stride, vc, blocks, block_size, row, len, inv, o, hd, ahead); break;
      case 3: pv_tile<C, 3>(s, stride, vc, blocks, block_size, row, len, inv, o, hd, ahead); break;
      default: pv_tile<C, 4>(s, stride, vc, blocks, block_size, row, len, inv, o, hd, ahead);
    }
  }
}

#if defined(__AVX512F__)
// The same for bf16 caches with head_dim a multiple of 32, widened without a shuffle: a 32-bit lane holds two bf16,
// the even element in its low half; shifted up 16 it is that element's float32, masked to its high half the odd
// one's. So 32 dims are one load, a shift and an and (vload's widening is a shuffle a 16 dims, on the one port that
// also takes every 512-bit shuffle), q is laid out to match (each 32 dims as their 16 even, then their 16 odd: split_q)
// and PV's sums are put back in order once at the end. QK takes 8 keys at a time, their sums across lanes together
// (sum8: 2 shuffles a key, where a reduction each took 4).
static inline void split_bf16(const bf16* p, __m512& even, __m512& odd) {
  const __m512i x = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int32_t(0xffff0000u))));
}

// q's float32 row in split_bf16's order: dims 32 c + 2 j at 32 c + j, 32 c + 2 j + 1 at 32 c + 16 + j
static inline void split_q(const bf16* q, float scale, int64_t n, float* out) {
  for (int64_t c = 0; c < n; c += 32)
    for (int64_t j = 0; j < 16; ++j) out[c + j] = ld(q[c + 2 * j]) * scale, out[c + 16 + j] = ld(q[c + 2 * j + 1]) * scale;
}

// lane i < 8: the sum of a[i]'s lanes (sum16's steps on 8 vectors)
static inline __m256 sum8(const __m512* a) {
  __m512 b[4];
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  __m512 c[2];
  for (int j = 0; j < 2; ++j) {
    const __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
    c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
  return _mm512_castps512_ps256(_mm512_add_ps(_mm512_shuffle_f32x4(e, e, 0x88), _mm512_shuffle_f32x4(e, e, 0xdd)));
}

template <int C2, int GT>
static void qk_split(const float* q, int64_t hd, const bf16* cache, const bf16* vcache, const int64_t* blocks,
                     int64_t block_size, int64_t row, int64_t len, float* s, int64_t stride) {
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const bf16* block = cache + blocks[t0 / block_size] * block_size * row;
    const int64_t n = std::min(block_size, len - t0);
    const bf16* next = t0 + block_size < len ? cache + blocks[t0 / block_size + 1] * block_size * row : nullptr;
    const bf16* values = vcache + blocks[t0 / block_size] * block_size * row;
    for (int64_t i0 = 0; i0 < n; i0 += 8) {
      const int64_t m = std::min<int64_t>(8, n - i0);
      __m512 acc[GT][8];
      for (int i = 0; i < 8; ++i) {
        for (int g = 0; g < GT; ++g) acc[g][i] = _mm512_setzero_ps();
        if (i >= m) continue;
        const bf16* k = block + (i0 + i) * row;
        if (next) prefetch<_MM_HINT_T0>(next + (i0 + i) * row, C2 * 64);
        prefetch<_MM_HINT_T1>(values + (i0 + i) * row, C2 * 64);
        for (int c = 0; c < C2; ++c) {
          __m512 even, odd;
          split_bf16(k + 32 * c, even, odd);
          for (int g = 0; g < GT; ++g) {
            const float* qg = q + g * hd + 32 * c;
            acc[g][i] = _mm512_fmadd_ps(_mm512_loadu_ps(qg), even, acc[g][i]);
            acc[g][i] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16), odd, acc[g][i]);
          }
        }
      }
      for (int g = 0; g < GT; ++g) _mm256_mask_storeu_ps(s + g * stride + t0 + i0, (__mmask8)((1u << m) - 1), sum8(acc[g]));
    }
  }
}

template <int C2, int GT>
static void pv_split(const float* p, int64_t stride, const bf16* cache, const int64_t* blocks, int64_t block_size,
                     int64_t row, int64_t len, const float* inv, float* out, int64_t hd, const Ahead& ahead) {
  __m512 even[GT][C2], odd[GT][C2];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < C2; ++c) even[g][c] = odd[g][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const bf16* block = cache + blocks[t0 / block_size] * block_size * row;
    const int64_t n = std::min(block_size, len - t0);
    const bf16* keys = ahead_keys<bf16>(ahead, t0, block_size, row);
    for (int64_t i = 0; i < n; ++i) {
      if (keys) prefetch<_MM_HINT_T1>(keys + i * row, C2 * 64);
      for (int c = 0; c < C2; ++c) {
        __m512 e, o;
        split_bf16(block + i * row + 32 * c, e, o);
        for (int g = 0; g < GT; ++g) {
          const __m512 w = _mm512_set1_ps(p[g * stride + t0 + i]);
          even[g][c] = _mm512_fmadd_ps(w, e, even[g][c]);
          odd[g][c] = _mm512_fmadd_ps(w, o, odd[g][c]);
        }
      }
    }
  }
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < C2; ++c) {
      const __m512 e = _mm512_mul_ps(even[g][c], _mm512_set1_ps(inv[g])), o = _mm512_mul_ps(odd[g][c], _mm512_set1_ps(inv[g]));
      _mm512_storeu_ps(out + g * hd + 32 * c, _mm512_permutex2var_ps(e, lo, o));
      _mm512_storeu_ps(out + g * hd + 32 * c + 16, _mm512_permutex2var_ps(e, hi, o));
    }
}

// attend_vec's loop on qk_split and pv_split, query heads in tiles of up to 3 (QK's 8 keys' sums in registers);
// qf in split_q's order
template <int C2>
static void attend_split(const float* qf, int64_t G, int64_t hd, const bf16* kc, const bf16* vc, const int64_t* blocks,
                         int64_t block_size, int64_t row, int64_t len, float* scores, int64_t stride, float* out,
                         float* stats, const Ahead& next) {
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    const int64_t gt = std::min<int64_t>(3, G - g0);
    const float* q = qf + g0 * hd; float* s = scores + g0 * stride;
    switch (gt) {
      case 1: qk_split<C2, 1>(q, hd, kc, vc, blocks, block_size, row, len, s, stride); break;
      case 2: qk_split<C2, 2>(q, hd, kc, vc, blocks, block_size, row, len, s, stride); break;
      default: qk_split<C2, 3>(q, hd, kc, vc, blocks, block_size, row, len, s, stride);
    }
    float inv[3];
    for (int64_t g = 0; g < gt; ++g) {
      float* st = stats + 2 * (g0 + g);
      st[1] = exp_row(s + g * stride, len, &st[0]);
      inv[g] = 1.f / st[1];
    }
    float* o = out + g0 * hd;
    const Ahead ahead = g0 == 0 ? next : Ahead{};
    switch (gt) {
      case 1: pv_split<C2, 1>(s, stride, vc, blocks, block_size, row, len, inv, o, hd, ahead); break;
      case 2: pv_split<C2, 2>(s, stride, vc, blocks, block_size, row, len, inv, o, hd, ahead); break;
      default: pv_split<C2, 3>(s, stride, vc, blocks, block_size, row, len, inv, o, hd, ahead);
    }
  }
}
#endif
#endif

#if defined(__AVX512BF16__)
// Decode attention in bf16 on its dot products (AVX-512 BF16), for head_dim a multiple of 32 (DV vectors of 32 bf16
// a row): no widening of K or V to float32. QK: a query head's row against 16 keys at a time, one vector of partial
// sums a key (DV vdpbf16ps), the 16 added across their lanes together (sum16: 45 shuffles and adds, not 16
// reductions of 8). PV: two keys' value rows interleaved into pairs (unpacklo/hi: dims in a fixed order, undone at
// the end) against their two probabilities (rounded to bf16, as the prefill loops round them), GT query heads at once.

// lane i: the sum of a[i]'s lanes
static inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128 bits: [x0+x2, y0+y2, x1+x3, y1+y3] of a[2i], a[2i+1]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128 bits: a[4j..4j+3], each that quarter's sum
    const __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
    c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xdd));
}

// s[i] = scale q . k_i for one query head against n keys, rows `row` apart
template <int DV>
static void qk_bf16(const bf16* q, float scale, const bf16* k, int64_t row, int64_t n, float* s) {
  __m512i qv[DV];
  for (int c = 0; c < DV; ++c) qv[c] = _mm512_loadu_si512(q + c * 32);
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - i0);
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) {
      acc[i] = _mm512_setzero_ps();
      if (i < m)
        for (int c = 0; c < DV; ++c) acc[i] = dot2(acc[i], qv[c], _mm512_loadu_si512(k + (i0 + i) * row + c * 32));
    }
    _mm512_mask_storeu_ps(s + i0, (__mmask16)((1u << m) - 1), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
  }
}

// out[g] (float32, dims in order) = inv[g] sum_t p[g * stride + t] v_t for GT query heads, p in bf16
template <int DV, int GT>
static void pv_bf16(const bf16* p, int64_t stride, const bf16* vc, const int64_t* blocks, int64_t block_size,
                    int64_t row, int64_t len, const float* inv, float* out, int64_t hd, const Ahead& ahead) {
  __m512 lo[GT][DV], hi[GT][DV];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < DV; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const bf16* block = vc + blocks[t0 / block_size] * block_size * row;
    const int64_t n = std::min(block_size, len - t0);
    const bf16* keys = ahead_keys<bf16>(ahead, t0, block_size, row);
    for (int64_t i = 0; i < n; i += 2) {
      if (keys) {
        prefetch<_MM_HINT_T1>(keys + i * row, DV * 64);
        if (i + 1 < n) prefetch<_MM_HINT_T1>(keys + (i + 1) * row, DV * 64);
      }
      const bool two = i + 1 < n;  // a lone last key pairs with zeros (never with the next block's first)
      for (int c = 0; c < DV; ++c) {
        const __m512i a = _mm512_loadu_si512(block + i * row + c * 32);
        const __m512i b = two ? _mm512_loadu_si512(block + (i + 1) * row + c * 32) : _mm512_setzero_si512();
        const __m512i l = _mm512_unpacklo_epi16(a, b), h = _mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < GT; ++g) {
          const bf16* pg = p + g * stride + t0 + i;
          const __m512i w = _mm512_set1_epi32(int32_t(uint32_t(pg[0]) | (two ? uint32_t(pg[1]) << 16 : 0u)));
          lo[g][c] = dot2(lo[g][c], w, l);
          hi[g][c] = dot2(hi[g][c], w, h);
        }
      }
    }
  }
  // per 128 bits of 8 dims: lo holds their first 4, hi the last 4
  alignas(64) float l[16], h[16];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < DV; ++c) {
      _mm512_store_ps(l, _mm512_mul_ps(lo[g][c], _mm512_set1_ps(inv[g])));
      _mm512_store_ps(h, _mm512_mul_ps(hi[g][c], _mm512_set1_ps(inv[g])));
      float* o = out + g * hd + c * 32;
      for (int j = 0; j < 16; ++j) o[j / 4 * 8 + j % 4] = l[j], o[j / 4 * 8 + 4 + j % 4] = h[j];
    }
}

// KH KV heads side by side (kc, vc at the first's) of one sequence, or part of it, as attend_vec: q their KH G query
// heads' bf16 rows, unscaled; scores: KH G rows `stride` apart, probs: G rows, scratch; out, stats as attend_vec's
// for KH G heads. paged_decode passes all KV heads: a block's keys are then one contiguous read (a task a KV head read
// 2 of every 6 cache lines of a slot of SmolLM2's). The keys block by block, a pass a query head; the next block's keys
// fetched ahead and this one's values into L2 for PV, spread over the passes (all at the first: 0.8x the speed with
// the cache in memory).
template <int DV>
static void attend_bf16(const bf16* q, float scale, int64_t KH, int64_t G, int64_t hd, const bf16* kc,
                        const bf16* vc, const int64_t* blocks, int64_t block_size, int64_t row, int64_t len,
                        float* scores, bf16* probs, int64_t stride, float* out, float* stats, const Ahead& next) {
  const int64_t bytes = KH * hd * 2;
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const int64_t n = std::min(block_size, len - t0), at = blocks[t0 / block_size] * block_size * row;
    const bf16* next = t0 + block_size < len ? kc + blocks[t0 / block_size + 1] * block_size * row : nullptr;
    const int64_t passes = KH * G;  // the prefetches spread over the block's passes (a query head each)
    for (int64_t j = 0; j < passes; ++j) {
      for (int64_t i = j * n / passes; i < (j + 1) * n / passes; ++i) {
        if (next) prefetch<_MM_HINT_T0>(next + i * row, bytes);
        prefetch<_MM_HINT_T1>(vc + at + i * row, bytes);
      }
      const int64_t h = j / G;
      qk_bf16<DV>(q + j * hd, scale, kc + at + h * hd, row, n, scores + j * stride + t0);
    }
  }
  constexpr int GT = std::clamp(8 / DV, 1, 4);  // heads whose PV accumulators stay in registers
  float inv[GT];
  for (int64_t h = 0; h < KH; ++h)
    for (int64_t g0 = 0; g0 < G; g0 += GT) {
      const int64_t gt = std::min<int64_t>(GT, G - g0), first = h * G + g0;
      for (int64_t g = 0; g < gt; ++g) {
        float* s = scores + (first + g) * stride;
        float* st = stats + 2 * (first + g);
        st[1] = exp_row(s, len, &st[0]);
        inv[g] = 1.f / st[1];
        bf16* pb = probs + g * stride;
        int64_t t = 0;
        for (; t + 16 <= len; t += 16)
          _mm256_storeu_si256((__m256i*)(pb + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t)));
        for (; t < len; ++t) pb[t] = to<bf16>(s[t]);
      }
      float* o = out + first * hd;
      const bf16* v = vc + h * hd;
      Ahead ahead;  // KV head h's first PV pass fetches the next task's keys of KV head h
      if (g0 == 0 && next.k) ahead = Ahead{(const bf16*)next.k + h * hd, next.blocks, next.len};
      switch (gt) {
        case 1: pv_bf16<DV, 1>(probs, stride, v, blocks, block_size, row, len, inv, o, hd, ahead); break;
        case 2: if constexpr (GT >= 2) pv_bf16<DV, 2>(probs, stride, v, blocks, block_size, row, len, inv, o, hd, ahead); break;
        case 3: if constexpr (GT >= 3) pv_bf16<DV, 3>(probs, stride, v, blocks, block_size, row, len, inv, o, hd, ahead); break;
        default: if constexpr (GT >= 4) pv_bf16<DV, 4>(probs, stride, v, blocks, block_size, row, len, inv, o, hd, ahead);
      }
    }
}
#endif

// the same on scalars, for any head_dim
template <typename T>
static void attend_scalar(const float* qf, int64_t G, int64_t hd, const T* kc, const T* vc, const int64_t* blocks,
                          int64_t block_size, int64_t row, int64_t len, float* scores, int64_t stride, float* out,
                          float* stats, const Ahead&) {
  for (int64_t t = 0; t < len; ++t) {
    const T* k = kc + blocks[t / block_size] * block_size * row + (t % block_size) * row;
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int64_t i = 0; i < hd; ++i) dot += qf[g * hd + i] * ld(k[i]);
      scores[g * stride + t] = dot;
    }
  }
  std::fill(out, out + G * hd, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * stride;
    const float mx = *std::max_element(s, s + len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) { s[t] = std::exp(s[t] - mx); sum += s[t]; }
    stats[2 * g] = mx;
    stats[2 * g + 1] = sum;
    for (int64_t t = 0; t < len; ++t) {
      const T* v = vc + blocks[t / block_size] * block_size * row + (t % block_size) * row;
      const float w = s[t] / sum;
      for (int64_t i = 0; i < hd; ++i) out[g * hd + i] += w * ld(v[i]);
    }
  }
}

// A (sequence, KV head)'s attention over parts of its context, each part's output normalized on its own: the whole's,
// in float32: each part weighs the sum of its exponentials, rescaled to the largest max (stats as attend_* write them)
static void merge_parts(const float* outs, const float* stats, int64_t parts, int64_t G, int64_t hd, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    float mx = -std::numeric_limits<float>::infinity(), total = 0.f;
    for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, stats[p * 2 * G + 2 * g]);
    std::fill(out + g * hd, out + (g + 1) * hd, 0.f);
    for (int64_t p = 0; p < parts; ++p) {
      const float w = stats[p * 2 * G + 2 * g + 1] * std::exp(stats[p * 2 * G + 2 * g] - mx);
      total += w;
      for (int64_t i = 0; i < hd; ++i) out[g * hd + i] += w * outs[p * G * hd + g * hd + i];
    }
    for (int64_t i = 0; i < hd; ++i) out[g * hd + i] /= total;
  }
}

using AttendBf16 = void (*)(const bf16*, float, int64_t, int64_t, int64_t, const bf16*, const bf16*, const int64_t*,
                           int64_t, int64_t, int64_t, float*, bf16*, int64_t, float*, float*, const Ahead&);

// positions a part of one sequence's context holds at least, where paged_decode cuts a context in parts
constexpr int64_t MIN_PART = 128;

// q: [D, H, hd]; k_cache, v_cache: [slots, KVH, hd]; block_tables: [D, nb] int64; context_lens: [D] int64.
// Tasks: a (sequence, KV head) each (attend_bf16's: a sequence each, all its KV heads), split across the threads.
// Where those are fewer than twice the threads (one sequence of SmolLM2's 3 KV heads on 2 cores: 2 tasks on one
// thread, 1 on the other), each context is cut into parts of whole blocks, at least MIN_PART positions each, attended
// separately and merged (merge_parts).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens,
                           int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && q.size(2) == k_cache.size(2)
              && q.size(1) % k_cache.size(1) == 0, "q: [D, H, hd], caches: [slots, KVH, hd] with KVH dividing H");
  check(q, q, "q"); check(k_cache, q, "k_cache"); check(v_cache, q, "v_cache");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64
              && block_tables.is_contiguous() && context_lens.is_contiguous(), "int64 block tables and lengths");
  const int64_t D = q.size(0), H = q.size(1), hd = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == D && context_lens.numel() == D,
              "a block table and a context length per query");
  const int64_t G = H / KVH, nb = block_tables.size(1);
  auto out = torch::empty_like(q);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t row = KVH * hd;  // elements per cache slot
  const int64_t num_blocks = k_cache.size(0) / block_size;
  int64_t longest = 0;
  for (int64_t d = 0; d < D; ++d) {
    TORCH_CHECK(0 < lens[d] && lens[d] <= nb * block_size, "context length out of range");
    for (int64_t b = 0; b < (lens[d] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(0 <= bt[d * nb + b] && bt[d * nb + b] < num_blocks, "block id out of range");
    longest = std::max(longest, lens[d]);
  }
  by_dtype(q, [&](auto z) {
    using T = decltype(z);
    auto attend = attend_scalar<T>;
    bool split = false;  // qf in split_q's order (attend_split)
#ifdef INFERD_VEC
    if (hd == W) attend = attend_vec<1, T>;
    else if (hd == 2 * W) attend = attend_vec<2, T>;
    else if (hd == 4 * W) attend = attend_vec<4, T>;
    else if (hd == 8 * W) attend = attend_vec<8, T>;
    else if (hd == 16 * W) attend = attend_vec<16, T>;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, bf16>) {
      const auto to = hd == 32 ? attend_split<1> : hd == 64 ? attend_split<2> : hd == 128 ? attend_split<4> : nullptr;
      if (to) attend = to, split = true;
    }
#endif
#endif
    // bf16 on its dot products where the CPU has them and the sequences alone keep the threads busy (attend_bf16, a
    // task a sequence: all its KV heads), else widened to float32 (attend, a task a KV head). With fewer sequences
    // (cut in parts, below) the dot products were 1.25x the time at one stream of 512 positions. Not where the CPU has
    // AMX (Intel's cores: their 512-bit shuffles, sum16's, all go to one port): on an Emerald Rapids they took
    // 1.16-1.34x the widened loops' time at 8-64 streams (benchmarks/results/paged-decode-emr.json).
    const int64_t threads = at::get_num_threads();
    AttendBf16 attend2 = nullptr;
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
    if constexpr (std::is_same_v<T, bf16>) {
      if (D >= 2 * threads)
        attend2 = hd == 32 ? attend_bf16<1> : hd == 64 ? attend_bf16<2> : hd == 128 ? attend_bf16<4> : nullptr;
    }
#endif
    const int64_t KH = attend2 ? KVH : 1, groups = KVH / KH, HG = KH * G;  // KV heads a task, tasks a sequence
    const T *qp = ptr<T>(q), *kp = ptr<T>(k_cache), *vp = ptr<T>(v_cache); T* op = ptr<T>(out);
    const int64_t want = D * groups < 2 * threads ? (2 * threads + D * groups - 1) / (D * groups) : 1;  // parts a context
    struct Part { int64_t d, h, t0, t1; };
    std::vector<Part> parts;
    std::vector<int64_t> first(D * groups + 1);  // (d, group)'s parts: first[d * groups + group] ..
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = 0; j < groups; ++j) {
        first[d * groups + j] = parts.size();
        const int64_t n = std::max<int64_t>(1, std::min(want, lens[d] / MIN_PART));
        for (int64_t p = 0, t0 = 0; p < n; ++p) {
          const int64_t t1 = p + 1 == n ? lens[d] : lens[d] * (p + 1) / n / block_size * block_size;
          if (t1 > t0) parts.push_back({d, j * KH, t0, t1}), t0 = t1;
        }
      }
    first[D * groups] = parts.size();
    const bool cut = (int64_t)parts.size() > D * groups;
    std::vector<float> outs(cut ? parts.size() * HG * hd : 0), stats(cut ? parts.size() * 2 * HG : 0);
    auto store = [&](int64_t d, int64_t h, const float* o) {
      T* og = op + (d * H + h * G) * hd;
      for (int64_t i = 0; i < HG * hd; ++i) og[i] = to<T>(o[i]);
    };
    at::parallel_for(0, parts.size(), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(HG * longest), qf(G * hd), acc(HG * hd), st(2 * HG);
      std::vector<bf16> probs(attend2 ? G * longest : 0);  // a PV tile's heads, at most G
      for (int64_t i = begin; i < end; ++i) {
        const auto [d, h, t0, t1] = parts[i];
        const T* qg = qp + (d * H + h * G) * hd;
        float *o = cut ? &outs[i * HG * hd] : acc.data(), *sti = cut ? &stats[i * 2 * HG] : st.data();
        const int64_t* blocks = bt + d * nb + t0 / block_size;
        Ahead next;
        if (i + 1 < end) {
          const Part& nx = parts[i + 1];  // the thread's next task
          next = Ahead{kp + nx.h * hd, bt + nx.d * nb + nx.t0 / block_size, nx.t1 - nx.t0};
        }
        if (attend2) {
          attend2((const bf16*)qg, (float)scale, KH, G, hd, (const bf16*)kp + h * hd, (const bf16*)vp + h * hd, blocks,
                  block_size, row, t1 - t0, scores.data(), probs.data(), longest, o, sti, next);
        } else {
          if (split) {
#if defined(__AVX512F__)
            split_q((const bf16*)qg, (float)scale, G * hd, qf.data());
#endif
          } else {
            for (int64_t j = 0; j < G * hd; ++j) qf[j] = ld(qg[j]) * (float)scale;
          }
          attend(qf.data(), G, hd, kp + h * hd, vp + h * hd, blocks, block_size, row, t1 - t0, scores.data(), longest,
                 o, sti, next);
        }
        if (!cut) store(d, h, acc.data());
      }
    });
    if (cut) {
      std::vector<float> acc(HG * hd);
      for (int64_t task = 0; task < D * groups; ++task) {
        const int64_t p = first[task], n = first[task + 1] - p;
        merge_parts(&outs[p * HG * hd], &stats[p * 2 * HG], n, HG, hd, acc.data());
        store(task / groups, task % groups * KH, acc.data());
      }
    }
  });
  return out;
}

// The AMX tiles (Sapphire Rapids and later): the process's permission, and a tile configuration.
#if defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
constexpr int64_t AMX_MAX_ROWS = 64;

bool amx_linear_native() {
#if defined(__AMX_BF16__)
  static const bool permitted = [] {  // Linux gives a process the tiles' state only once it asks for it
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return permitted;
#else
  return false;
#endif
}

#if defined(__AMX_BF16__)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#endif

// Prefill attention of one chunk: q [n, H, hd], its context's K/V in the cache blocks `blocks` [nb], the last n of the
// ctx positions being the queries' own (causal). A flash attention on this CPU's vectors: each KV head's keys and
// values are first packed for the dot products (below), then each task, the query heads of a group at QB positions
// (rows), walks the keys KC at a time: scores of 8 rows x KC keys, an online softmax per row (float32, exp a
// polynomial), PV into float32 accumulators. Tasks are taken from a shared counter, heaviest first: a thread that is
// preempted holds up no one at a barrier. Two packings:
// - bf16 on AVX-512 BF16 (vdpbf16ps: 16 float32 lanes, each adding two bf16 products): a key vector holds 16 keys'
//   pairs of dimensions, a value vector 16 dimensions of a pair of keys; probabilities rounded to bf16 for PV;
// - float32 on AVX-512 (FMA): a key vector holds one dimension of 16 keys, values stay rows.
// With AMX, bf16 at head_dim 32 and 64 takes prefill_amx (below). Elsewhere (AVX2, bf16 without AVX-512 BF16, a
// head_dim the loops do not take, bf16 at another head_dim with AMX) the gather and torch's SDPA.
static torch::Tensor prefill_sdpa(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                  const torch::Tensor& blocks, int64_t ctx, int64_t block_size, double scale) {
  const int64_t n = q.size(0), KVH = k_cache.size(1), hd = k_cache.size(2);
  auto gather = [&](const torch::Tensor& c) {
    return c.view({-1, block_size, KVH, hd}).index_select(0, blocks).view({-1, KVH, hd}).narrow(0, 0, ctx)
        .transpose(0, 1).unsqueeze(0);
  };
  auto qq = q.transpose(0, 1).unsqueeze(0);
  auto k = gather(k_cache), v = gather(v_cache);
  if (n == ctx)
    return at::scaled_dot_product_attention(qq, k, v, {}, 0.0, true, scale, true).squeeze(0).transpose(0, 1).contiguous();
  // A chunk after a prompt's first: its queries see the ctx - n positions before it whole and their own causally, as
  // two flash products without a mask, merged by their log-sum-exps. With a mask SDPA scored every position (half of
  // the chunk's own are masked) and built the mask anew each layer (an arange, a compare and a where).
  const int64_t past = ctx - n, H = q.size(1);
  auto [o1, l1] = at::_scaled_dot_product_flash_attention_for_cpu(qq, k.narrow(2, 0, past), v.narrow(2, 0, past), 0.0,
                                                                 false, std::nullopt, scale);
  auto [o2, l2] = at::_scaled_dot_product_flash_attention_for_cpu(qq, k.narrow(2, past, n), v.narrow(2, past, n), 0.0,
                                                                 true, std::nullopt, scale);
  auto out = torch::empty_like(q);  // [n, H, hd]
  l1 = l1.contiguous(), l2 = l2.contiguous();  // [1, H, n] float32
  const float *lse1 = ptr<float>(l1), *lse2 = ptr<float>(l2);
  by_dtype(q, [&](auto z) {
    using T = decltype(z);
    const T *a = ptr<T>(o1), *b = ptr<T>(o2);
    T* op = ptr<T>(out);
    const int64_t ah = o1.stride(1), ai = o1.stride(2), ad = o1.stride(3), bh = o2.stride(1), bi = o2.stride(2),
                  bd = o2.stride(3);
    at::parallel_for(0, H * n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t h = r / n, i = r % n;
        const float m = std::max(lse1[r], lse2[r]), w1 = std::exp(lse1[r] - m), w2 = std::exp(lse2[r] - m);
        const float s1 = w1 / (w1 + w2), s2 = w2 / (w1 + w2);
        const T *x = a + h * ah + i * ai, *y = b + h * bh + i * bi;
        T* o = op + (i * H + h) * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] = to<T>(s1 * ld(x[d * ad]) + s2 * ld(y[d * bd]));
      }
    });
  });
  return out;
}

#ifdef INFERD_VEC
constexpr int64_t KC = 64, QB = 16;  // keys a chunk, query positions a task

// a row's scores for one chunk (s, KC floats, the first `visible` seen) -> its probabilities in place, times
// e^-m_new; m (the running max) and l (the running sum) updated; returns e^(m_old - m_new), the accumulators' factor
static inline float online_softmax(float* s, int64_t visible, float scale, float& m, float& l) {
  if (visible == 0) { std::fill(s, s + KC, 0.f); return 1.f; }
  for (int64_t j = 0; j < KC; j += W) vstore(s + j, vmul(vload(s + j), vset(scale)));
  std::fill(s + visible, s + KC, -1e30f);
  vec mx = vload(s);
  for (int64_t j = W; j < KC; j += W) mx = vmax(mx, vload(s + j));
  const float m_new = std::max(m, vhmax(mx));
  vec sum = vset(0.f);
  for (int64_t j = 0; j < KC; j += W) {
    const vec e = vexp(vsub(vload(s + j), vset(m_new)));
    vstore(s + j, e); sum = vadd(sum, e);
  }
  std::fill(s + visible, s + KC, 0.f);  // their e^-87 was nil in the sum, and is 0 for PV
  const float corr = m < -1e29f ? 0.f : std::exp(m - m_new);
  l = l * corr + vsum(sum);
  m = m_new;
  return corr;
}

template <typename P> static void prefill_flash(const typename P::T* qp, const typename P::T* kc,
                                                const typename P::T* vc, const int64_t* bt, int64_t n, int64_t ctx,
                                                int64_t H, int64_t KVH, int64_t block_size, float scale,
                                                typename P::T* op) {
  using T = typename P::T;
  constexpr int64_t hd = P::hd;
  const int64_t G = H / KVH, L = (ctx + KC - 1) / KC * KC, row = KVH * hd;
  std::vector<T> kpack(KVH * L * hd, T(0)), vpack(KVH * L * hd, T(0));  // per KV head, zero past ctx
  at::parallel_for(0, KVH * (L / 16), 1, [&](int64_t b, int64_t e) {
    for (int64_t task = b; task < e; ++task) {
      const int64_t h = task / (L / 16), kb = task % (L / 16);
      T *kp = kpack.data() + h * L * hd, *vp = vpack.data() + h * L * hd;
      for (int64_t t = kb * 16; t < std::min(ctx, kb * 16 + 16); ++t) {
        const int64_t slot = bt[t / block_size] * block_size + t % block_size;
        const T *k = kc + slot * row + h * hd, *v = vc + slot * row + h * hd;
        for (int64_t d = 0; d < hd; ++d) { kp[P::kidx(t, d)] = k[d]; vp[P::vidx(t, d)] = v[d]; }
      }
    }
  });
  const int64_t nqb = (n + QB - 1) / QB, tasks = KVH * nqb, M = (QB * G + 7) / 8 * 8;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<T> qb(M * hd, T(0)), pb(M * KC);
    std::vector<float> s(M * KC), acc(M * hd), m(M), l(M);
    std::vector<int64_t> last(M);  // each row's last visible key
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
      const int64_t qblock = nqb - 1 - task / KVH, h = task % KVH;  // the last positions see the most keys
      const int64_t i0 = qblock * QB, rows = std::min(QB, n - i0) * G;
      for (int64_t r = 0; r < M; ++r) {
        const int64_t i = i0 + std::min(r, rows - 1) / G;  // rows past the end see what the last one sees, unwritten
        last[r] = ctx - n + i;
        if (r < rows) std::memcpy(&qb[r * hd], qp + (i * H + h * G + r % G) * hd, hd * sizeof(T));
        m[r] = -1e30f; l[r] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const T *kp = kpack.data() + h * L * hd, *vp = vpack.data() + h * L * hd;
      for (int64_t c0 = 0; c0 <= last[M - 1]; c0 += KC) {
        for (int64_t r = 0; r < M; r += 8) P::qk(&qb[r * hd], kp + c0 * hd, &s[r * KC]);
        for (int64_t r = 0; r < M; ++r) {
          const float corr = online_softmax(&s[r * KC], std::clamp<int64_t>(last[r] - c0 + 1, 0, KC), scale, m[r], l[r]);
          P::store_p(&s[r * KC], &pb[r * KC]);
          if (corr != 1.f)
            for (int64_t d = 0; d < hd; d += W) vstore(&acc[r * hd + d], vmul(vload(&acc[r * hd + d]), vset(corr)));
        }
        for (int64_t r = 0; r < M; r += P::RP) P::pv(&pb[r * KC], vp + c0 * hd, &acc[r * hd]);
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* o = op + ((i0 + r / G) * H + h * G + r % G) * hd;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < hd; ++d) o[d] = to<T>(acc[r * hd + d] * inv);
      }
    }
  });
}

// float32: kp[key / W][d][key % W], vp[key][d]
template <int DV> struct F32Flash {
  using T = float;
  static constexpr int64_t hd = DV * W;
  static constexpr int RP = std::clamp((W == 16 ? 16 : 8) / DV, 1, 8);  // rows whose accumulators stay in registers
  static int64_t kidx(int64_t t, int64_t d) { return (t / W * hd + d) * W + t % W; }
  static int64_t vidx(int64_t t, int64_t d) { return t * hd + d; }
  static void qk(const float* q, const float* kp, float* s) {  // 8 rows x KC keys
    for (int64_t kb = 0; kb < KC; kb += W) {
      vec acc[8];
      for (int r = 0; r < 8; ++r) acc[r] = vset(0.f);
      for (int64_t d = 0; d < hd; ++d) {
        const vec k = vload(kp + (kb * hd + d * W));
        for (int r = 0; r < 8; ++r) acc[r] = vfma(vset(q[r * hd + d]), k, acc[r]);
      }
      for (int r = 0; r < 8; ++r) vstore(s + r * KC + kb, acc[r]);
    }
  }
  static void store_p(const float* s, float* p) { std::memcpy(p, s, KC * sizeof(float)); }
  static void pv(const float* p, const float* vp, float* acc) {  // RP rows
    vec a[RP][DV];
    for (int r = 0; r < RP; ++r)
      for (int v = 0; v < DV; ++v) a[r][v] = vload(acc + r * hd + v * W);
    for (int64_t j = 0; j < KC; ++j)
      for (int v = 0; v < DV; ++v) {
        const vec vv = vload(vp + j * hd + v * W);
        for (int r = 0; r < RP; ++r) a[r][v] = vfma(vset(p[r * KC + j]), vv, a[r][v]);
      }
    for (int r = 0; r < RP; ++r)
      for (int v = 0; v < DV; ++v) vstore(acc + r * hd + v * W, a[r][v]);
  }
};

#if defined(__AVX512BF16__)
// bf16: kp[key / 16][d / 2][key % 16][d % 2], vp[key / 2][d / 16][d % 16][key % 2]
template <int DV> struct Bf16Flash {
  using T = bf16;
  static constexpr int64_t hd = DV * 16;
  static constexpr int RP = std::clamp(16 / DV, 1, 8);
  static int64_t kidx(int64_t t, int64_t d) { return ((t / 16 * (hd / 2) + d / 2) * 16 + t % 16) * 2 + d % 2; }
  static int64_t vidx(int64_t t, int64_t d) { return ((t / 2 * DV + d / 16) * 16 + d % 16) * 2 + t % 2; }
  static void qk(const bf16* q, const bf16* kp, float* s) {
    for (int64_t kb = 0; kb < KC; kb += 16) {
      __m512 acc[8];
      for (int r = 0; r < 8; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t d2 = 0; d2 < hd / 2; ++d2) {
        const __m512i k = _mm512_loadu_si512(kp + kb * hd + d2 * 32);
        for (int r = 0; r < 8; ++r) acc[r] = dot2(acc[r], pair(q + r * hd + 2 * d2), k);
      }
      for (int r = 0; r < 8; ++r) _mm512_storeu_ps(s + r * KC + kb, acc[r]);
    }
  }
  static void store_p(const float* s, bf16* p) {
    for (int64_t j = 0; j < KC; j += 16)
      _mm256_storeu_si256((__m256i*)(p + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + j)));
  }
  static void pv(const bf16* p, const bf16* vp, float* acc) {
    __m512 a[RP][DV];
    for (int r = 0; r < RP; ++r)
      for (int v = 0; v < DV; ++v) a[r][v] = _mm512_loadu_ps(acc + r * hd + v * 16);
    for (int64_t jp = 0; jp < KC / 2; ++jp)
      for (int v = 0; v < DV; ++v) {
        const __m512i vv = _mm512_loadu_si512(vp + (jp * DV + v) * 32);
        for (int r = 0; r < RP; ++r) a[r][v] = dot2(a[r][v], pair(p + r * KC + 2 * jp), vv);
      }
    for (int r = 0; r < RP; ++r)
      for (int v = 0; v < DV; ++v) _mm512_storeu_ps(acc + r * hd + v * 16, a[r][v]);
  }
};
#endif

// the loops for this dtype and head_dim, or nullptr
template <typename T> using FlashFn = void (*)(const T*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t,
                                               int64_t, int64_t, float, T*);
template <template <int> class P, typename T> static FlashFn<T> flash_for(int64_t hd, int64_t width) {
  switch (hd / width * (hd % width == 0)) {
    case 1: return prefill_flash<P<1>>;
    case 2: return prefill_flash<P<2>>;
    case 4: return prefill_flash<P<4>>;
    case 8: return prefill_flash<P<8>>;
    case 16: return prefill_flash<P<16>>;
    default: return nullptr;
  }
}
#endif

#if defined(__AMX_BF16__)
// 2^t (float32; t <= 8 where it is used): 2^n 2^f, n the nearest integer, 2^f a degree-4 polynomial fitted on
// [-1/2, 1/2] (relative error 2.7e-6, far below bf16's rounding), 2^n by scalef (t far below -126 gives 0); lanes
// outside `keep` 0
static inline __m512 exp2_ps(__m512 t, __mmask16 keep) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
  __m512 q = _mm512_set1_ps(9.5605102e-3f);
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(5.5917039e-2f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(2.4024981e-1f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(6.9312197e-1f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(9.9999919e-1f));
  return _mm512_maskz_scalef_ps(keep, q, n);
}

// O^T's tiles (2 ..) to and from o [HD][16] float32
template <int DT> static inline void store_o(float* o) {
  _tile_stored(2, o, 64); _tile_stored(3, o + 256, 64);
  if constexpr (DT > 2) { _tile_stored(4, o + 512, 64); _tile_stored(5, o + 768, 64); }
}
template <int DT> static inline void load_o(const float* o) {
  _tile_loadd(2, o, 64); _tile_loadd(3, o + 256, 64);
  if constexpr (DT > 2) { _tile_loadd(4, o + 512, 64); _tile_loadd(5, o + 768, 64); }
}

// bf16 prefill attention on AMX tiles for head_dim 32 and 64, transposed so that a query is a vector lane: a task is
// one query head at 16 positions, walking the keys 32 at a time. Scores come as S^T = K Q^T (A: 16 keys x 32
// dimensions of the packed keys; B: the task's queries in pairs of dimensions), so the online softmax's max, sum and
// rescaling factor are vectors over the 16 queries, with no sums across lanes; the output as O^T = V^T P^T (A: 16
// dimensions x 32 keys of the packed, transposed values; B: the probabilities in pairs of keys), held in tiles from
// the first key to the last. The running max is moved only when a block's max passes it by more than 2^8 (then the
// tiles go through memory once, rescaled), so probabilities reach at most 256, which float32 sums and bf16 hold
// alike. Tiles: 0-1 the scores of 32 keys, 2 to 1 + hd / 16 the output, 6 an A, 7 a B.
template <int HD> static void prefill_amx(const bf16* qp, const bf16* kc, const bf16* vc, const int64_t* bt, int64_t n,
                                          int64_t ctx, int64_t H, int64_t KVH, int64_t block_size, float scale,
                                          bf16* op) {
  constexpr int DT = HD / 16;  // output tiles
  const int64_t G = H / KVH, L = (ctx + 31) / 32 * 32, row = KVH * HD, past = ctx - n;
  // the packs, [h][key][d] and [h][d][key], kept by the calling thread from call to call (fresh pages each call cost
  // as much as the packing); keys past ctx: the scores' are masked, the values' must be 0 (0 x NaN is NaN)
  static thread_local std::vector<bf16> kpack, vpack;
  if ((int64_t)kpack.size() < KVH * L * HD) kpack.resize(KVH * L * HD), vpack.resize(KVH * L * HD);
  bf16 *kpk = kpack.data(), *vpk = vpack.data();  // (a thread_local named in the workers would be theirs)
  at::parallel_for(0, KVH * (L / 32), 1, [&](int64_t b, int64_t e) {
    const bf16* v[32];
    for (int64_t task = b; task < e; ++task) {
      const int64_t h = task / (L / 32), t0 = task % (L / 32) * 32, nt = std::min<int64_t>(32, ctx - t0);
      bf16 *kp = kpk + h * L * HD, *vt = vpk + h * HD * L + t0;
      for (int64_t t = 0; t < nt; ++t) {
        const int64_t slot = bt[(t0 + t) / block_size] * block_size + (t0 + t) % block_size;
        std::memcpy(kp + (t0 + t) * HD, kc + slot * row + h * HD, HD * sizeof(bf16));
        v[t] = vc + slot * row + h * HD;
      }
      for (int64_t d = 0; d < HD; ++d) {
        for (int64_t t = 0; t < nt; ++t) vt[d * L + t] = v[t][d];
        for (int64_t t = nt; t < 32; ++t) vt[d * L + t] = bf16(0);
      }
    }
  });
  const int64_t nqb = (n + 15) / 16, tasks = H * nqb;
  const float c = scale * 1.44269504f;  // scores to base 2
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    alignas(64) bf16 qt[HD / 2 * 32], pt[16 * 32];  // B tiles: [d / 2][query][d % 2], [key / 2][query][key % 2]
    alignas(64) float st[32 * 16], ot[HD * 16];     // S^T [key][query], O^T [d][query]
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
      const int64_t i0 = (nqb - 1 - task / H) * 16, hq = task % H, h = hq / G;  // the last positions see the most keys
      const int64_t rows = std::min<int64_t>(16, n - i0);
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t d = 0; d < HD; ++d)
          qt[d / 2 * 32 + i * 2 + d % 2] = i < rows ? qp[((i0 + i) * H + hq) * HD + d] : bf16(0);
      // the last key each query sees (rows past the end see what the last one sees)
      const __m512i last = _mm512_add_epi32(_mm512_set1_epi32((int)(past + i0)),
                                            _mm512_min_epi32(lanes, _mm512_set1_epi32((int)rows - 1)));
      const int64_t end = past + i0 + rows;  // keys the task sees
      const bf16 *kp = kpk + h * L * HD, *vt = vpk + h * HD * L;
      __m512 m = _mm512_set1_ps(-1e30f), l = _mm512_setzero_ps();
      _tile_zero(2); _tile_zero(3);
      if constexpr (DT > 2) { _tile_zero(4); _tile_zero(5); }
      for (int64_t j0 = 0; j0 < end; j0 += 32) {
        _tile_zero(0); _tile_zero(1);
        for (int64_t d0 = 0; d0 < HD; d0 += 32) {
          _tile_loadd(7, qt + d0 * 16, 64);
          _tile_loadd(6, kp + j0 * HD + d0, HD * 2); _tile_dpbf16ps(0, 6, 7);
          _tile_loadd(6, kp + (j0 + 16) * HD + d0, HD * 2); _tile_dpbf16ps(1, 6, 7);
        }
        _tile_stored(0, st, 64); _tile_stored(1, st + 256, 64);
        const bool whole = j0 + 31 <= past + i0;  // every query sees every key of the block
        __m512 mx = _mm512_set1_ps(-1e30f);
        __mmask16 seen[32];
        for (int j = 0; j < 32; ++j) {
          seen[j] = whole ? (__mmask16)0xffff : _mm512_cmple_epi32_mask(_mm512_set1_epi32((int)(j0 + j)), last);
          mx = _mm512_mask_max_ps(mx, seen[j], mx, _mm512_load_ps(st + 16 * j));
        }
        mx = _mm512_mul_ps(mx, _mm512_set1_ps(c));
        if (_mm512_cmp_ps_mask(mx, _mm512_add_ps(m, _mm512_set1_ps(8.f)), _CMP_GT_OQ)) {  // the max moves
          const __m512 m_new = _mm512_max_ps(m, mx), corr = exp2_ps(_mm512_sub_ps(m, m_new), 0xffff);
          if (j0 > 0) {
            store_o<DT>(ot);
            for (int64_t d = 0; d < HD; ++d)
              _mm512_store_ps(ot + 16 * d, _mm512_mul_ps(_mm512_load_ps(ot + 16 * d), corr));
            load_o<DT>(ot);
          }
          l = _mm512_mul_ps(l, corr);
          m = m_new;
        }
        const __m512 cv = _mm512_set1_ps(c), neg_m = _mm512_sub_ps(_mm512_setzero_ps(), m);
        for (int j = 0; j < 32; j += 2) {
          const __m512 a = exp2_ps(_mm512_fmadd_ps(_mm512_load_ps(st + 16 * j), cv, neg_m), seen[j]);
          const __m512 b = exp2_ps(_mm512_fmadd_ps(_mm512_load_ps(st + 16 * j + 16), cv, neg_m), seen[j + 1]);
          l = _mm512_add_ps(l, _mm512_add_ps(a, b));
          _mm512_store_si512(pt + 16 * j, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(b, a)));
        }
        _tile_loadd(7, pt, 64);
        _tile_loadd(6, vt + j0, L * 2); _tile_dpbf16ps(2, 6, 7);
        _tile_loadd(6, vt + 16 * L + j0, L * 2); _tile_dpbf16ps(3, 6, 7);
        if constexpr (DT > 2) {
          _tile_loadd(6, vt + 32 * L + j0, L * 2); _tile_dpbf16ps(4, 6, 7);
          _tile_loadd(6, vt + 48 * L + j0, L * 2); _tile_dpbf16ps(5, 6, 7);
        }
      }
      store_o<DT>(ot);
      alignas(64) float inv[16];
      _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l));
      for (int64_t i = 0; i < rows; ++i) {
        bf16* o = op + ((i0 + i) * H + hq) * HD;
        for (int64_t d = 0; d < HD; ++d) o[d] = to<bf16>(ot[16 * d + i] * inv[i]);
      }
    }
    _tile_release();
  });
}

#endif

// q: [n, H, hd]; k_cache, v_cache: [slots, KVH, hd]; blocks: [nb] int64, the context's blocks; ctx >= n
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor blocks,
                                int64_t ctx, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && q.size(2) == k_cache.size(2)
              && q.size(1) % k_cache.size(1) == 0, "q: [n, H, hd], caches: [slots, KVH, hd] with KVH dividing H");
  check(q, q, "q"); check(k_cache, q, "k_cache"); check(v_cache, q, "v_cache");
  TORCH_CHECK(blocks.scalar_type() == torch::kInt64 && blocks.dim() == 1 && blocks.is_contiguous(), "int64 blocks [nb]");
  const int64_t n = q.size(0), H = q.size(1), hd = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(0 < n && n <= ctx && ctx <= blocks.numel() * block_size, "need 0 < n <= ctx <= the blocks' slots");
  const int64_t* bt = blocks.data_ptr<int64_t>();
  for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; ++b)
    TORCH_CHECK(0 <= bt[b] && bt[b] < k_cache.size(0) / block_size, "block id out of range");
  auto out = torch::empty_like(q);
#ifdef INFERD_VEC
  if (q.scalar_type() == torch::kFloat32 && W == 16) {  // with AVX2's 8 lanes, 0.7-1.1x SDPA: not taken
    if (auto run = flash_for<F32Flash, float>(hd, W)) {
      run(ptr<float>(q), ptr<float>(k_cache), ptr<float>(v_cache), bt, n, ctx, H, KVH, block_size, (float)scale,
          ptr<float>(out));
      return out;
    }
  }
#if defined(__AVX512BF16__)
  if (q.scalar_type() == torch::kBFloat16) {
#if defined(__AMX_BF16__)  // with AMX, SDPA's AMX tiles were 2.3-3.6x the dot products' loops: the tiles here
    auto run = !amx_linear_native() ? nullptr : hd == 64 ? prefill_amx<64> : hd == 32 ? prefill_amx<32> : nullptr;
#else
    auto run = flash_for<Bf16Flash, bf16>(hd, 16);
#endif
    if (run) {
      run(ptr<bf16>(q), ptr<bf16>(k_cache), ptr<bf16>(v_cache), bt, n, ctx, H, KVH, block_size, (float)scale,
          ptr<bf16>(out));
      return out;
    }
  }
#endif
#endif
  return prefill_sdpa(q, k_cache, v_cache, blocks, ctx, block_size, scale);
}

// Each row's argmax of logits [B, V] (float32), the first of equal maxima, rows on all threads: the greedy pick.
// torch's max over the rows ran on one thread (1.4 ms of a 64-stream bf16 decode step of SmolLM2's on an Emerald
// Rapids). A row whose maximum equals none of its values (NaN, which -ffast-math's compares do not order) takes 0.
torch::Tensor best_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == torch::kFloat32,
              "logits must be contiguous [rows, vocab] float32");
  const int64_t B = logits.size(0), V = logits.size(1);
  auto out = torch::empty({B}, torch::kInt64);
  const float* lp = ptr<float>(logits);
  int64_t* op = ptr<int64_t>(out);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* l = lp + b * V;
      float mx = -std::numeric_limits<float>::infinity();
      int64_t i = 0, token = -1;
#ifdef INFERD_VEC
      vec m = vset(mx);
      for (; i + W <= V; i += W) m = vmax(m, vload(l + i));
      mx = vhmax(m);
#endif
      for (; i < V; ++i) mx = std::max(mx, l[i]);
      i = 0;
#ifdef INFERD_VEC
      for (; i + W <= V && token < 0; i += W)
        if (const int lane = vfind(vload(l + i), mx); lane >= 0) token = i + lane;
#endif
      for (; i < V && token < 0; ++i)
        if (l[i] == mx) token = i;
      op[b] = std::max<int64_t>(token, 0);
    }
  });
  return out;
}

// One token per row of logits [B, V] (float32), drawn from softmax(logits / temperature) by inverting its
// distribution function at u in [0, 1): the first token whose running sum of weights e^((l - max) / t), summed in
// float64 in token order, passes u * total. A -inf logit (a masked token) weighs exactly 0, so is never drawn; the
// sum is taken 16 tokens at a time, and inside the chunk that passes, the same sums from 0 in the same order find the
// token (so the search always ends on a token of weight > 0 by the last chunk: u * total < total).
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor u) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == torch::kFloat32,
              "logits must be contiguous [rows, vocab] float32");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temperature.is_contiguous() && temperature.scalar_type() == torch::kFloat32 && temperature.numel() == B,
              "temperature must be [rows] float32");
  TORCH_CHECK(u.is_contiguous() && u.scalar_type() == torch::kFloat64 && u.numel() == B, "u must be [rows] float64");
  constexpr int64_t CH = 16;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  auto out = torch::empty({B}, torch::kInt64);
  const float* lp = ptr<float>(logits);
  const float* tp = ptr<float>(temperature);
  const double* up = ptr<double>(u);
  int64_t* op = ptr<int64_t>(out);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(V);
    std::vector<double> chunk((V + CH - 1) / CH);
    for (int64_t b = b0; b < b1; ++b) {
      const float* l = lp + b * V;
      float mx = neg_inf;
      for (int64_t i = 0; i < V; ++i) mx = std::max(mx, l[i]);
      const float inv = 1.f / tp[b];
      int64_t i = 0;
#ifdef INFERD_VEC
      for (; i + W <= V; i += W) {
        const vec x = vload(l + i);
        vstore(w.data() + i, vzero_where(vexp(vmul(vsub(x, vset(mx)), vset(inv))), x, neg_inf));
      }
#endif
      for (; i < V; ++i)
        w[i] = __builtin_bit_cast(uint32_t, l[i]) == __builtin_bit_cast(uint32_t, neg_inf) ? 0.f : std::exp((l[i] - mx) * inv);
      double total = 0;
      for (int64_t c = 0; c < (int64_t)chunk.size(); ++c) {
        double s = 0;
        for (int64_t j = c * CH; j < std::min(V, (c + 1) * CH); ++j) s += w[j];
        chunk[c] = s;
        total += s;
      }
      const double threshold = up[b] * total;
      int64_t token = 0;  // a row of masked tokens only (total 0) takes token 0
      double run = 0;
      for (int64_t c = 0; c < (int64_t)chunk.size() && total > 0; run += chunk[c], ++c) {
        if (!(run + chunk[c] > threshold)) continue;
        double s = 0;
        for (int64_t j = c * CH; j < std::min(V, (c + 1) * CH); ++j) {
          s += w[j];
          if (run + s > threshold) { token = j; break; }
        }
        break;
      }
      op[b] = token;
    }
  });
  return out;
}

// One row through a bf16 linear on AVX-512 BF16: y [1, N] = x [1, K] w^T (+ bias), w in pairs along K,
// [N / 16][K / 2][16][2] (`pair_weights`), so that each vdpbf16ps adds two products to 16 outputs at once, with no
// reduction across lanes; four accumulators over k. oneDNN's prepacked bf16 product reads SmolLM2's 121 linears at
// one row at 18-19 GB/s on a Sapphire Rapids, this at 21-22 (benchmarks/linears.py), and 22-27 with a prefetch 4 KiB
// ahead, one cache line for each four the loop reads (the hardware's stream prefetch alone leaves the cores
// waiting; a prefetch past the end of the tensor is only a hint, never a fault).
constexpr int ROW_PREFETCH_BYTES = 4096;

bool one_row_linear_native() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
// silu(g) u of 16 outputs from the projection's float32 sums (biases added), g and u first rounded to bf16 as the
// projection's output: the same bits as silu_mul on that output (the fused projection's gated kernels, below)
static inline __m512 silu16(__m512 g, __m512 u) {
  return silu_times(_mm512_cvtpbh_ps(_mm512_cvtneps_pbh(g)), _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(u)));
}
#endif

// the checks of a linear on weights in pairs (one_row_linear's, amx_linear's); gated: the fused [gate; up] projection,
// its two halves whole panels. Returns the panels of output (units): P, or P / 2 gated.
static int64_t check_pairs(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias, bool gated) {
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 2 && w.scalar_type() == torch::kBFloat16
              && w.is_contiguous() && w.size(1) * 2 == x.size(1), "w must be [N / 16, K / 2, 16, 2] bfloat16");
  const int64_t P = w.size(0);
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == P * 16 && bias.scalar_type() == torch::kFloat32 && bias.is_contiguous()),
              "bias must be empty or [N] float32");
  TORCH_CHECK(!gated || P % 2 == 0, "a gated projection's halves must be whole panels of 16 outputs");
  return gated ? P / 2 : P;
}

#if defined(__AVX512BF16__)
// 16 outputs at y + i: float32 (f32: a model's logits, which its sampler takes in float32) or rounded to bf16
static inline void put16(void* y, int64_t i, __m512 v, bool f32) {
  if (f32) _mm512_storeu_ps((float*)y + i, v);
  else _mm256_storeu_si256((__m256i*)((bf16*)y + i), (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// A single bf16 row; gated: silu(gate) up of a fused [gate; up] projection (y [1, N / 2]), the up half's panel u
// U panels after the gate's; f32: y in float32.
static torch::Tensor one_row(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias, bool gated,
                             bool f32) {
  TORCH_CHECK(one_row_linear_native(), "one_row_linear needs a build with AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x must be one contiguous bfloat16 row");
  const int64_t U = check_pairs(x, w, bias, gated), K = x.size(1);
  auto y = torch::empty({1, U * 16}, x.options().dtype(f32 ? torch::kFloat32 : torch::kBFloat16));
#if defined(__AVX512BF16__)
  const bf16* xp = ptr<bf16>(x);
  const bf16* wp = ptr<bf16>(w);
  const float* bp = bias.numel() ? ptr<float>(bias) : nullptr;
  void* yp = y.data_ptr();
  auto panel_sums = [&](int64_t p) {  // panel p's 16 outputs, float32, its bias added
    const bf16* panel = wp + p * 16 * K;
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t k2 = 0;
    for (; k2 + 4 <= K / 2; k2 += 4) {
      _mm_prefetch((const char*)(panel + k2 * 32) + ROW_PREFETCH_BYTES, _MM_HINT_T0);
      for (int c = 0; c < 4; ++c)
        a[c] = dot2(a[c], pair(xp + 2 * (k2 + c)), _mm512_loadu_si512(panel + (k2 + c) * 32));
    }
    for (; k2 < K / 2; ++k2) a[0] = dot2(a[0], pair(xp + 2 * k2), _mm512_loadu_si512(panel + k2 * 32));
    __m512 sum = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
    return bp ? _mm512_add_ps(sum, _mm512_loadu_ps(bp + p * 16)) : sum;
  };
  at::parallel_for(0, U, gated ? 2 : 4, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      put16(yp, u * 16, gated ? silu16(panel_sums(u), panel_sums(u + U)) : panel_sums(u), f32);
    }
  });
#endif
  return y;
}

torch::Tensor one_row_linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  return one_row(x, w, bias, false, false);
}
torch::Tensor one_row_gated(torch::Tensor x, torch::Tensor w, torch::Tensor bias) { return one_row(x, w, bias, true, false); }
torch::Tensor one_row_linear_f32(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  return one_row(x, w, bias, false, true);
}

// A few rows (2-64: a decode step's) through a bf16 linear on AMX tiles, from the same weights in pairs along K as
// one_row_linear: a panel of 16 outputs over 32 inputs, [16 pairs][16][2], is one B tile as the tiles' bf16
// products take it (TDPBF16PS), so the panels stream from memory in order, prefetched 4 KiB ahead as there, with no
// repacking. Each panel's rows run as up to 4 tiles of 16 rows, accumulated in float32 over K and rounded once.
// oneDNN's prepacked product on the same tiles read SmolLM2's 120 layer linears at 7-16 GB/s at 2-64 rows on an
// Emerald Rapids, this at 9-24: 1.5-2.1x as fast at 2-32 rows, 1.4x at 48, 1.2x at 64
// (benchmarks/results/amx-linear-emr.md).
#if defined(__AMX_BF16__)
// The weights stream in two steps: into L2 16 KiB ahead, into L1 1 KiB ahead (one step of K). Against 4 KiB ahead into
// L1, as one_row_linear's, the 120 layer linears took 0.90-0.96x the time at 24-64 rows on an Emerald Rapids, 1.00x
// at 2-16 (benchmarks/results/amx-linear-prefetch-ab-emr.json), where one tile of rows keeps the 4 KiB.
constexpr int AMX_L2_PREFETCH_BYTES = 16384, AMX_L1_PREFETCH_BYTES = 1024;
// K-steps s0..s1 (32 inputs each) of one panel into the tiles as they hold; far: the weights the loop reads s1 - s0 steps
// on (where it goes next), fetched into L2 a step at a time (from 2 tiles of rows; one tile keeps the 4 KiB ahead).
template <int MT>
static inline void amx_steps(const bf16* x, int64_t K, const bf16* panel, int64_t s0, int64_t s1, const char* far) {
  const int64_t stride = K * 2;
  for (int64_t kb = s0; kb < s1; ++kb) {
    const bf16* b = panel + kb * 512;
    for (int line = 0; line < 16; ++line) {
      if constexpr (MT == 1) {
        _mm_prefetch((const char*)b + ROW_PREFETCH_BYTES + 64 * line, _MM_HINT_T0);
      } else {
        _mm_prefetch(far + (kb - s0) * 1024 + 64 * line, _MM_HINT_T1);
        _mm_prefetch((const char*)b + AMX_L1_PREFETCH_BYTES + 64 * line, _MM_HINT_T0);
      }
    }
    _tile_loadd(6, b, 64);
    const bf16* a = x + kb * 32;
    if constexpr (MT == 1) {
      _tile_loadd(5, a, stride); _tile_dpbf16ps(0, 5, 6);
    } else if constexpr (MT == 2) {
      _tile_loadd(4, a, stride); _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, a + 16 * K, stride); _tile_dpbf16ps(1, 5, 6);
    } else if constexpr (MT == 3) {
      _tile_loadd(4, a, stride); _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, a + 16 * K, stride); _tile_dpbf16ps(1, 7, 6);
      _tile_loadd(5, a + 32 * K, stride); _tile_dpbf16ps(2, 5, 6);
    } else {
      _tile_loadd(4, a, stride); _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, a + 16 * K, stride); _tile_dpbf16ps(1, 7, 6);
      _tile_loadd(4, a + 32 * K, stride); _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(5, a + 48 * K, stride); _tile_dpbf16ps(3, 5, 6);
    }
  }
}

// tiles 0..MT-1 (c: [MT][16][16] float32) zeroed, loaded, stored
template <int MT> static inline void amx_zero() {
  _tile_zero(0);
  if constexpr (MT > 1) _tile_zero(1);
  if constexpr (MT > 2) _tile_zero(2);
  if constexpr (MT > 3) _tile_zero(3);
}
template <int MT> static inline void amx_load(const float* c) {
  _tile_loadd(0, c, 64);
  if constexpr (MT > 1) _tile_loadd(1, c + 256, 64);
  if constexpr (MT > 2) _tile_loadd(2, c + 512, 64);
  if constexpr (MT > 3) _tile_loadd(3, c + 768, 64);
}
template <int MT> static inline void amx_store(float* c) {
  _tile_stored(0, c, 64);
  if constexpr (MT > 1) _tile_stored(1, c + 256, 64);
  if constexpr (MT > 2) _tile_stored(2, c + 512, 64);
  if constexpr (MT > 3) _tile_stored(3, c + 768, 64);
}

// One panel of 16 outputs for MT tiles of rows into c [MT][16][16]: tiles 0..MT-1 accumulate; 4 and 7 take turns
// holding a full tile of rows, 5 the last tile of rows (as many rows as are left); 6 the weights.
template <int MT>
static inline void amx_panel(const bf16* x, int64_t K, const bf16* panel, float* c) {
  amx_zero<MT>();
  amx_steps<MT>(x, K, panel, 0, K / 32, (const char*)panel + AMX_L2_PREFETCH_BYTES);
  amx_store<MT>(c);
}

// The output's panel u (16 outputs of y's N) of M rows, rounded to bf16 (f32: in float32): panel u's sums (c [M][16]
// float32) plus its bias; gated (up: the up half's sums, panel u + U), silu(gate) up of the two.
static inline void amx_put(const float* c, const float* up, int64_t M, const float* bp, int64_t u, int64_t U, int64_t N,
                           void* yp, bool f32) {
  const __m512 b = bp ? _mm512_loadu_ps(bp + u * 16) : _mm512_setzero_ps();
  const __m512 bu = bp && up ? _mm512_loadu_ps(bp + (u + U) * 16) : _mm512_setzero_ps();
  for (int64_t m = 0; m < M; ++m) {
    __m512 v = _mm512_add_ps(_mm512_load_ps(c + 16 * m), b);
    if (up) v = silu16(v, _mm512_add_ps(_mm512_load_ps(up + 16 * m), bu));
    put16(yp, m * N + u * 16, v, f32);
  }
}

// 33-64 rows larger than L1 (48 KiB; 64 rows of 576 bf16 are 72): each panel re-read its rows from L2, and those
// reads held back the weights' stream from memory (in a scratch copy on an Emerald Rapids, the same products with one
// tile of rows for all four streamed at 29-30 GB/s, as they are at 22.5-24). Here K runs in 2-3 chunks whose rows fit
// in 32 KiB, each chunk over a group of AMX_GROUP panels, the tiles' partial sums kept between chunks in a buffer (in
// L2). At 1,536 inputs (6 chunks) the partial sums' traffic made it slower, so at most 3 chunks; at 33 rows (38 KiB)
// it was slower too (benchmarks/README.md, "K in chunks").
constexpr int64_t AMX_L1_BYTES = 49152, AMX_CHUNK_BYTES = 32768, AMX_MAX_CHUNKS = 3, AMX_GROUP = 16;
// Gated (U output panels of 2 U), a group is AMX_GROUP / 2 output panels' gate panels, then their up panels.
template <int MT>
static void amx_chunked(const bf16* xp, int64_t M, int64_t K, const bf16* wp, int64_t U, bool gated, const float* bp,
                        void* yp, bool f32, int64_t chunks, const TileConfig& cfg) {
  const int64_t N = U * 16, steps = K / 32, per = (steps + chunks - 1) / chunks, group = gated ? AMX_GROUP / 2 : AMX_GROUP;
  at::parallel_for(0, U, 1, [&](int64_t u0, int64_t u1) {
    _tile_loadconfig(&cfg);
    alignas(64) float sums[AMX_GROUP * 1024];  // [panel of the group][64 rows][16]
    for (int64_t g0 = u0; g0 < u1; g0 += group) {
      const int64_t n = std::min(u1, g0 + group) - g0, panels = gated ? 2 * n : n;
      auto panel = [&](int64_t i) { return i < n ? g0 + i : g0 + i - n + U; };  // the group's i-th
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t s0 = ch * per, s1 = std::min(steps, s0 + per);
        for (int64_t i = 0; i < panels; ++i) {
          float* c = sums + i * 1024;
          if (ch == 0) amx_zero<MT>(); else amx_load<MT>(c);
          int64_t np = i + 1 < panels ? panel(i + 1) : g0, nch = i + 1 < panels ? ch : ch + 1;  // read next (far prefetch)
          if (nch == chunks) np = g0 + n, nch = 0;
          amx_steps<MT>(xp, K, wp + panel(i) * 16 * K, s0, s1, (const char*)(wp + np * 16 * K + nch * per * 512));
          amx_store<MT>(c);
          if (ch + 1 == chunks && (!gated || i >= n)) {
            if (gated) amx_put(sums + (i - n) * 1024, c, M, bp, g0 + i - n, U, N, yp, f32);
            else amx_put(c, nullptr, M, bp, g0 + i, U, N, yp, f32);
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

#if defined(__AMX_BF16__)
// More rows than AMX_MAX_ROWS (a prefill's): blocks of 32 rows x 2 panels (32 outputs), 4 C tiles, each A tile (16
// rows x 32 inputs) serving both panels and each B tile (a panel's 32 inputs) both row tiles: 4 loads a 4 products,
// against 5 for 4 in amx_panel. A thread takes pairs of panels; their weights stay in its L2 while every block of
// rows passes (the rows are re-read from L2 each pair). The last block is padded with zero rows.
static void amx_many_rows(const bf16* xp, int64_t M, int64_t K, const bf16* wp, int64_t P, const float* bp, bf16* yp) {
  const int64_t N = P * 16, blocks = (M + 31) / 32, tail = M - 32 * (blocks - 1);
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t q0, int64_t q1) {
    _tile_loadconfig(&cfg);
    alignas(64) float c[4 * 256];
    std::vector<bf16> padded;  // the last block's rows, then zeros
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t p = 2 * q;
      const bool two = p + 1 < P;
      const bf16 *b0 = wp + p * 16 * K, *b1 = b0 + 16 * K;
      for (int64_t r = 0; r < blocks; ++r) {
        const int64_t rows = r + 1 < blocks ? 32 : tail;
        const bf16* a = xp + 32 * r * K;
        if (rows < 32) {
          if (padded.empty()) {
            padded.assign(32 * K, bf16(0));
            std::memcpy(padded.data(), a, rows * K * sizeof(bf16));
          }
          a = padded.data();
        }
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t k = 0; k < K; k += 32) {
          _tile_loadd(4, a + k, K * 2);
          _tile_loadd(5, a + 16 * K + k, K * 2);
          _tile_loadd(6, b0 + k * 16, 64);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6);
          if (two) {
            _tile_loadd(7, b1 + k * 16, 64);
            _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64);
        if (two) { _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64); }
        for (int64_t h = 0; h < 1 + two; ++h) {  // panel p + h: c [h][row][16]
          const __m512 b = bp ? _mm512_loadu_ps(bp + (p + h) * 16) : _mm512_setzero_ps();
          for (int64_t m = 0; m < rows; ++m)
            put16(yp, (32 * r + m) * N + (p + h) * 16, _mm512_add_ps(_mm512_load_ps(c + 512 * h + 16 * m), b), false);
        }
      }
    }
    _tile_release();
  });
}
#endif

// gated: silu(gate) up of a fused [gate; up] projection, y [M, N / 2]; f32: y in float32 (as one_row's)
static torch::Tensor amx_rows(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias, bool gated,
                              bool f32) {
  TORCH_CHECK(amx_linear_native(), "amx_linear needs a build with AMX bf16, on a kernel that lets it use the tiles");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous()
              && x.size(1) % 32 == 0, "x must be contiguous bfloat16 rows of a multiple of 32 inputs");
  const int64_t U = check_pairs(x, w, bias, gated), M = x.size(0), K = x.size(1), P = w.size(0), N = U * 16;
#if defined(__AMX_BF16__)
  const bf16* xp = ptr<bf16>(x);
  const bf16* wp = ptr<bf16>(w);
  const float* bp = bias.numel() ? ptr<float>(bias) : nullptr;
  if (M > AMX_MAX_ROWS) {
    auto y = torch::empty({M, P * 16}, x.options());
    amx_many_rows(xp, M, K, wp, P, bp, ptr<bf16>(y));
    y = gated ? silu_mul(y) : y;
    return f32 ? y.to(torch::kFloat32) : y;
  }
  auto y = torch::empty({M, N}, x.options().dtype(f32 ? torch::kFloat32 : torch::kBFloat16));
  void* yp = y.data_ptr();
  const int tiles = (int)((M + 15) / 16), last = (int)(M - 16 * (tiles - 1));
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  for (int t = 0; t < tiles; ++t) cfg.rows[t] = t == tiles - 1 ? last : 16;
  cfg.rows[4] = cfg.rows[6] = cfg.rows[7] = 16;
  cfg.rows[5] = last;
  for (int t = tiles; t < 4; ++t) cfg.colsb[t] = 0;
  const int64_t chunks = (M * K * 2 + AMX_CHUNK_BYTES - 1) / AMX_CHUNK_BYTES;
  if (tiles >= 3 && M * K * 2 > AMX_L1_BYTES && chunks <= AMX_MAX_CHUNKS) {
    if (tiles == 3) amx_chunked<3>(xp, M, K, wp, U, gated, bp, yp, f32, chunks, cfg);
    else amx_chunked<4>(xp, M, K, wp, U, gated, bp, yp, f32, chunks, cfg);
    return y;
  }
  at::parallel_for(0, U, 1, [&](int64_t u0, int64_t u1) {
    _tile_loadconfig(&cfg);  // each thread's own tiles
    alignas(64) float c[2][4 * 256];
    for (int64_t u = u0; u < u1; ++u) {
      for (int h = 0; h < 1 + gated; ++h) {  // the gate's panel, then the up's
        const bf16* panel = wp + (u + h * U) * 16 * K;
        switch (tiles) {
          case 1: amx_panel<1>(xp, K, panel, c[h]); break;
          case 2: amx_panel<2>(xp, K, panel, c[h]); break;
          case 3: amx_panel<3>(xp, K, panel, c[h]); break;
          default: amx_panel<4>(xp, K, panel, c[h]); break;
        }
      }
      amx_put(c[0], gated ? c[1] : nullptr, M, bp, u, U, N, yp, f32);
    }
    _tile_release();
  });
  return y;
#else
  return torch::empty({M, N}, x.options());
#endif
}

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias) { return amx_rows(x, w, bias, false, false); }
torch::Tensor amx_gated(torch::Tensor x, torch::Tensor w, torch::Tensor bias) { return amx_rows(x, w, bias, true, false); }
torch::Tensor amx_linear_f32(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  return amx_rows(x, w, bias, false, true);
}
"""
FUNCTIONS = ["rms_norm", "add_rms_norm", "silu_mul", "rope_cache", "paged_decode", "prefill_attention",
             "sample_rows", "best_rows", "one_row_linear_native", "one_row_linear", "one_row_gated",
             "one_row_linear_f32", "amx_linear_native", "amx_linear", "amx_gated", "amx_linear_f32"]
DTYPES = (torch.float32, torch.bfloat16)  # what the C++ ops take


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [slots, KVH, hd], [..., nb] block ids -> [..., nb * block_size, KVH, hd], a whole block at a time."""
    paged = cache.view(-1, block_size, *cache.shape[1:])
    return paged.index_select(0, blocks.flatten()).view(*blocks.shape[:-1], -1, *cache.shape[1:])


class TorchKernels:
    """The ops in plain torch, with the C++ ops' signatures."""

    # the last rotation made (positions, cos, its [T, 1, hd/2] complex factors): every layer of a forward passes
    # the same positions tensor, so the rotation is made once per forward, not once per layer
    _rotation: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def rms_norm(x, w, eps):
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    @staticmethod
    def add_rms_norm(x, residual, w, eps):
        residual.add_(x)
        return F.rms_norm(residual, (x.shape[-1],), w, eps)

    @staticmethod
    def silu_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @classmethod
    def rope_cache(cls, qkv, cos, sin, positions, k_cache, v_cache, slots, heads, kv_heads):
        hd = k_cache.shape[-1]
        qk = qkv[:, :(heads + kv_heads) * hd].view(-1, heads + kv_heads, hd)
        pairs = torch.view_as_complex(qk.float().reshape(*qk.shape[:-1], -1, 2))
        last = cls._rotation  # read once: another engine's thread may replace it
        if last is not None and last[0] is positions and last[1] is cos:
            cis = last[2]
        else:
            cis = torch.complex(cos[positions], sin[positions]).unsqueeze(1)
            cls._rotation = (positions, cos, cis)
        q, k = torch.view_as_real(pairs * cis).flatten(-2).to(qkv.dtype).split([heads, kv_heads], dim=1)
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, qkv[:, (heads + kv_heads) * hd:].view(-1, kv_heads, hd))
        return q

    @staticmethod
    def paged_decode(q, k_cache, v_cache, block_tables, context_lens, block_size, scale):
        d, heads, hd = q.shape
        kv_heads = k_cache.shape[1]
        keys = gather_blocks(k_cache, block_tables, block_size).transpose(1, 2)  # [D, KVH, S, hd]
        values = gather_blocks(v_cache, block_tables, block_size).transpose(1, 2)
        q = q.view(d, kv_heads, heads // kv_heads, hd)
        visible = torch.arange(keys.shape[2]) < context_lens.unsqueeze(1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None, None, :], scale=scale)
        return out.reshape(d, heads, hd)

    @staticmethod
    def prefill_attention(q, k_cache, v_cache, blocks, ctx, block_size, scale):
        n = q.shape[0]
        keys = gather_blocks(k_cache, blocks, block_size)[:ctx].transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, hd]
        values = gather_blocks(v_cache, blocks, block_size)[:ctx].transpose(0, 1).unsqueeze(0)
        q = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        if n == ctx:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            visible = torch.arange(ctx) <= torch.arange(ctx - n, ctx).unsqueeze(1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)

    @staticmethod
    def best_rows(logits):
        # the first of equal maxima; max over a dim found it 2.4x sooner than argmax at 64 rows of SmolLM2's
        # vocabulary (0.84 vs 2.0 ms on a 2-core Sapphire Rapids)
        return logits.max(dim=-1).indices

    @staticmethod
    def sample_rows(logits, temperature, u):
        cdf = (logits / temperature.unsqueeze(1)).softmax(dim=-1).double().cumsum(dim=-1)
        # u < 1, so u * total < total (rounded too): the first sum above it is a token's with probability, never a
        # masked one, and u = 0 takes the first such token
        return torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)


def kernels_for(dtype: torch.dtype, cpp: bool = True):
    """The C++ ops where they are wanted, take `dtype` and build here; else TorchKernels."""
    module = load_cpp_kernels() if cpp and dtype in DTYPES else None
    return TorchKernels if module is None else module


@per_march
def load_cpp_kernels(march: str = "native"):
    """The compiled module, or None where it cannot be built here. `march` other than this CPU's own is for tests:
    "haswell" builds the AVX2 loops on an AVX-512 machine."""
    if os.environ.get("INFERD_NO_CPP_KERNELS"):
        return None
    try:
        log.info("building the decoder's C++ kernels (cached after the first time)")
        return build("inferd_cpu_kernels", SOURCE, FUNCTIONS, march, cflags=("-ffast-math",))
    except Exception as e:  # no compiler, no ninja: the torch ops serve
        log.warning("C++ kernels unavailable (%s); using torch ops", e)
        return None
