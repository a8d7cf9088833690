"""Our Q4_1 kernel with its inputs rounded to int8 a group (AVX-512 VNNI, vpdpbusd: 4 nibble x int8 products a
lane summed exactly in 32 bits, as llama.cpp multiplies Q4_1 by Q8_1) against the bf16 rows it ships (vdpbf16ps),
on the same packed weights: SmolLM2-135M's 120 layer linears, from memory, at a few rows. A prototype kept to
measure; inferd does not ship it (benchmarks/README.md says why). Also each one's error against the float64
product of the file's weights on random inputs.

    PYTHONPATH=. .venv/bin/python benchmarks/int4_int8_inputs.py --out benchmarks/results/int4-int8-inputs-zen4.md
"""
import argparse
import statistics
import sys
from datetime import datetime, timezone

import torch

from benchmarks.engine import _cpu_name
from benchmarks.int4_linear import as_linear, layer_linears, seconds
from inferd.models.cpp_build import build
from inferd.models.cpu import cpu_flags
from inferd.models.int4 import Int4Linear, dequantize_q4_1, quantize_q4_1
from inferd.models.int4_kernel import load_int4_kernel
from inferd.models.loader import load_model

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>
#include <cmath>
#include <immintrin.h>

// 32 inputs -> int8, their scale (largest |x| / 127) and the sum of the rounded values
static inline void quantize_group8(const float* x, int8_t* q, float* scale, float* sum) {
  __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  float largest = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(a)), _mm512_reduce_max_ps(_mm512_abs_ps(b)));
  *scale = largest / 127.0f;
  float inv = 127.0f / largest;
  if (!(inv < INFINITY)) inv = 0.0f;
  __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
  __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
  *sum = *scale * _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));  // the rounded inputs' sum: their errors
  // then meet the weights d q + m, centred on 0, not the nibbles alone
  _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(qb));
}

template <int R, int A>
static void panel_rows_i8(const uint8_t* w, const uint16_t* dm, int64_t G, const int8_t* xq, int64_t K,
                          const float* xscale, const float* xsum, const float* bias, float* y, int64_t N, int64_t n0,
                          __m512i idx) {
  const __m512i low = _mm512_set1_epi8(0xF);
  __m512 out[R];
  for (int r = 0; r < R; ++r) out[r] = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = w + g * 256;
    __m512i acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm512_setzero_si512();
    #pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(b + i * 64));
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const int a = A == 4 ? (i & 1) * 2 : 0;
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * K + g * 32 + 4 * i;
        int32_t plo, phi;
        std::memcpy(&plo, xr, 4);
        std::memcpy(&phi, xr + 16, 4);
        acc[r][a] = _mm512_dpbusd_epi32(acc[r][a], lo, _mm512_set1_epi32(plo));
        acc[r][a + 1] = _mm512_dpbusd_epi32(acc[r][a + 1], hi, _mm512_set1_epi32(phi));
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
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * N + n0, mask, out[r]);
}

static void tile_i8(int64_t R, const uint8_t* w, const uint16_t* dm, int64_t G, const int8_t* xq, int64_t K,
                    const float* xs, const float* xsum, const float* bias, float* y, int64_t N, int64_t n0, __m512i idx) {
  switch (R) {
    case 1: return panel_rows_i8<1, 4>(w, dm, G, xq, K, xs, xsum, bias, y, N, n0, idx);
    case 2: return panel_rows_i8<2, 4>(w, dm, G, xq, K, xs, xsum, bias, y, N, n0, idx);
    case 3: return panel_rows_i8<3, 4>(w, dm, G, xq, K, xs, xsum, bias, y, N, n0, idx);
    case 4: return panel_rows_i8<4, 4>(w, dm, G, xq, K, xs, xsum, bias, y, N, n0, idx);
    case 5: return panel_rows_i8<5, 2>(w, dm, G, xq, K, xs, xsum, bias, y, N, n0, idx);
    case 6: return panel_rows_i8<6, 2>(w, dm, G, xq, K, xs, xsum, bias, y, N, n0, idx);
    case 7: return panel_rows_i8<7, 2>(w, dm, G, xq, K, xs, xsum, bias, y, N, n0, idx);
    default: return panel_rows_i8<8, 2>(w, dm, G, xq, K, xs, xsum, bias, y, N, n0, idx);
  }
}

