// The sampler's greedy pick and draw over the logits' rows.
#include "vec.h"
#include "kernels.h"

// Each row's argmax of logits [B, V] (float32), the first of equal maxima, rows on all threads: the greedy pick.
// torch's max over the rows ran on one thread (1.4 ms of a 64-stream bf16 decode step of SmolLM2's on an Emerald
// Rapids). A row whose maximum equals none of its values (NaN, which -ffast-math's compares do not order) takes 0.
at::Tensor best_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "logits must be contiguous [rows, vocab] float32");
  const int64_t B = logits.size(0), V = logits.size(1);
  auto out = at::empty({B}, at::kLong);
  const float* lp = ptr<float>(logits);
  int64_t* op = ptr<int64_t>(out);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* l = lp + b * V;
      float mx = -std::numeric_limits<float>::infinity();
      int64_t i = 0, token = -1;
#ifdef INFERD_VEC
      vec m = vset(mx);
      for (; i + W <= V; i += W) m = vmax(m, vload(l + i));
      mx = vhmax(m);
#endif
      for (; i < V; ++i) mx = std::max(mx, l[i]);
      i = 0;
#ifdef INFERD_VEC
      for (; i + W <= V && token < 0; i += W)
        if (const int lane = vfind(vload(l + i), mx); lane >= 0) token = i + lane;
#endif
      for (; i < V && token < 0; ++i)
        if (l[i] == mx) token = i;
      op[b] = std::max<int64_t>(token, 0);
    }
  });
  return out;
}

// One token per row of logits [B, V] (float32), drawn from softmax(logits / temperature) by inverting its
// distribution function at u in [0, 1): the first token whose running sum of weights e^((l - max) / t), summed in
// float64 in token order, passes u * total. A -inf logit (a masked token) weighs exactly 0, so is never drawn; the
// sum is taken 16 tokens at a time, and inside the chunk that passes, the same sums from 0 in the same order find the
// token (so the search always ends on a token of weight > 0 by the last chunk: u * total < total).
at::Tensor sample_rows(at::Tensor logits, at::Tensor temperature, at::Tensor u) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "logits must be contiguous [rows, vocab] float32");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temperature.is_contiguous() && temperature.scalar_type() == at::kFloat && temperature.numel() == B,
              "temperature must be [rows] float32");
  TORCH_CHECK(u.is_contiguous() && u.scalar_type() == at::kDouble && u.numel() == B, "u must be [rows] float64");
  constexpr int64_t CH = 16;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  auto out = at::empty({B}, at::kLong);
  const float* lp = ptr<float>(logits);
  const float* tp = ptr<float>(temperature);
  const double* up = ptr<double>(u);
  int64_t* op = ptr<int64_t>(out);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(V);
    std::vector<double> chunk((V + CH - 1) / CH);
    for (int64_t b = b0; b < b1; ++b) {
      const float* l = lp + b * V;
      float mx = neg_inf;
      for (int64_t i = 0; i < V; ++i) mx = std::max(mx, l[i]);
      const float inv = 1.f / tp[b];
      int64_t i = 0;
#ifdef INFERD_VEC
      for (; i + W <= V; i += W) {
        const vec x = vload(l + i);
        vstore(w.data() + i, vzero_where(vexp(vmul(vsub(x, vset(mx)), vset(inv))), x, neg_inf));
      }
#endif
      for (; i < V; ++i)
        w[i] = __builtin_bit_cast(uint32_t, l[i]) == __builtin_bit_cast(uint32_t, neg_inf) ? 0.f : std::exp((l[i] - mx) * inv);
      double total = 0;
      for (int64_t c = 0; c < (int64_t)chunk.size(); ++c) {
        double s = 0;
        for (int64_t j = c * CH; j < std::min(V, (c + 1) * CH); ++j) s += w[j];
        chunk[c] = s;
        total += s;
      }
      const double threshold = up[b] * total;
      int64_t token = 0;  // a row of masked tokens only (total 0) takes token 0
      double run = 0;
      for (int64_t c = 0; c < (int64_t)chunk.size() && total > 0; run += chunk[c], ++c) {
        if (!(run + chunk[c] > threshold)) continue;
        double s = 0;
        for (int64_t j = c * CH; j < std::min(V, (c + 1) * CH); ++j) {
          s += w[j];
          if (run + s > threshold) { token = j; break; }
        }
        break;
      }
      op[b] = token;
    }
  });
  return out;
}
