// The module's Python functions: every one releases the GIL while it runs, as torch's own ops do (a replica's event
// loop runs Python between the engine's ops, and a kernel that held the GIL would stop it for the kernel's length).
#include <torch/csrc/Exceptions.h>  // torch::wrap_pybind_function_no_gil
#include <torch/csrc/utils/pybind.h>  // pybind11 and its casters for Tensor, not all of torch/extension.h
#include "kernels.h"

#define DEF(f) m.def(#f, torch::wrap_pybind_function_no_gil(f), #f)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  DEF(rms_norm); DEF(add_rms_norm); DEF(rope_cache); DEF(silu_mul);
  DEF(paged_decode); DEF(prefill_attention);
  DEF(best_rows); DEF(sample_rows);
  DEF(one_row_linear_native); DEF(one_row_linear); DEF(one_row_gated); DEF(one_row_linear_f32);
  DEF(amx_linear_native); DEF(amx_linear); DEF(amx_gated); DEF(amx_linear_f32);
  DEF(bf16w_linear_native); DEF(bf16w_linear); DEF(bf16w_gated);
  DEF(int4_linear_bf16_native); DEF(int4_linear_fp32_native); DEF(int4_linear); DEF(int4_linear_int8);
  DEF(int8_linear);
  DEF(make_plan); DEF(drop_plan); DEF(run_plan); DEF(plan_linears);
}
