// Prefill attention: a prompt chunk against its context in the cache blocks.
#include "vec.h"
#include "amx.h"
#include "kernels.h"
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/scaled_dot_product_attention.h>

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
static at::Tensor prefill_sdpa(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& blocks, int64_t ctx, int64_t block_size, double scale) {
  const int64_t n = q.size(0), KVH = k_cache.size(1), hd = k_cache.size(2);
  auto gather = [&](const at::Tensor& c) {
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
  auto out = at::empty_like(q);  // [n, H, hd]
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
at::Tensor prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor blocks,
                                int64_t ctx, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && q.size(2) == k_cache.size(2)
              && q.size(1) % k_cache.size(1) == 0, "q: [n, H, hd], caches: [slots, KVH, hd] with KVH dividing H");
  check(q, q, "q"); check(k_cache, q, "k_cache"); check(v_cache, q, "v_cache");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() == 1 && blocks.is_contiguous(), "int64 blocks [nb]");
  const int64_t n = q.size(0), H = q.size(1), hd = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(0 < n && n <= ctx && ctx <= blocks.numel() * block_size, "need 0 < n <= ctx <= the blocks' slots");
  const int64_t* bt = blocks.data_ptr<int64_t>();
  for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; ++b)
    TORCH_CHECK(0 <= bt[b] && bt[b] < k_cache.size(0) / block_size, "block id out of range");
  auto out = at::empty_like(q);
#ifdef INFERD_VEC
  if (q.scalar_type() == at::kFloat && W == 16) {  // with AVX2's 8 lanes, 0.7-1.1x SDPA: not taken
    if (auto run = flash_for<F32Flash, float>(hd, W)) {
      run(ptr<float>(q), ptr<float>(k_cache), ptr<float>(v_cache), bt, n, ctx, H, KVH, block_size, (float)scale,
          ptr<float>(out));
      return out;
    }
  }
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16) {
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
