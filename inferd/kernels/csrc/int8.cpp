// Weight-only int8 linears (inferd/models/quant.py): int8 panels of 16 outputs widened to float32 rows on AVX2 and FMA
// (one row on AVX-512, 1-3 rows on VNNI as 16-bit integers).
// The module builds with -ffast-math (the decoder's kernels: so that exp vectorizes); this file's code never did.
#pragma GCC optimize("no-fast-math")
#include "kernels.h"
#include "aten.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <immintrin.h>
#include <vector>

constexpr int64_t NR = 16, MR = 6, VNNI_MAX_M = 3;

static inline void widen16(const int8_t* p, __m256& lo, __m256& hi) {
  __m128i v = _mm_loadu_si128((const __m128i*)p);
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}

// y[r, 0:cols] = (x[r, :] . panel) * scale (+ bias) for R rows; panel is int8 [K, 16] or fp32 [K, 16]
template <int R, bool INT8>
static inline void tile(const float* x, int64_t ldx, const void* panel, int64_t K, const float* scale,
                        const float* bias, float* y, int64_t ldy, int64_t cols) {
  __m256 acc[R][2];
  #pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 b0, b1;
    if constexpr (INT8) {
      widen16((const int8_t*)panel + k * NR, b0, b1);
    } else {
      b0 = _mm256_loadu_ps((const float*)panel + k * NR);
      b1 = _mm256_loadu_ps((const float*)panel + k * NR + 8);
    }
    #pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
  const __m256 c0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 c1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  #pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    __m256 v0 = _mm256_fmadd_ps(acc[r][0], s0, c0), v1 = _mm256_fmadd_ps(acc[r][1], s1, c1);
    if (cols == NR) {
      _mm256_storeu_ps(y + r * ldy, v0);
      _mm256_storeu_ps(y + r * ldy + 8, v1);
    } else {
      alignas(32) float tmp[NR];
      _mm256_store_ps(tmp, v0);
      _mm256_store_ps(tmp + 8, v1);
      for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = tmp[c];
    }
  }
}

// 7-12 rows against half a panel (8 channels at column h): each int8 weight widened once for all rows
template <int R>
static inline void half_tile(const float* x, int64_t ldx, const int8_t* panel, int64_t h, int64_t K,
                             const float* scale, const float* bias, float* y, int64_t ldy, int64_t cols) {
  __m256 acc[R];
  #pragma GCC unroll 12
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(panel + k * NR + h))));
    #pragma GCC unroll 12
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * ldx + k), b, acc[r]);
  }
  const __m256 s = _mm256_loadu_ps(scale + h), c = bias ? _mm256_loadu_ps(bias + h) : _mm256_setzero_ps();
  #pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, _mm256_fmadd_ps(acc[r], s, c));
    for (int64_t j = 0; j < std::min<int64_t>(8, cols - h); ++j) y[r * ldy + h + j] = tmp[j];
  }
}

static void rows_7_to_12(int64_t M, const float* x, int64_t ldx, const int8_t* panel, int64_t K,
                         const float* scale, const float* bias, float* y, int64_t ldy, int64_t cols) {
  for (int64_t h = 0; h < cols; h += 8) {
    switch (M) {
      case 7: half_tile<7>(x, ldx, panel, h, K, scale, bias, y, ldy, cols); break;
      case 8: half_tile<8>(x, ldx, panel, h, K, scale, bias, y, ldy, cols); break;
      case 9: half_tile<9>(x, ldx, panel, h, K, scale, bias, y, ldy, cols); break;
      case 10: half_tile<10>(x, ldx, panel, h, K, scale, bias, y, ldy, cols); break;
      case 11: half_tile<11>(x, ldx, panel, h, K, scale, bias, y, ldy, cols); break;
      default: half_tile<12>(x, ldx, panel, h, K, scale, bias, y, ldy, cols); break;
    }
  }
}

// one row, int8 panel, four independent accumulator pairs over k (decode at batch 1)
static inline void row(const float* x, const int8_t* panel, int64_t K, const float* scale, const float* bias,
                       float* y, int64_t cols) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    __m256 b0, b1, b2, b3, b4, b5, b6, b7;
    widen16(panel + k * NR, b0, b1);
    widen16(panel + (k + 1) * NR, b2, b3);
    widen16(panel + (k + 2) * NR, b4, b5);
    widen16(panel + (k + 3) * NR, b6, b7);
    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k), b0, a0);
    a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k), b1, a1);
    a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k + 1), b2, a2);
    a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k + 1), b3, a3);
    a4 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k + 2), b4, a4);
    a5 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k + 2), b5, a5);
    a6 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k + 3), b6, a6);
    a7 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k + 3), b7, a7);
  }
  for (; k < K; ++k) {
    __m256 b0, b1;
    widen16(panel + k * NR, b0, b1);
    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k), b0, a0);
    a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k), b1, a1);
  }
  a0 = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a4, a6));
  a1 = _mm256_add_ps(_mm256_add_ps(a1, a3), _mm256_add_ps(a5, a7));
  const __m256 c0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 c1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  alignas(32) float tmp[NR];
  _mm256_store_ps(tmp, _mm256_fmadd_ps(a0, _mm256_loadu_ps(scale), c0));
  _mm256_store_ps(tmp + 8, _mm256_fmadd_ps(a1, _mm256_loadu_ps(scale + 8), c1));
  for (int64_t c = 0; c < cols; ++c) y[c] = tmp[c];
}

