// bf16 linears on the weights in pairs along K: one row on AVX-512 BF16, 2-64 rows (and prefills' blocks) on AMX.
#include "vec.h"
#include "amx.h"
#include "kernels.h"

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
static int64_t check_pairs(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, bool gated) {
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 2 && w.scalar_type() == at::kBFloat16
              && w.is_contiguous() && w.size(1) * 2 == x.size(1), "w must be [N / 16, K / 2, 16, 2] bfloat16");
  const int64_t P = w.size(0);
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == P * 16 && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
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
static at::Tensor one_row(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, bool gated,
                             bool f32) {
  TORCH_CHECK(one_row_linear_native(), "one_row_linear needs a build with AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be one contiguous bfloat16 row");
  const int64_t U = check_pairs(x, w, bias, gated), K [[maybe_unused]] = x.size(1);
  auto y = at::empty({1, U * 16}, x.options().dtype(f32 ? at::kFloat : at::kBFloat16));
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

at::Tensor one_row_linear(at::Tensor x, at::Tensor w, at::Tensor bias) {
  return one_row(x, w, bias, false, false);
}
at::Tensor one_row_gated(at::Tensor x, at::Tensor w, at::Tensor bias) { return one_row(x, w, bias, true, false); }
at::Tensor one_row_linear_f32(at::Tensor x, at::Tensor w, at::Tensor bias) {
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
static at::Tensor amx_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, bool gated,
                              bool f32) {
  TORCH_CHECK(amx_linear_native(), "amx_linear needs a build with AMX bf16, on a kernel that lets it use the tiles");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.scalar_type() == at::kBFloat16 && x.is_contiguous()
              && x.size(1) % 32 == 0, "x must be contiguous bfloat16 rows of a multiple of 32 inputs");
  const int64_t U = check_pairs(x, w, bias, gated), M = x.size(0), N = U * 16;
  [[maybe_unused]] const int64_t K = x.size(1), P = w.size(0);
#if defined(__AMX_BF16__)
  const bf16* xp = ptr<bf16>(x);
  const bf16* wp = ptr<bf16>(w);
  const float* bp = bias.numel() ? ptr<float>(bias) : nullptr;
  if (M > AMX_MAX_ROWS) {
    auto y = at::empty({M, P * 16}, x.options());
    amx_many_rows(xp, M, K, wp, P, bp, ptr<bf16>(y));
    y = gated ? silu_mul(y) : y;
    return f32 ? y.to(at::kFloat) : y;
  }
  auto y = at::empty({M, N}, x.options().dtype(f32 ? at::kFloat : at::kBFloat16));
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
  return at::empty({M, N}, x.options());
#endif
}

at::Tensor amx_linear(at::Tensor x, at::Tensor w, at::Tensor bias) { return amx_rows(x, w, bias, false, false); }
at::Tensor amx_gated(at::Tensor x, at::Tensor w, at::Tensor bias) { return amx_rows(x, w, bias, true, false); }
at::Tensor amx_linear_f32(at::Tensor x, at::Tensor w, at::Tensor bias) {
  return amx_rows(x, w, bias, false, true);
}
