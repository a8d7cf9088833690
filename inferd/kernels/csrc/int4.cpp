// Q4_1 linears (inferd/models/int4.py): bf16 rows on AVX-512 BF16 and VNNI, float32 rows on AVX2; inputs rounded to
// 16-bit integers a group, or to int8 (int4_linear_int8). The layout: inferd/models/int4_kernel.py, pack_panels.
// The module builds with -ffast-math (the decoder's kernels: so that exp vectorizes); this file's code never did.
#pragma GCC optimize("no-fast-math")
#include "kernels.h"
#include "aten.h"
#include <ATen/Parallel.h>
#include <cstring>
#include <type_traits>
#include <vector>

bool int4_linear_bf16_native() {  // bf16 rows, rounded to 16 or 8 bits: AVX-512 BF16 and VNNI
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

bool int4_linear_fp32_native() {  // float32 rows: AVX2 and FMA
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

// f(std::integral_constant<int, R>{}) with R = rows, or MAX above it: a loop compiled for each row count up to MAX
template <int MAX, typename F>
static void by_rows(int64_t rows, const F& f) {
  if constexpr (MAX > 1)
    if (rows < MAX) return by_rows<MAX - 1>(rows, f);
  f(std::integral_constant<int, MAX>{});
}

// Rows x: [M, K] rounded a group of 32 at a time by round(group, its integers, &its sum) -> its step: the integers
// [M, K], each group's step and sum [M, K / 32]. Rows split across the threads from 17 (a 1,024-row prompt's
// rounding is a few per cent of its linears). round: a lambda, inlined (a function pointer is called per group).
template <typename Q>
struct RoundedRows {
  std::vector<Q> q;
  std::vector<float> scale, sum;

  template <typename X, typename F>
  RoundedRows(const X* x, int64_t M, int64_t K, F round) : q(M * K), scale(M * K / 32), sum(M * K / 32) {
    const int64_t G = K / 32;
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t g = 0; g < G; ++g)
          scale[r * G + g] = round(x + r * K + g * 32, q.data() + r * K + g * 32, &sum[r * G + g]);
    });
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <immintrin.h>
using bf16 = uint16_t;

static inline __m512 widen(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// One group of 32 bf16 inputs -> integers of Q (int16 or int8) on the group's scale (its largest |x| to Q's
// largest; returned: the value of one step), and the sum the m term multiplies: int16, the inputs' exact sum (as the
// AVX2 loop takes it); int8, the rounded inputs' sum, so that their rounding errors meet the weights d q + m, centred
// on 0, not the nibbles q alone (on the exact sum the error was 3x larger)
template <typename Q>
static inline float round_group(const bf16* x, Q* q, float* sum) {
  constexpr bool I8 = std::is_same_v<Q, int8_t>;
  constexpr float top = I8 ? 127.0f : 32767.0f;
  const __m512 a = widen(x), b = widen(x + 16);
  const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float step = largest / top;
  float inverse = top / largest;
  if (!(inverse < INFINITY)) inverse = 0.0f;  // all zero, or too small for a finite scale
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)));
  if constexpr (I8) {
    _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(qb));
    *sum = step * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  } else {
    _mm256_storeu_si256((__m256i*)q, _mm512_cvtsepi32_epi16(qa));
    _mm256_storeu_si256((__m256i*)(q + 16), _mm512_cvtsepi32_epi16(qb));
    *sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
  return step;
}