#if defined(__AVX512F__)
// one row on AVX-512: a panel's 16 channels are one register (1.3-1.4x the AVX2 row above on lm_head, 49,152 x 576,
// on a Sapphire Rapids: benchmarks/cpu_kernels.py)
static inline __m512 widen16x(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline void row512(const float* x, const int8_t* panel, int64_t K, const float* scale, const float* bias,
                          float* y, int64_t cols) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    a0 = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), widen16x(panel + k * NR), a0);
    a1 = _mm512_fmadd_ps(_mm512_set1_ps(x[k + 1]), widen16x(panel + (k + 1) * NR), a1);
    a2 = _mm512_fmadd_ps(_mm512_set1_ps(x[k + 2]), widen16x(panel + (k + 2) * NR), a2);
    a3 = _mm512_fmadd_ps(_mm512_set1_ps(x[k + 3]), widen16x(panel + (k + 3) * NR), a3);
  }
  for (; k < K; ++k) a0 = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), widen16x(panel + k * NR), a0);
  const __m512 c = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 v = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)), _mm512_loadu_ps(scale), c);
  _mm512_mask_storeu_ps(y, (__mmask16)((1u << cols) - 1), v);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Up to VNNI_MAX_M rows on AVX-512 VNNI, K a multiple of 32: each row rounded to 16-bit integers a group of 32 on
// its own scale (its largest |x| to 32767: an input moves by at most 1/65534 of that), then vpdpwssd adds a lane's two
// products of weight and input exactly in 32 bits: no weight is converted to float. 32 bytes of the panel (k, k + 1)
// widened to 16 bits and put in pairs by one word permute (lane j: channel j at k and k + 1) make 32 products a row
// in 1 instruction more, where row512 spends 6 (widen, convert, FMA twice) and the AVX2 rows 4 a row: at one row
// 1.45x row512's speed from the caches on a Zen 4.
static inline float round_group16(const float* x, int16_t* q) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  float inverse = 32767.0f / largest;
  if (!(inverse < INFINITY)) inverse = 0.0f;  // all zero, or too small for a finite scale
  _mm256_storeu_si256((__m256i*)q, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)))));
  _mm256_storeu_si256((__m256i*)(q + 16),
                      _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)))));
  return largest / 32767.0f;
}

template <int R>  // R rows (xq: [R, K], xstep: [R, K / 32]) against one panel; y: [R, ldy]
static inline void rows_vnni(const int16_t* xq, const float* xstep, const int8_t* panel, int64_t K, const float* scale,
                             const float* bias, float* y, int64_t ldy, int64_t cols, __m512i pairs) {
  constexpr int A = R == 1 ? 4 : 2;  // accumulators a row: enough to hide vpdpwssd's latency
  const int64_t G = K / 32;
  __m512 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* b = panel + g * 32 * NR;
    __m512i acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm512_setzero_si512();
    #pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      const __m512i w = _mm512_permutexvar_epi16(pairs, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(b + 32 * i))));
      for (int r = 0; r < R; ++r) {
        const int32_t* x = (const int32_t*)(xq + r * K + g * 32);  // inputs (k, k + 1) as one int32
        acc[r][i % A] = _mm512_dpwssd_epi32(acc[r][i % A], w, _mm512_set1_epi32(x[i]));
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512i s = _mm512_add_epi32(acc[r][0], acc[r][1]);
      if constexpr (A == 4) s = _mm512_add_epi32(s, _mm512_add_epi32(acc[r][2], acc[r][3]));
      out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(xstep[r * G + g]), out[r]);
    }
  }
  const __m512 c = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r)
    _mm512_mask_storeu_ps(y + r * ldy, (__mmask16)((1u << cols) - 1), _mm512_fmadd_ps(out[r], _mm512_loadu_ps(scale), c));
}
#endif

