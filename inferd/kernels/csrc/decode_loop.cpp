// A decode step's decoder layers as one call (inferd/models/decode_loop.py): the kernels of kernels.h in the order
// the Python loop (inferd/models/llama.py) calls them, without Python between them.
// The module builds with -ffast-math (the decoder's kernels: so that exp vectorizes); this file's code never did.
#pragma GCC optimize("no-fast-math")
#include "kernels.h"
#include <mutex>
#include <string>
#include <unordered_map>

using T = at::Tensor;

// the linears a plan calls, by their index in a plan's ints; *_gated return silu(gate) * up of the fused [gate; up]
// projection (N: half its outputs), so that the loop takes no silu_mul after them
enum Fn : int64_t {
  INT4_LINEAR, INT4_LINEAR_INT8, ONE_ROW_LINEAR, ONE_ROW_GATED, AMX_LINEAR, AMX_GATED, BF16W_LINEAR, BF16W_GATED, FNS
};
static const char* const FN_NAMES[FNS] = {"int4_linear", "int4_linear_int8", "one_row_linear", "one_row_gated",
                                          "amx_linear", "amx_gated", "bf16w_linear", "bf16w_gated"};

std::vector<std::string> plan_linears() { return {FN_NAMES, FN_NAMES + FNS}; }

struct Linear {
  int64_t fn, n;
  T w, dm, bias;  // (x, nibbles, dm, bias, N) for int4; (x, pairs, bias) with N padded to 16 for the others
  bool gated() const { return fn == ONE_ROW_GATED || fn == AMX_GATED || fn == BF16W_GATED; }
  T operator()(const T& x) const {
    if (fn == INT4_LINEAR) return int4_linear(x, w, dm, bias, n);
    if (fn == INT4_LINEAR_INT8) return int4_linear_int8(x, w, dm, bias, n);
    T y = fn == ONE_ROW_LINEAR ? one_row_linear(x, w, bias) : fn == ONE_ROW_GATED ? one_row_gated(x, w, bias)
          : fn == AMX_LINEAR ? amx_linear(x, w, bias) : fn == AMX_GATED ? amx_gated(x, w, bias)
          : fn == BF16W_LINEAR ? bf16w_linear(x, w, bias) : bf16w_gated(x, w, bias);
    return y.size(1) == n ? y : y.narrow(1, 0, n).contiguous();
  }
};

struct Layer { T norm_in, norm_post; Linear qkv, o, gate_up, down; };

struct Plan {
  std::vector<Layer> layers;
  int64_t heads, kv_heads, q_size;
  double eps, scale;
};

static std::mutex plans_lock;
static std::unordered_map<int64_t, std::shared_ptr<Plan>> plans;
static int64_t next_plan = 1;

// ints: [layers, heads, kv_heads, q_size, then for each layer's qkv, o, gate_up, down: fn (plan_linears), N]
// tensors: for each layer: norm_in, norm_post, then for each linear: w, dm (empty but for int4), bias
// floats: [eps, scale]
int64_t make_plan(std::vector<T> tensors, std::vector<int64_t> ints, std::vector<double> floats) {
  auto p = std::make_shared<Plan>();
  const int64_t L = ints.at(0);
  TORCH_CHECK(L >= 0 && (int64_t)ints.size() == 4 + 8 * L && (int64_t)tensors.size() == 14 * L && floats.size() == 2,
              "make_plan: inconsistent sizes");
  p->heads = ints[1]; p->kv_heads = ints[2]; p->q_size = ints[3];
  p->eps = floats[0]; p->scale = floats[1];
  for (int64_t l = 0; l < L; l++) {
    const T* t = &tensors[14 * l];
    const int64_t* k = &ints[4 + 8 * l];
    auto lin = [&](int i) {
      TORCH_CHECK(0 <= k[2 * i] && k[2 * i] < FNS, "make_plan: unknown linear");
      return Linear{k[2 * i], k[2 * i + 1], t[2 + 3 * i], t[3 + 3 * i], t[4 + 3 * i]};
    };
    p->layers.push_back(Layer{t[0], t[1], lin(0), lin(1), lin(2), lin(3)});
  }
  std::lock_guard<std::mutex> g(plans_lock);
  plans[next_plan] = p;
  return next_plan++;
}

void drop_plan(int64_t id) {
  std::lock_guard<std::mutex> g(plans_lock);
  plans.erase(id);
}

// Layers [first, last) of a decode step; residual empty before the first layer. Returns {h, residual}: the last
// layer's MLP output and the residual stream before it, as decoder_layer returns them.
std::vector<T> run_plan(int64_t id, int64_t first, int64_t last, T h, T residual, T cos, T sin, T positions,
                        T slots, T kv_cache, T blocks, T lens, int64_t block_size) {
  std::shared_ptr<Plan> p;
  {
    std::lock_guard<std::mutex> g(plans_lock);
    auto it = plans.find(id);
    TORCH_CHECK(it != plans.end(), "run_plan: no such plan");
    p = it->second;
  }
  TORCH_CHECK(0 <= first && first <= last && last <= (int64_t)p->layers.size() && kv_cache.dim() == 5
              && kv_cache.size(0) >= last && kv_cache.size(1) == 2, "run_plan: layers or cache out of range");
  for (int64_t l = first; l < last; l++) {
    const Layer& L = p->layers[l];
    T k_cache = kv_cache.select(0, l).select(0, 0), v_cache = kv_cache.select(0, l).select(0, 1);
    T x;
    if (residual.numel() == 0) {
      residual = h;
      x = rms_norm(h, L.norm_in, p->eps);
    } else {
      x = add_rms_norm(h, residual, L.norm_in, p->eps);
    }
    T q = rope_cache(L.qkv(x), cos, sin, positions, k_cache, v_cache, slots, p->heads, p->kv_heads);
    T out = paged_decode(q, k_cache, v_cache, blocks, lens, block_size, p->scale);
    x = add_rms_norm(L.o(out.view({-1, p->q_size})), residual, L.norm_post, p->eps);
    T g = L.gate_up(x);
    h = L.down(L.gate_up.gated() ? g : silu_mul(g));
  }
  return {h, residual};
}