// R rows (xq: [R, K] at stride K, int16 or int8; xscale, xsum: [R, G]) against one panel: y[r, n0 .. n0 + 16)
// (+ bias); A accumulators a row (4 hide the products' latency at one row; 2 leave registers for 8 rows).
// int16 inputs (bf16 rows): the AVX2 loop's arithmetic on AVX-512 VNNI, a 32-byte chunk widened to words, and
// vpdpwssd adds a lane's two nibble x input products to it exactly in 32 bits.
// int8 inputs (int4_linear_int8): 64 bytes of nibbles (chunks c, c + 1) put in lane order by one word permute (lane
// j: output j's nibbles at inputs 2c .. 2c + 3 low, 2c + 16 .. 2c + 19 high), and vpdpbusd adds 4 products a lane.
template <int R, int A, typename Q>
static void panel_rows(const uint8_t* w, const uint16_t* dm, int64_t G, const Q* xq, int64_t K, const float* xscale,
                       const float* xsum, const float* bias, bf16* y, int64_t N, int64_t n0, __m512i order) {
  constexpr bool I8 = std::is_same_v<Q, int8_t>;
  constexpr int STEPS = I8 ? 4 : 8, INPUTS = I8 ? 4 : 2;  // a group's loads; inputs each takes of the low nibbles
  const __m512i low = I8 ? _mm512_set1_epi8(0xF) : _mm512_set1_epi16(0xF);
  __m512 out[R];
  for (int r = 0; r < R; ++r) out[r] = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = w + g * 256;
    __m512i acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm512_setzero_si512();
    #pragma GCC unroll 8
    for (int i = 0; i < STEPS; ++i) {
      __m512i lo, hi;
      if constexpr (I8) {
        const __m512i v = _mm512_permutexvar_epi16(order, _mm512_loadu_si512(b + i * 64));
        lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      } else {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(b + i * 32)));
        lo = _mm512_and_si512(v, low), hi = _mm512_srli_epi16(v, 4);
      }
      const int a = A == 4 ? (i & 1) * 2 : 0;
      for (int r = 0; r < R; ++r) {
        const Q* xr = xq + r * K + g * 32 + INPUTS * i;
        int32_t x_lo, x_hi;  // the inputs of the low nibbles, and of the high ones 16 further
        std::memcpy(&x_lo, xr, 4);
        std::memcpy(&x_hi, xr + 16, 4);
        if constexpr (I8) {
          acc[r][a] = _mm512_dpbusd_epi32(acc[r][a], lo, _mm512_set1_epi32(x_lo));
          acc[r][a + 1] = _mm512_dpbusd_epi32(acc[r][a + 1], hi, _mm512_set1_epi32(x_hi));
        } else {
          acc[r][a] = _mm512_dpwssd_epi32(acc[r][a], lo, _mm512_set1_epi32(x_lo));
          acc[r][a + 1] = _mm512_dpwssd_epi32(acc[r][a + 1], hi, _mm512_set1_epi32(x_hi));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dm + g * 32)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dm + g * 32 + 16)));
    for (int r = 0; r < R; ++r) {
      __m512i s = _mm512_add_epi32(acc[r][0], acc[r][1]);
      if constexpr (A == 4) s = _mm512_add_epi32(s, _mm512_add_epi32(acc[r][2], acc[r][3]));
      out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(xscale[r * G + g])),
                               _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * G + g]), out[r]));
    }
  }
  const __mmask16 mask = (__mmask16)((1u << std::min<int64_t>(16, N - n0)) - 1);
  for (int r = 0; r < R; ++r) _mm256_mask_storeu_epi16(y + r * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(out[r]));
}

#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// float32 rows on AVX2: each group of 32 inputs is rounded to 16-bit integers on its own scale (its largest |x| to
// 32767), and the nibbles multiply them as 16-bit integers (vpmaddwd: two products a lane, summed exactly in 32
// bits), so that no nibble is converted to float: a 16-byte half of a chunk widened to 16 bits holds output j's
// nibbles at inputs (2c, 2c + 1) in lanes 2j and 2j + 1, low nibbles, and (2c + 16, 2c + 17) as high ones. The
// group's integer sum times d and the inputs' scale, plus m times the group's float sum of x, is its share.
template <int R>
static void panel_rows_fp32(const uint8_t* w, const uint16_t* dm, int64_t G, const int16_t* xq, int64_t K,
                            const float* xscale, const float* xsum, const float* bias, float* y, int64_t N, int64_t n0) {
  const __m256i low = _mm256_set1_epi16(0xF);
  for (int h = 0; h < 2; ++h) {
    __m256 out[R];
    for (int r = 0; r < R; ++r) out[r] = bias ? _mm256_loadu_ps(bias + n0 + 8 * h) : _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = w + g * 256 + h * 16;
      __m256i acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      #pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(b + c * 32)));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_srli_epi16(v, 4);
        for (int r = 0; r < R; ++r) {
          const int16_t* x = xq + r * K + g * 32 + 2 * c;
          int32_t pair_lo, pair_hi;
          std::memcpy(&pair_lo, x, 4);
          std::memcpy(&pair_hi, x + 16, 4);
          acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(lo, _mm256_set1_epi32(pair_lo)));
          acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(hi, _mm256_set1_epi32(pair_hi)));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dm + g * 32 + 8 * h)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dm + g * 32 + 16 + 8 * h)));
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_cvtepi32_ps(_mm256_add_epi32(acc[r][0], acc[r][1]));
        out[r] = _mm256_fmadd_ps(s, _mm256_mul_ps(d, _mm256_set1_ps(xscale[r * G + g])),
                                 _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[r * G + g]), out[r]));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t n = n0 + 8 * h, left = N - n;
      if (left >= 8) {
        _mm256_storeu_ps(y + r * N + n, out[r]);
      } else if (left > 0) {
        alignas(32) float tail[8];
        _mm256_store_ps(tail, out[r]);
        std::memcpy(y + r * N + n, tail, left * sizeof(float));
      }
    }
  }
}

