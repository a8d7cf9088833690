// The vector helpers the decoder's kernels share: bf16 as bits, float32 vectors of this CPU's width (AVX-512,
// AVX2 + FMA; none elsewhere: scalar loops), e^x, silu, prefetches.
#pragma once
#include "aten.h"
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

template <typename T> static T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// f(T{}) with T the element type of t: float or bf16
template <typename F> static void by_dtype(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) f(float{});
  else if (t.scalar_type() == at::kBFloat16) f(bf16{});
  else TORCH_CHECK(false, "float32 or bfloat16 only, got ", t.scalar_type());
}

[[maybe_unused]] static void check(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have the dtype of the input");
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
#endif

#ifdef INFERD_VEC
template <int HINT> static inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char*)p + b, (_mm_hint)HINT);
}
#endif
