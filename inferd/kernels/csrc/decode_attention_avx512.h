// Part of decode_attention.cpp (included there once, inside its INFERD_VEC loops): bf16 caches on AVX-512.
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
