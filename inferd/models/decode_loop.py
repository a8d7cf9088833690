"""The decoder layers of a decode step as one C++ call: the same kernels, in the same order, without Python
between them.

At one sequence an int4 SmolLM2 forward is ~4.3 ms, of which ~0.5 ms was Python between the ~270 kernel calls of
its 30 layers (benchmarks/decode_step.py; benchmarks/README.md, "A decode step's layers in C++"). Here a
`LayerPlan` is made once per number of rows (decode tokens) from the layers' ops: for each layer its norms'
weights and, for each linear, the C++ function its op would call at that many rows (int4 bf16 rows, int4 with
int8 inputs, the one-row bf16 loop) with its weights; `run(first, last, ...)` then runs those layers calling the
kernels through their addresses (cpp_build.build's `addresses()`): the results are bit for bit those of the
Python loop (tests/engine/test_decode_loop.py).

A plan exists only where every linear of every layer has such a kernel at that many rows, and the model's small
ops are the C++ ones (cpu_kernels); elsewhere (oneDNN's dense products, int8 linears, torch ops) the Python loop
runs. lm_head and the final norm stay in Python: one call each.
"""
import logging
import os

import torch

from inferd.models.cpp_build import build
from inferd.models.cpu import per_march

log = logging.getLogger(__name__)

# a linear's kind in a plan: (x, w, dm, bias, N) or (x, pairs, bias), N padded; GATED: called as ONE_ROW, it returns
# silu(gate) * up of the fused [gate; up] projection (PackedLinear.gated_op), so the loop takes no silu_mul after it
INT4_CALL, ONE_ROW_CALL, GATED_CALL = 0, 1, 2
GATE_UP = 2  # the index of the fused [gate; up] projection in a layer's linears

SOURCE = r"""
#include <torch/extension.h>
#include <mutex>
#include <unordered_map>

using T = torch::Tensor;
// The kernels' signatures as cpu_kernels.py, int4_kernel.py and cpu_kernels' one_row_linear define them: a change
// there without the same change here calls a function through the wrong type (tests/engine/test_decode_loop.py runs
// every kind against the Python loop).
using NormFn = T (*)(T, T, double);
using AddNormFn = T (*)(T, T, T, double);
using SiluFn = T (*)(T);
using RopeFn = T (*)(T, T, T, T, T, T, T, int64_t, int64_t);
using DecodeFn = T (*)(T, T, T, T, T, int64_t, double);
using Int4Fn = T (*)(T, T, T, T, int64_t);  // int4_linear, int4_linear_int8: (x, nibbles, dm, bias, N)
using RowFn = T (*)(T, T, T);                // one_row_linear: (x, pairs, bias), N padded to 16

enum Kind : int64_t { INT4 = 0, ONE_ROW = 1, GATED = 2 };

struct Linear {
  int64_t kind, fn, n;
  T w, dm, bias;
  T operator()(const T& x) const {
    if (kind == INT4) return reinterpret_cast<Int4Fn>(fn)(x, w, dm, bias, n);
    T y = reinterpret_cast<RowFn>(fn)(x, w, bias);
    return y.size(1) == n ? y : y.narrow(1, 0, n).contiguous();
  }
};

struct Layer { T norm_in, norm_post; Linear qkv, o, gate_up, down; };

struct Plan {
  std::vector<Layer> layers;
  int64_t heads, kv_heads, q_size;
  double eps, scale;
  NormFn norm; AddNormFn add_norm; SiluFn silu; RopeFn rope; DecodeFn decode;
};

static std::mutex plans_lock;
static std::unordered_map<int64_t, std::shared_ptr<Plan>> plans;
static int64_t next_plan = 1;

// ints: [layers, heads, kv_heads, q_size, rms_norm, add_rms_norm, silu_mul, rope_cache, paged_decode,
//        then for each layer's qkv, o, gate_up, down: kind, fn, N]
// tensors: for each layer: norm_in, norm_post, then for each linear: w, dm (empty for one-row), bias
// floats: [eps, scale]
int64_t make_plan(std::vector<T> tensors, std::vector<int64_t> ints, std::vector<double> floats) {
  auto p = std::make_shared<Plan>();
  const int64_t L = ints.at(0);
  TORCH_CHECK(L >= 0 && (int64_t)ints.size() == 9 + 12 * L && (int64_t)tensors.size() == 14 * L && floats.size() == 2,
              "make_plan: inconsistent sizes");
  p->heads = ints[1]; p->kv_heads = ints[2]; p->q_size = ints[3];
  p->norm = reinterpret_cast<NormFn>(ints[4]); p->add_norm = reinterpret_cast<AddNormFn>(ints[5]);
  p->silu = reinterpret_cast<SiluFn>(ints[6]); p->rope = reinterpret_cast<RopeFn>(ints[7]);
  p->decode = reinterpret_cast<DecodeFn>(ints[8]);
  p->eps = floats[0]; p->scale = floats[1];
  for (int64_t l = 0; l < L; l++) {
    const T* t = &tensors[14 * l];
    const int64_t* k = &ints[9 + 12 * l];
    auto lin = [&](int i) {
      TORCH_CHECK(k[3 * i] == INT4 || k[3 * i] == ONE_ROW || k[3 * i] == GATED, "make_plan: unknown linear kind");
      return Linear{k[3 * i], k[3 * i + 1], k[3 * i + 2], t[2 + 3 * i], t[3 + 3 * i], t[4 + 3 * i]};
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
      x = p->norm(h, L.norm_in, p->eps);
    } else {
      x = p->add_norm(h, residual, L.norm_in, p->eps);
    }
    T q = p->rope(L.qkv(x), cos, sin, positions, k_cache, v_cache, slots, p->heads, p->kv_heads);
    T out = p->decode(q, k_cache, v_cache, blocks, lens, block_size, p->scale);
    x = p->add_norm(L.o(out.view({-1, p->q_size})), residual, L.norm_post, p->eps);
    T g = L.gate_up(x);
    h = L.down(L.gate_up.kind == GATED ? g : p->silu(g));
  }
  return {h, residual};
}
"""


