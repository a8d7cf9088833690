"""The decoder's small ops, in C++ for float32 and bfloat16 (inferd/kernels/csrc), or in plain torch.

A decode step of a small model is mostly small ops, and their dispatch cost as much as the weight reads; here each
is one call:

- `rms_norm(x, w, eps)`, and `add_rms_norm(x, residual, w, eps)`: residual += x (in place), then its norm;
- `rope_cache(qkv, cos, sin, positions, k_cache, v_cache, slots, heads, kv_heads)`: RoPE on q and k
  (pairs side by side, see inferd.models.llama.interleave_halves), k and v written to their cache slots,
  the rotated q returned as [T, heads, head_dim];
- `silu_mul(gate_up)`: silu(gate) * up of the fused [T, 2I] projection (bf16 rows on the pairs' kernels take it in
  the projection's own op: `amx_gated`, `one_row_gated`, the same bits);
- `paged_decode(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)`: decode attention read straight
  from the cache blocks, one (sequence, KV head) per task, all query heads of its group together, K and V read
  once (the torch path gathers a padded copy of every context, then runs SDPA), on the variant's vectors;
- `prefill_attention(q, k_cache, v_cache, blocks, ctx, block_size, scale)`: causal attention of a prompt chunk over
  its context, read from the cache blocks, as a flash attention on AVX-512 (bf16 dot products, AMX tiles at
  head_dim 32 and 64, float32 FMAs); elsewhere the gather + SDPA path.

Which loops each variant runs, and what they measured: docs/kernels.md. Every op computes in float32 and rounds once
to the tensor's dtype. `TorchKernels` (inferd.kernels.ops) is the same ops in torch: the reference the C++ ones are
tested against (tests/engine/test_cpu_kernels.py), and the path where there are none (no build for this CPU,
INFERD_NO_CPP_KERNELS set, or a dtype they do not take).
"""

import torch

from inferd.kernels.variants import load_kernels
from inferd.kernels.ops import TorchKernels

DTYPES = (torch.float32, torch.bfloat16)  # what the C++ ops take


def kernels_for(dtype: torch.dtype, cpp: bool = True):
    """The C++ ops where they are wanted, take `dtype` and build here; else TorchKernels."""
    module = load_kernels() if cpp and dtype in DTYPES else None
    return TorchKernels if module is None else module

