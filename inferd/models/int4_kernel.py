"""Q4_1 linears on AVX-512 BF16: the 4-bit weights widened to bf16 in registers, multiplied by bf16 rows.

Layout (`pack_panels`): panels of 16 output channels; in each, groups of 32 weights along K as 256 bytes of
nibbles, ordered so that one 32-byte load holds two bf16 dot-product operands (vdpbf16ps adds the products of a
pair of inputs to 16 outputs at once): byte i of chunk c holds, low nibble, the weight of output i / 2 at input
2 c + i % 2 of the group, high nibble the one at input 2 (c + 8) + i % 2. Each group's d and m stay fp16, as a Q4_1
file stores them, 64 bytes beside its 256: 5 bits a weight, the file's own size, and y = sum_g d_g (q . x)_g +
m_g (sum of x)_g is exact against the file's weights up to float32 accumulation.

The bytes are widened to 16 bits straight from memory, and a nibble becomes its bf16 by a lookup of the word's low
5 bits in a table of 0..15 written twice (vpermw: no mask for the low nibble, one shift for the high; a bf16 of
128 + q by one bitwise op was as fast, but its m - 128 d correction cost float32 bits: 0.1-0.3 % of its outputs
were a bf16 step off the nearest, none of these).
Several accumulators per row keep the dot products' latency hidden. Up to 8 rows share each widened weight; more
rows run in tiles of at most 8, as even as possible, over the same panel (it stays in L1/L2). Panels are split
across the threads. On a 2-core AVX-512 BF16 EPYC (Zen 4), SmolLM2's 120 layer linears at one row: 2.9 ms (23
GB/s) against torch's `_weight_int4pack_mm_for_cpu` 4.4 ms, 1.6-2.1x from 2 rows on, and faster than the dense
bf16 copy up to 64 rows (benchmarks/results/int4-linear-zen4.md).
"""
import functools
import logging
import os

import torch

from inferd.models.cpu_kernels import _cpu_tag

log = logging.getLogger(__name__)

GROUP = 32  # weights per (d, m) pair along K, as in Q4_1
PANEL = 16  # output channels per panel: one AVX-512 register of float32

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>

bool int4_linear_native() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
using bf16 = uint16_t;

static inline __m512bh pair(const bf16* p) {  // inputs p[0], p[1] in every lane pair
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

static inline __m512 widen(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// R rows (x: [R, K] at stride K, xsum: [R, G]) against one panel: y[r, n0 .. n0 + 16) (+ bias); A accumulators a
// row (4 hide the dot products' latency at one row; 2 leave registers for 8 rows)
template <int R, int A>
static void panel_rows(const uint8_t* w, const uint16_t* dm, int64_t G, const bf16* x, int64_t K, const float* xsum,
                       const float* bias, bf16* y, int64_t N, int64_t n0, __m512i table) {
  __m512 out[R];
  for (int r = 0; r < R; ++r) out[r] = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = w + g * 256;
    __m512 acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm512_setzero_ps();
    #pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(b + c * 32)));
      const __m512bh wlo = (__m512bh)_mm512_permutexvar_epi16(v, table);
      const __m512bh whi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
      const int a = A == 4 ? (c & 1) * 2 : 0;
      for (int r = 0; r < R; ++r) {
        const bf16* xr = x + r * K + g * 32;
        acc[r][a] = _mm512_dpbf16_ps(acc[r][a], wlo, pair(xr + 2 * c));
        acc[r][a + 1] = _mm512_dpbf16_ps(acc[r][a + 1], whi, pair(xr + 2 * (c + 8)));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dm + g * 32)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dm + g * 32 + 16)));
    for (int r = 0; r < R; ++r) {
      __m512 s = _mm512_add_ps(acc[r][0], acc[r][1]);
      if constexpr (A == 4) s = _mm512_add_ps(s, _mm512_add_ps(acc[r][2], acc[r][3]));
      out[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * G + g]), _mm512_fmadd_ps(s, d, out[r]));
    }
  }
  const __mmask16 mask = (__mmask16)((1u << std::min<int64_t>(16, N - n0)) - 1);
  for (int r = 0; r < R; ++r) _mm256_mask_storeu_epi16(y + r * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(out[r]));
}