// One group of 32 float inputs -> 16-bit integers on the group's scale (returned: the value of one step) and the
// group's float sum.
static inline float quantize_group(const float* x, int16_t* q, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], mx = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    total = _mm256_add_ps(total, v[i]);
  }
  alignas(32) float lanes[8], sums[8];
  _mm256_store_ps(lanes, mx);
  _mm256_store_ps(sums, total);
  float largest = 0, s = 0;
  for (int i = 0; i < 8; ++i) largest = std::max(largest, lanes[i]), s += sums[i];
  *sum = s;
  const float step = largest / 32767.0f;
  float inverse = 32767.0f / largest;
  if (!(inverse < INFINITY)) inverse = 0.0f;  // all zero, or too small for a finite scale (the m term keeps its sum)
  for (int i = 0; i < 4; i += 2) {  // nearest integers (|q| <= 32767), packed back in order
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], _mm256_set1_ps(inverse)));
    _mm256_storeu_si256((__m256i*)(q + 8 * i), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
  }
  return step;
}

// int8 inputs on AVX2 (int4_linear_int8 of float32 rows): vpmaddubsw multiplies 32 nibbles (unsigned bytes) by 32
// int8 inputs and adds each pair of products into a 16-bit word: 32 products an instruction where a float32 FMA has
// 8 and vpmaddwd 16. Each panel's nibbles are first spread to bytes in that instruction's order (spread_panel), once
// for all of its rows: a chunk's low and high nibbles interleaved a word at a time, so that register A holds outputs
// 0-3 and 8-11, B outputs 4-7 and 12-15, each 32-bit lane one output at inputs (2c, 2c + 1, 2c + 16, 2c + 17); d
// and m as float32 in the same order. Rows go in tiles of 2 (4 accumulators a row; tiles of 3 and 4 were 5-15 %
// slower in AVX2 code on an Emerald Rapids).
#ifndef TILE_I8
#define TILE_I8 2
#endif
constexpr int64_t SPREAD_GROUP = 512 + 32 * 4;  // bytes a group: 8 chunks x (A, B) and d, m (A, B order) as float32

static void spread_panel(const uint8_t* w, const uint16_t* dm, int64_t G, uint8_t* out) {
  const __m256i low = _mm256_set1_epi8(0xF);
  for (int64_t g = 0; g < G; ++g) {
    uint8_t* o = out + g * SPREAD_GROUP;
    for (int c = 0; c < 8; ++c) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(w + g * 256 + c * 32));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      _mm256_storeu_si256((__m256i*)(o + c * 64), _mm256_unpacklo_epi16(lo, hi));
      _mm256_storeu_si256((__m256i*)(o + c * 64 + 32), _mm256_unpackhi_epi16(lo, hi));
    }
    float* f = (float*)(o + 512);
    for (int i = 0; i < 2; ++i) {  // d, then m
      const __m256 first = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dm + g * 32 + 16 * i)));
      const __m256 second = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dm + g * 32 + 16 * i + 8)));
      _mm256_storeu_ps(f + 16 * i, _mm256_permute2f128_ps(first, second, 0x20));
      _mm256_storeu_ps(f + 16 * i + 8, _mm256_permute2f128_ps(first, second, 0x31));
    }
  }
}

// One group of 32 float inputs -> int8 on the group's scale (its largest |x| to 127; returned: one step), stored in
// the order the spread nibbles take them (4 bytes a chunk c: inputs 2c, 2c + 1, 2c + 16, 2c + 17), and the rounded
// inputs' sum, as the AVX-512 int8 loop takes it
static inline float quantize_group_i8(const float* x, int8_t* q, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float largest = 0;
  for (int i = 0; i < 8; ++i) largest = std::max(largest, lanes[i]);
  const float step = largest / 127.0f;
  float inverse = 127.0f / largest;
  if (!(inverse < INFINITY)) inverse = 0.0f;
  __m256i n[4];
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  alignas(32) int32_t sums[8];
  _mm256_store_si256((__m256i*)sums, total);
  int32_t s = 0;
  for (int i = 0; i < 8; ++i) s += sums[i];
  *sum = step * (float)s;
  const __m256i first = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[0], n[1]), 0xD8);   // inputs 0-15, int16
  const __m256i second = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[2], n[3]), 0xD8);  // inputs 16-31
  // bytes: 0-7, 16-23 | 8-15, 24-31; then each 128-bit lane's pairs in chunk order
  const __m256i bytes = _mm256_packs_epi16(first, second);
  const __m256i order = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                         0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
  _mm256_storeu_si256((__m256i*)q, _mm256_shuffle_epi8(bytes, order));
  return step;
}