torch::Tensor int4_linear_i8(torch::Tensor x, torch::Tensor w, torch::Tensor dm, torch::Tensor bias, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0), G = w.size(1);
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({M, N}, xf.options());
  std::vector<int8_t> xq(M * K);
  std::vector<float> xscale(M * G), xsum(M * G);
  const float* xp = xf.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g)
      quantize_group8(xp + r * K + g * 32, xq.data() + r * K + g * 32, &xscale[r * G + g], &xsum[r * G + g]);
  alignas(64) uint16_t ids[32];
  for (int t = 0; t < 16; ++t) ids[2 * t] = t, ids[2 * t + 1] = 16 + t;
  const __m512i idx = _mm512_load_si512(ids);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* dp = (const uint16_t*)dm.data_ptr();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = 0, tiles = (M + 7) / 8, t = 0; t < tiles; r += M / tiles + (t < M % tiles), ++t)
        tile_i8(M / tiles + (t < M % tiles), wp + p * G * 256, dp + p * G * 32, G, xq.data() + r * K, K,
                xscale.data() + r * G, xsum.data() + r * G, bp, yp + r * N, N, p * 16, idx);
  });
  return y.to(x.scalar_type());
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    assert {"avx512_vnni", "avx512_bf16"} <= cpu_flags(), "needs AVX-512 VNNI and BF16"
    kernel, proto = load_int4_kernel(), build("inferd_int4_int8_inputs", SOURCE, ["int4_linear_i8"])
    weights = layer_linears(load_model(None, progress=False).weights)
    layers = [Int4Linear(as_linear(w), 1 << 30, kernel, torch.bfloat16) for w in weights]
    ops = {"bf16 rows (shipped)": lambda l, x: kernel.int4_linear(x, l.nibbles, l.dm, l.row_bias, l.out_features),
           "int8 inputs (prototype)": lambda l, x: proto.int4_linear_i8(x, l.nibbles, l.dm, l.row_bias, l.out_features)}
    lines = [f"# Q4_1 linears: int8 inputs (VNNI prototype) against bf16 rows ({datetime.now(timezone.utc):%Y-%m-%d}; "
             f"{_cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__})", "",
             f"`PYTHONPATH=. .venv/bin/python benchmarks/int4_int8_inputs.py {' '.join(sys.argv[1:])}`", "",
             "Error: |y - y_ref| / |y_ref| over 8 random rows of each of the 4 linears of layer 0 (y_ref: float64, the "
             "file's Q4_1 weights).", ""]
    g = torch.Generator().manual_seed(0)
    for name, op in ops.items():
        errs = []
        for w in weights[:4]:
            layer = Int4Linear(as_linear(w), 1 << 30, kernel, torch.bfloat16)
            x = torch.randn(8, w.shape[1], generator=g).bfloat16()
            q, d, m = quantize_q4_1(w)  # d and m in fp16, as the layer packs them
            ref = x.double() @ dequantize_q4_1(q, d.half().float(), m.half().float()).double().T
            errs.append(((op(layer, x).double() - ref).norm() / ref.norm()).item())
        lines.append(f"- {name}: {statistics.median(errs):.4f}")
    lines += ["", "| rows | " + " | ".join(f"{n}, ms" for n in ops) + " | bf16 rows / int8 inputs |", "|---:|---:|---:|---:|"]
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, w.shape[1]).bfloat16() for w in weights]
            runs = {name: [] for name in ops}
            for _ in range(args.repeats + 1):  # the first pass warms
                for name, op in ops.items():
                    runs[name].append(seconds(lambda: [op(layer, x) for layer, x in zip(layers, xs)]))
            ms = [statistics.median(r[1:]) * 1e3 for r in runs.values()]
            lines.append(f"| {m} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[0] / ms[1]:.2f}x |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