@per_march
def load_decode_loop(march: str = "native"):
    """The compiled module, or None where it cannot be built here (the Python loop serves)."""
    if os.environ.get("INFERD_NO_CPP_KERNELS"):
        return None
    try:
        log.info("building the decode loop (cached after the first time)")
        return build("inferd_decode_loop", SOURCE, ["make_plan", "drop_plan", "run_plan"], march)
    except Exception as e:  # no compiler: the Python loop serves
        log.warning("C++ decode loop unavailable (%s); layers run from Python", e)
        return None


class LayerPlan:
    """A model's layers at `rows` decode rows, held by the C++ module; dropped with this object."""

    def __init__(self, module, tensors: list[torch.Tensor], ints: list[int], floats: list[float]):
        self.module, self.id = module, module.make_plan(tensors, ints, floats)
        self._tensors = tensors  # the plan's tensors live as long as it does

    def run(self, first: int, last: int, h, residual, cos, sin, positions, slots, kv_cache, blocks, lens,
            block_size: int):
        return self.module.run_plan(self.id, first, last, h, residual, cos, sin, positions, slots, kv_cache, blocks,
                                    lens, block_size)

    def __del__(self):
        module = getattr(self, "module", None)
        if module is not None and getattr(self, "id", None) is not None:
            module.drop_plan(self.id)


def layer_plan(layers, kernels, rows: int, dtype: torch.dtype) -> LayerPlan | None:
    """The plan of `layers` (LlamaForCausalLM.layer_ops, each with its linear modules in .linears) at `rows` rows of
    `dtype`, or None where a linear has no C++ kernel at that many rows, the small ops are not the C++ ones or the
    loop does not build here."""
    module = load_decode_loop()
    if module is None or not hasattr(kernels, "addresses") or not layers:
        return None
    small = kernels.addresses()
    tensors, ints = [], [len(layers), layers[0].heads, layers[0].kv_heads, layers[0].q_size,
                         small["rms_norm"], small["add_rms_norm"], small["silu_mul"], small["rope_cache"],
                         small["paged_decode"]]
    for ops in layers:
        tensors += [ops.norm_in, ops.norm_post]
        for i, linear in enumerate(ops.linears):
            call = linear.kernel_call(rows, dtype, gated=True) if i == GATE_UP and hasattr(linear, "gated_op") else None
            if call is None and hasattr(linear, "kernel_call"):
                call = linear.kernel_call(rows, dtype)
            if call is None:
                return None
            kind, fn, weights, n = call
            tensors += weights
            ints += [kind, fn, n]
    return LayerPlan(module, tensors, ints, [layers[0].eps, layers[0].scale])