// R rows (xq: [R, K] as quantize_group_i8 stores them; xscale, xsum: [R, G]) against one spread panel: a word of
// vpmaddubsw is at most 2 x 15 x 127 = 3810, so a group's 8 chunks add up in 16 bits (at most 30480) before
// vpmaddwd widens each pair of words (one output) to 32 bits.
template <int R>
static void panel_rows_i8(const uint8_t* spread, int64_t G, const int8_t* xq, int64_t K, const float* xscale,
                          const float* xsum, const float* bias, float* y, int64_t N, int64_t n0) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 out[R][2];
  for (int r = 0; r < R; ++r) {
    if (bias) {
      const __m256 first = _mm256_loadu_ps(bias + n0), second = _mm256_loadu_ps(bias + n0 + 8);
      out[r][0] = _mm256_permute2f128_ps(first, second, 0x20);
      out[r][1] = _mm256_permute2f128_ps(first, second, 0x31);
    } else {
      out[r][0] = out[r][1] = _mm256_setzero_ps();
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = spread + g * SPREAD_GROUP;
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    #pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i a = _mm256_loadu_si256((const __m256i*)(b + c * 64));
      const __m256i bb = _mm256_loadu_si256((const __m256i*)(b + c * 64 + 32));
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * K + g * 32 + 4 * c, 4);
        const __m256i x = _mm256_set1_epi32(four);
        acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(a, x));
        acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(bb, x));
      }
    }
    const float* f = (const float*)(b + 512);
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_loadu_ps(f + 8 * h), m = _mm256_loadu_ps(f + 16 + 8 * h);
      for (int r = 0; r < R; ++r)
        out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][h], ones)),
                                    _mm256_mul_ps(d, _mm256_set1_ps(xscale[r * G + g])),
                                    _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[r * G + g]), out[r][h]));
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float row[16];
    _mm256_store_ps(row, _mm256_permute2f128_ps(out[r][0], out[r][1], 0x20));
    _mm256_store_ps(row + 8, _mm256_permute2f128_ps(out[r][0], out[r][1], 0x31));
    std::memcpy(y + r * N + n0, row, std::min<int64_t>(16, N - n0) * sizeof(float));
  }
}

#endif

// Every panel (split across the threads) against the M rows in tiles of at most T, as even as possible (each
// panel stays in L1/L2 while its tiles pass): tile(panel, first row, rows)
template <typename F>
static void panels_by_tiles(int64_t P, int64_t M, int64_t T, const F& tile) {
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = 0, tiles = (M + T - 1) / T, t = 0; t < tiles; r += M / tiles + (t < M % tiles), ++t)
        tile(p, r, M / tiles + (t < M % tiles));
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
// bf16 rows x: [M, K] rounded to Q a group of 32, against every panel into y: [M, N] bf16
template <typename Q>
static void integer_rows(const at::Tensor& x, const uint8_t* wp, const uint16_t* dp, const float* bp, int64_t P,
                         int64_t G, int64_t N, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1);
  const bf16* xp = (const bf16*)x.data_ptr();
  const RoundedRows<Q> xq(xp, M, K, [](auto... a) { return round_group<Q>(a...); });
  alignas(64) uint16_t words[32];  // int8: word 2j from the first chunk's word j, word 2j + 1 from the second's
  for (int j = 0; j < 16; ++j) words[2 * j] = j, words[2 * j + 1] = 16 + j;
  const __m512i order = _mm512_load_si512(words);
  bf16* yp = (bf16*)y.data_ptr();
  panels_by_tiles(P, M, 8, [&](int64_t p, int64_t r, int64_t rows) {
    by_rows<8>(rows, [&](auto R) {  // 4 accumulators a row hide the products' latency; 2 leave registers for 8
      constexpr int Rows = decltype(R)::value;
      panel_rows<Rows, Rows <= 4 ? 4 : 2>(wp + p * G * 256, dp + p * G * 32, G, xq.q.data() + r * K, K,
                                          xq.scale.data() + r * G, xq.sum.data() + r * G, bp, yp + r * N, N, p * 16,
                                          order);
    });
  });
}
#endif

