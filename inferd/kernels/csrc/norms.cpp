// RMS norms, RoPE with the cache writes, silu(gate) * up.
#include "vec.h"
#include "kernels.h"

template <typename T> static void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
  #pragma omp simd reduction(+:ss)
  for (int64_t i = 0; i < n; ++i) { const float v = ld(x[i]); ss += v * v; }
  const float r = 1.f / std::sqrt(ss / n + eps);
  #pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = to<T>(ld(x[i]) * r * ld(w[i]));
}

// x: [T, n], w: [n]
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.numel() == x.size(1), "x: [rows, n], weight: [n]");
  check(x, x, "x"); TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type(), "weight: contiguous, x's dtype");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty_like(x);
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
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.numel() == x.size(1), "x: [rows, n], weight: [n]");
  check(x, x, "x"); check(residual, x, "residual");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type(), "weight: contiguous, x's dtype");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must have the shape of x");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty_like(x);
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
at::Tensor rope_cache(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor positions,
                         at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, int64_t H, int64_t KVH) {
  check(qkv, qkv, "qkv"); check(k_cache, qkv, "k_cache"); check(v_cache, qkv, "v_cache");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "float32 cos, sin");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong, "int64 positions, slots");
  const int64_t rows = qkv.size(0), hd = k_cache.size(2), half = hd / 2, width = qkv.size(1);
  TORCH_CHECK(qkv.dim() == 2 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(), "qkv: [T, width], caches: [slots, KVH, hd]");
  TORCH_CHECK(width == (H + 2 * KVH) * hd && k_cache.size(1) == KVH, "qkv's width must be (heads + 2 kv_heads) head_dim");
  TORCH_CHECK(positions.numel() == rows && slots.numel() == rows, "one position and slot per row");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == half, "cos, sin: [positions, head_dim / 2]");
  const int64_t num_slots = k_cache.size(0), num_positions = cos.size(0);
  auto q = at::empty({rows, H, hd}, qkv.options());
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

#ifdef INFERD_VEC
template <typename T> static int64_t silu_mul_vec(const T* g, const T* u, T* o, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(o + i, silu_times(vload(g + i), vload(u + i)));
  return i;
}
#endif

// gate_up: [T, 2I] -> silu(gate) * up: [T, I]
at::Tensor silu_mul(at::Tensor gate_up) {
  check(gate_up, gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up: [rows, 2 I]");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
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