static void panel_tile(int64_t R, const uint8_t* w, const uint16_t* dm, int64_t G, const bf16* x, int64_t K,
                       const float* xsum, const float* bias, bf16* y, int64_t N, int64_t n0, __m512i table) {
  switch (R) {
    case 1: return panel_rows<1, 4>(w, dm, G, x, K, xsum, bias, y, N, n0, table);
    case 2: return panel_rows<2, 4>(w, dm, G, x, K, xsum, bias, y, N, n0, table);
    case 3: return panel_rows<3, 4>(w, dm, G, x, K, xsum, bias, y, N, n0, table);
    case 4: return panel_rows<4, 4>(w, dm, G, x, K, xsum, bias, y, N, n0, table);
    case 5: return panel_rows<5, 2>(w, dm, G, x, K, xsum, bias, y, N, n0, table);
    case 6: return panel_rows<6, 2>(w, dm, G, x, K, xsum, bias, y, N, n0, table);
    case 7: return panel_rows<7, 2>(w, dm, G, x, K, xsum, bias, y, N, n0, table);
    default: return panel_rows<8, 2>(w, dm, G, x, K, xsum, bias, y, N, n0, table);
  }
}
#endif

// x: [M, K] bf16; w: [P, G, 8, 32] uint8 (pack_panels); dm: [P, G, 2, 16] fp16; bias: [P * 16] fp32 or empty.
// Returns y: [M, N] bf16.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor dm, torch::Tensor bias, int64_t N) {
  TORCH_CHECK(int4_linear_native(), "int4_linear needs a build with AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kBFloat16, "x: contiguous [M, K] bf16");
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.scalar_type() == torch::kUInt8 && w.size(2) == 8 && w.size(3) == 32,
              "w: [P, G, 8, 32] uint8");
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0), G = w.size(1);
  TORCH_CHECK(K == G * 32 && P * 16 >= N && N > (P - 1) * 16, "x and w disagree on K, or w on N");
  TORCH_CHECK(dm.is_contiguous() && dm.scalar_type() == torch::kFloat16 && dm.numel() == P * G * 32,
              "dm: [P, G, 2, 16] fp16");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == P * 16 && bias.scalar_type() == torch::kFloat32 && bias.is_contiguous()),
              "bias: empty or [P * 16] float32");
  auto y = torch::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  const bf16* xp = (const bf16*)x.data_ptr();
  std::vector<float> xsum(M * G);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g)
      xsum[r * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(widen(xp + r * K + g * 32), widen(xp + r * K + g * 32 + 16)));
  alignas(64) uint16_t values[32];  // bf16 of 0..15 (twice over)
  for (int i = 0; i < 32; ++i) values[i] = __builtin_bit_cast(uint32_t, float(i & 15)) >> 16;
  const __m512i table = _mm512_load_si512(values);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* dp = (const uint16_t*)dm.data_ptr();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  bf16* yp = (bf16*)y.data_ptr();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = 0, tiles = (M + 7) / 8, t = 0; t < tiles; r += M / tiles + (t < M % tiles), ++t)
        panel_tile(M / tiles + (t < M % tiles), wp + p * G * 256, dp + p * G * 32, G, xp + r * K, K,
                   xsum.data() + r * G, bp, yp + r * N, N, p * 16, table);
  });
#endif
  return y;
}
"""


@functools.cache
def load_int4_kernel():
    """The compiled module where this CPU has AVX-512 BF16 and it builds, else None (torch's int4 kernel serves)."""
    from inferd.models.cpu import cpu_flags

    if os.environ.get("INFERD_NO_CPP_KERNELS") or "avx512_bf16" not in cpu_flags():
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        log.info("building the int4 linear kernel (cached after the first time)")
        module = load_inline(name=f"inferd_int4_linear_{_cpu_tag()}", cpp_sources=SOURCE,
                             functions=["int4_linear_native", "int4_linear"],
                             extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                             verbose=False)
    except Exception as e:  # no compiler: torch's kernel serves
        log.warning("int4 linear kernel unavailable (%s); using torch's _weight_int4pack_mm_for_cpu", e)
        return None
    return module if module.int4_linear_native() else None


def pack_panels(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q uint8 [N, K] (0..15), d and m [N, K / 32] -> the kernel's nibbles uint8 [P, G, 8, 32] and its d and m
    fp16 [P, G, 2, 16], N padded to P * 16 with zero rows."""
    n, k = q.shape
    panels, groups = -(-n // PANEL), k // GROUP
    padded = torch.zeros(panels * PANEL, k, dtype=torch.uint8)
    padded[:n] = q
    pairs = padded.view(panels, PANEL, groups, GROUP // 2, 2).permute(0, 2, 3, 1, 4).reshape(panels, groups, 16, 32)
    nibbles = (pairs[:, :, :8] | (pairs[:, :, 8:] << 4)).contiguous()
    dm = torch.zeros(panels * PANEL, groups, 2)
    dm[:n, :, 0], dm[:n, :, 1] = d, m
    return nibbles, dm.view(panels, PANEL, groups, 2).permute(0, 2, 3, 1).contiguous().half()