static void check_weights(const at::Tensor& x, const at::Tensor& w, const at::Tensor& dm,
                          const at::Tensor& bias, int64_t N) {
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.scalar_type() == at::kByte && w.size(2) == 8 && w.size(3) == 32,
              "w: [P, G, 8, 32] uint8");
  const int64_t K = x.size(1), P = w.size(0), G = w.size(1);
  TORCH_CHECK(K == G * 32 && P * 16 >= N && N > (P - 1) * 16, "x and w disagree on K, or w on N");
  TORCH_CHECK(dm.is_contiguous() && dm.scalar_type() == at::kHalf && dm.numel() == P * G * 32,
              "dm: [P, G, 2, 16] fp16");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == P * 16 && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              "bias: empty or [P * 16] float32");
}

// x: [M, K] bf16 or float32; w: [P, G, 8, 32] uint8 (pack_panels); dm: [P, G, 2, 16] fp16; bias: [P * 16] fp32 or
// empty. Returns y: [M, N] of x's dtype.
at::Tensor int4_linear(at::Tensor x, at::Tensor w, at::Tensor dm, at::Tensor bias, int64_t N) {
  const bool bf = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (bf || x.scalar_type() == at::kFloat),
              "x: contiguous [M, K] bf16 or float32");
  TORCH_CHECK(bf ? int4_linear_bf16_native() : int4_linear_fp32_native(),
              bf ? "bf16 rows need a build with AVX-512 BF16 and VNNI" : "float32 rows need a build with AVX2 and FMA");
  check_weights(x, w, dm, bias, N);
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0), G = w.size(1);
  auto y = at::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* dp = (const uint16_t*)dm.data_ptr();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  if (bf) integer_rows<int16_t>(x, wp, dp, bp, P, G, N, y);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (!bf) {
    const float* xp = x.data_ptr<float>();
    const RoundedRows<int16_t> xq(xp, M, K, [](auto... a) { return quantize_group(a...); });
    float* yp = y.data_ptr<float>();
    panels_by_tiles(P, M, 4, [&](int64_t p, int64_t r, int64_t rows) {
      by_rows<4>(rows, [&](auto R) {
        panel_rows_fp32<decltype(R)::value>(wp + p * G * 256, dp + p * G * 32, G, xq.q.data() + r * K, K,
                                            xq.scale.data() + r * G, xq.sum.data() + r * G, bp, yp + r * N, N, p * 16);
      });
    });
  }
#endif
  return y;
}

// As int4_linear, each group of 32 inputs rounded to int8 on its own scale (llama.cpp's Q4_1 x Q8_1): bf16 rows on
// AVX-512 VNNI, float32 rows on AVX2
at::Tensor int4_linear_int8(at::Tensor x, at::Tensor w, at::Tensor dm, at::Tensor bias, int64_t N) {
  const bool bf = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (bf || x.scalar_type() == at::kFloat),
              "x: contiguous [M, K] bf16 or float32");
  TORCH_CHECK(bf ? int4_linear_bf16_native() : int4_linear_fp32_native(),
              bf ? "int8 inputs of bf16 rows need a build with AVX-512 VNNI and BF16"
                 : "int8 inputs of float32 rows need a build with AVX2 and FMA");
  check_weights(x, w, dm, bias, N);
  auto y = at::empty({x.size(0), N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* dp = (const uint16_t*)dm.data_ptr();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  if (bf) integer_rows<int8_t>(x, wp, dp, bp, w.size(0), w.size(1), N, y);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (!bf) {
    const int64_t M = x.size(0), K = x.size(1), P = w.size(0), G = w.size(1);
    const float* xp = x.data_ptr<float>();
    const RoundedRows<int8_t> xq(xp, M, K, [](auto... a) { return quantize_group_i8(a...); });
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {  // panels_by_tiles, each panel spread first
      std::vector<uint8_t> spread(G * SPREAD_GROUP);  // (through it with a thread_local buffer: slower, scratch timing)
      for (int64_t p = p0; p < p1; ++p) {
        spread_panel(wp + p * G * 256, dp + p * G * 32, G, spread.data());
        for (int64_t r = 0, tiles = (M + TILE_I8 - 1) / TILE_I8, t = 0; t < tiles; ++t) {
          const int64_t rows = M / tiles + (t < M % tiles);
          by_rows<TILE_I8>(rows, [&](auto R) {
            panel_rows_i8<decltype(R)::value>(spread.data(), G, xq.q.data() + r * K, K, xq.scale.data() + r * G,
                                              xq.sum.data() + r * G, bp, yp + r * N, N, p * 16);
          });
          r += rows;
        }
      }
    });
  }
#endif
  return y;
}