template <bool INT8>
static void rows_at_most_6(int64_t R, const float* x, int64_t ldx, const void* panel, int64_t K, const float* scale,
                 const float* bias, float* y, int64_t ldy, int64_t cols) {
  switch (R) {
    case 1: return tile<1, INT8>(x, ldx, panel, K, scale, bias, y, ldy, cols);
    case 2: return tile<2, INT8>(x, ldx, panel, K, scale, bias, y, ldy, cols);
    case 3: return tile<3, INT8>(x, ldx, panel, K, scale, bias, y, ldy, cols);
    case 4: return tile<4, INT8>(x, ldx, panel, K, scale, bias, y, ldy, cols);
    case 5: return tile<5, INT8>(x, ldx, panel, K, scale, bias, y, ldy, cols);
    default: return tile<6, INT8>(x, ldx, panel, K, scale, bias, y, ldy, cols);
  }
}

// all M rows against one panel, in tiles of at most MR rows as even as possible (8 = 4 + 4, not 6 + 2)
template <bool INT8>
static void rows(int64_t M, const float* x, int64_t ldx, const void* panel, int64_t K, const float* scale,
                 const float* bias, float* y, int64_t ldy, int64_t cols) {
  const int64_t tiles = (M + MR - 1) / MR;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t r = M / tiles + (t < M % tiles);
    rows_at_most_6<INT8>(r, x + m * ldx, ldx, panel, K, scale, bias, y + m * ldy, ldy, cols);
    m += r;
  }
}

// x: [M, K] fp32; packed: [P, K, 16] int8; scale: [P * 16] fp32; bias: [N] fp32 or empty. Returns [M, N].
at::Tensor int8_linear(at::Tensor x, at::Tensor packed, at::Tensor scale, at::Tensor bias,
                          int64_t N, int64_t fused_max_m) {
  TORCH_CHECK(x.dtype() == at::kFloat && packed.dtype() == at::kChar, "fp32 x, int8 weights");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous(), "contiguous 2-d x");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && packed.size(2) == NR && P * NR >= N, "packed weight shape");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;  // a step whose rows sample none (a prompt's chunk before its last): the row loops take M >= 1
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  std::vector<float> padded_bias;
  if (bias.numel()) {
    padded_bias.assign(P * NR, 0.f);
    std::copy(bias.data_ptr<float>(), bias.data_ptr<float>() + N, padded_bias.begin());
  }
  const float* bp = bias.numel() ? padded_bias.data() : nullptr;
  float* yp = y.data_ptr<float>();
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (M <= VNNI_MAX_M && K % 32 == 0) {
    std::vector<int16_t> xq(M * K);
    std::vector<float> xstep(M * K / 32);
    for (int64_t g = 0; g < M * K / 32; ++g) xstep[g] = round_group16(xp + g * 32, xq.data() + g * 32);
    alignas(64) uint16_t words[32];  // word 2j from k's channel j, word 2j + 1 from k + 1's
    for (int j = 0; j < 16; ++j) words[2 * j] = j, words[2 * j + 1] = 16 + j;
    const __m512i pairs = _mm512_load_si512(words);
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int8_t* panel = wp + p * K * NR;
        const float* b = bp ? bp + p * NR : nullptr;
        const int64_t cols = std::min(NR, N - p * NR);
        switch (M) {
          case 1: rows_vnni<1>(xq.data(), xstep.data(), panel, K, sp + p * NR, b, yp + p * NR, N, cols, pairs); break;
          case 2: rows_vnni<2>(xq.data(), xstep.data(), panel, K, sp + p * NR, b, yp + p * NR, N, cols, pairs); break;
          default: rows_vnni<3>(xq.data(), xstep.data(), panel, K, sp + p * NR, b, yp + p * NR, N, cols, pairs);
        }
      }
    });
    return y;
  }
#endif
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wide;  // one panel widened to fp32 when several row tiles reuse it
    for (int64_t p = begin; p < end; ++p) {
      const int8_t* panel = wp + p * K * NR;
      const int64_t cols = std::min(NR, N - p * NR);
      const float* s = sp + p * NR;
      const float* b = bp ? bp + p * NR : nullptr;
      if (M == 1) {
#if defined(__AVX512F__)
        row512(xp, panel, K, s, b, yp + p * NR, cols);
#else
        row(xp, panel, K, s, b, yp + p * NR, cols);
#endif
        continue;
      }
      if (M <= MR) {
        rows<true>(M, xp, K, panel, K, s, b, yp + p * NR, N, cols);
        continue;
      }
      if (M <= fused_max_m) {
        TORCH_CHECK(M <= 2 * MR, "fused_max_m is at most 12");
        rows_7_to_12(M, xp, K, panel, K, s, b, yp + p * NR, N, cols);
        continue;
      }
      wide.resize(K * NR);
      for (int64_t i = 0; i < K * NR; i += 8)
        _mm256_storeu_ps(wide.data() + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(panel + i)))));
      rows<false>(M, xp, K, wide.data(), K, s, b, yp + p * NR, N, cols);
    }
  });
  return y;
}
