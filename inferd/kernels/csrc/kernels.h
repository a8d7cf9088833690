// Every kernel's signature: included by the files that define them, by the decode loop that calls them and by the
// bindings, so that the compiler checks every call. The Python face: inferd/kernels/ops.py.
#pragma once
#include "aten.h"
#include <cstdint>
#include <vector>

using at::Tensor;

// norms.cpp: the decoder's small ops, float32 or bf16, computed in float32 and rounded once
Tensor rms_norm(Tensor x, Tensor w, double eps);
Tensor add_rms_norm(Tensor x, Tensor residual, Tensor w, double eps);  // residual += x (in place), then its norm
Tensor rope_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor k_cache, Tensor v_cache, Tensor slots,
                  int64_t heads, int64_t kv_heads);
Tensor silu_mul(Tensor gate_up);

// decode_attention.cpp, prefill_attention.cpp: attention read from the paged KV cache
Tensor paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens,
                    int64_t block_size, double scale);
Tensor prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, int64_t ctx, int64_t block_size,
                         double scale);

// sampling.cpp
Tensor best_rows(Tensor logits);
Tensor sample_rows(Tensor logits, Tensor temperature, Tensor u);

// linears_bf16.cpp: bf16 linears on the weights in pairs along K (inferd/models/packed.py, pair_weights)
bool one_row_linear_native();
Tensor one_row_linear(Tensor x, Tensor w, Tensor bias);
Tensor one_row_gated(Tensor x, Tensor w, Tensor bias);
Tensor one_row_linear_f32(Tensor x, Tensor w, Tensor bias);
bool amx_linear_native();
Tensor amx_linear(Tensor x, Tensor w, Tensor bias);
Tensor amx_gated(Tensor x, Tensor w, Tensor bias);
Tensor amx_linear_f32(Tensor x, Tensor w, Tensor bias);

// linears_f32.cpp: float32 rows through weights kept in bf16, AVX2 (inferd/models/packed.py, panel_weights)
bool bf16w_linear_native();
Tensor bf16w_linear(Tensor x, Tensor w, Tensor bias);
Tensor bf16w_gated(Tensor x, Tensor w, Tensor bias);

// int4.cpp: Q4_1 linears, (x, nibbles, dm, bias, N)
bool int4_linear_bf16_native();
bool int4_linear_fp32_native();
Tensor int4_linear(Tensor x, Tensor w, Tensor dm, Tensor bias, int64_t N);
Tensor int4_linear_int8(Tensor x, Tensor w, Tensor dm, Tensor bias, int64_t N);

// int8.cpp: weight-only int8 linears
Tensor int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor bias, int64_t N, int64_t fused_max_m);

// decode_loop.cpp: a decode step's layers as one call
int64_t make_plan(std::vector<Tensor> tensors, std::vector<int64_t> ints, std::vector<double> floats);
void drop_plan(int64_t id);
std::vector<Tensor> run_plan(int64_t id, int64_t first, int64_t last, Tensor h, Tensor residual, Tensor cos,
                             Tensor sin, Tensor positions, Tensor slots, Tensor kv_cache, Tensor blocks, Tensor lens,
                             int64_t block_size);
std::vector<std::string> plan_linears();  // the linears a plan may call, by their index in it
