// float32 rows through linears whose weights are kept in bf16 (AVX2 + FMA): a decode step's few rows read half the
// bytes of float32 weights, each weight widened to float32 in registers (its bits shifted up by 16) and every product
// and sum in float32. The weights are panels of 16 outputs, [P][K][16] bf16 (inferd/models/packed.py,
// panel_weights), each 16 in the order that one vpunpcklwd / vpunpckhwd against zero widens into outputs 0-7 and
// 8-15: stored [0-3, 8-11, 4-7, 12-15]. A thread takes whole panels and runs every row block (of up to 4 rows) over
// one before the next, so that a panel is read from memory once (K = 1,536: 48 KiB, from L2 after the first block).
#include "vec.h"
#include "kernels.h"

bool bf16w_linear_native() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
// the weights ~4 KiB ahead of the loop, as one_row_linear reads its own (a prefetch past the end is only a hint)
constexpr int F32_PREFETCH_BYTES = 4096;

// MR rows (x, ldx apart) against one panel's K steps into acc [MR][2] (outputs 0-7, 8-15); KU steps of K at a time,
// each with its own accumulators, so that MR x 2 x KU >= 6 products are in flight (an FMA's latency over its two
// ports)
template <int MR, int KU>
static inline void panel_rows(const float* x, int64_t ldx, int64_t K, const bf16* panel, __m256 (&acc)[MR][2]) {
  const __m256i zero = _mm256_setzero_si256();
  __m256 a[KU][MR][2];
  for (int u = 0; u < KU; ++u)
    for (int m = 0; m < MR; ++m) a[u][m][0] = a[u][m][1] = _mm256_setzero_ps();
  int64_t k = 0;
  auto step = [&](int u, int64_t kk) {
    const __m256i w = _mm256_loadu_si256((const __m256i*)(panel + kk * 16));
    const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w));
    const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w));
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * ldx + kk);
      a[u][m][0] = _mm256_fmadd_ps(xb, lo, a[u][m][0]);
      a[u][m][1] = _mm256_fmadd_ps(xb, hi, a[u][m][1]);
    }
  };
  for (; k + KU <= K; k += KU) {
    _mm_prefetch((const char*)(panel + k * 16) + F32_PREFETCH_BYTES, _MM_HINT_T0);
    if constexpr (KU > 1) _mm_prefetch((const char*)(panel + k * 16) + F32_PREFETCH_BYTES + 64, _MM_HINT_T0);
    for (int u = 0; u < KU; ++u) step(u, k + u);
  }
  for (; k < K; ++k) step(0, k);
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) {
      __m256 s = a[0][m][h];
      for (int u = 1; u < KU; ++u) s = _mm256_add_ps(s, a[u][m][h]);
      acc[m][h] = s;
    }
}

// MR rows of one panel into out, its 16 outputs of each row ldo apart (its bias added)
template <int MR>
static inline void panel_block(const float* x, int64_t K, const bf16* panel, const float* bias, float* out,
                               int64_t ldo) {
  __m256 acc[MR][2];
  panel_rows<MR, MR == 1 ? 4 : MR == 2 ? 2 : 1>(x, K, K, panel, acc);
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(out + ldo * m, _mm256_add_ps(acc[m][0], b0));
    _mm256_storeu_ps(out + ldo * m + 8, _mm256_add_ps(acc[m][1], b1));
  }
}

// all M rows of one panel into out (rows ldo apart), in blocks of 4 rows (the last 1-3)
static void panel_all_rows(const float* x, int64_t M, int64_t K, const bf16* panel, const float* bias, float* out,
                           int64_t ldo) {
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) panel_block<4>(x + r * K, K, panel, bias, out + ldo * r, ldo);
  switch (M - r) {
    case 3: panel_block<3>(x + r * K, K, panel, bias, out + ldo * r, ldo); break;
    case 2: panel_block<2>(x + r * K, K, panel, bias, out + ldo * r, ldo); break;
    case 1: panel_block<1>(x + r * K, K, panel, bias, out + ldo * r, ldo); break;
    default: break;
  }
}
#endif

// y [M, P * 16] float32 = x [M, K] float32 w^T (+ bias), w [P, K, 16] bf16 (panel_weights); gated: the fused
// [gate; up] projection (its two halves whole panels), y [M, P * 8] = silu(gate) up
static at::Tensor bf16w(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, bool gated) {
  TORCH_CHECK(bf16w_linear_native(), "bf16w_linear needs a build with AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous float32 rows");  // no rows at all too: a prefill chunk that wants no logits
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 16 && w.scalar_type() == at::kBFloat16 && w.is_contiguous()
              && w.size(1) == x.size(1), "w must be [N / 16, K, 16] bfloat16");
  const int64_t P = w.size(0), M = x.size(0), K = x.size(1);
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == P * 16 && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              "bias must be empty or [N] float32");
  TORCH_CHECK(!gated || P % 2 == 0, "a gated projection's halves must be whole panels of 16 outputs");
  const int64_t U = gated ? P / 2 : P, N = U * 16;
  auto y = at::empty({M, N}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  const float* xp = ptr<float>(x);
  const bf16* wp = ptr<bf16>(w);
  const float* bp = bias.numel() ? ptr<float>(bias) : nullptr;
  float* yp = ptr<float>(y);
  at::parallel_for(0, U, gated ? 1 : 2, [&](int64_t u0, int64_t u1) {
    std::vector<float> gu(gated ? 2 * 16 * M : 0);  // gated: the gate panel's M rows [M][16], then the up's
    for (int64_t u = u0; u < u1; ++u) {
      if (!gated) {
        panel_all_rows(xp, M, K, wp + u * K * 16, bp ? bp + u * 16 : nullptr, yp + u * 16, N);
        continue;
      }
      float *g = gu.data(), *up = g + 16 * M;
      panel_all_rows(xp, M, K, wp + u * K * 16, bp ? bp + u * 16 : nullptr, g, 16);
      panel_all_rows(xp, M, K, wp + (u + U) * K * 16, bp ? bp + (u + U) * 16 : nullptr, up, 16);
      for (int64_t m = 0; m < M; ++m)
        for (int i = 0; i < 16; i += W)
          vstore(yp + m * N + u * 16 + i, silu_times(vload(g + 16 * m + i), vload(up + 16 * m + i)));
    }
  });
#endif
  return y;
}

at::Tensor bf16w_linear(at::Tensor x, at::Tensor w, at::Tensor bias) { return bf16w(x, w, bias, false); }
at::Tensor bf16w_gated(at::Tensor x, at::Tensor w, at::Tensor bias) { return bf16w(x, w, bias, true); }
