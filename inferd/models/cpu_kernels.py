"""The decoder's small ops, in C++ for float32 and bfloat16 (inferd/kernels/csrc), or in plain torch.

A decode step of a small model is mostly small ops: at one sequence, most of SmolLM2's ATen calls
per step were these (norms decomposed into casts, pow, mean and rsqrt; RoPE through complex views; two index_copy_ for
the cache; the gather, mask and SDPA of decode attention), and their dispatch cost as much as the
weight reads. Here each of these is one call:

- `rms_norm(x, w, eps)`, and `add_rms_norm(x, residual, w, eps)`: residual += x (in place), then its norm;
- `rope_cache(qkv, cos, sin, positions, k_cache, v_cache, slots, heads, kv_heads)`: RoPE on q and k
  (pairs side by side, see inferd.models.llama.interleave_halves), k and v written to their cache slots,
  the rotated q returned as [T, heads, head_dim];
- `silu_mul(gate_up)`: silu(gate) * up of the fused [T, 2I] projection (bf16 rows on the pairs' kernels take it in
  the projection's own op: `amx_gated`, `one_row_gated`, the same bits);
- `paged_decode(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)`: decode attention
  read straight from the cache blocks, one (sequence, KV head) per task, all query heads of its group
  together, K and V read once (the torch path gathers a padded copy of every context, then runs SDPA).
  Its loops are written on this CPU's vectors (AVX-512 or AVX2, chosen when it is built; scalar loops
  elsewhere and for a head_dim that is not a multiple of the width), the next block's keys and this one's
  values prefetched: 3.7-3.8x its plain-loop version in bf16 at batch 8-64, 2.1-2.6x in fp32, with K/V
  from memory (benchmarks/paged_decode.py). bf16 where the CPU has AVX-512 BF16 (head_dim 32, 64, 128) and
  there are at least twice as many sequences as threads runs on its dot products instead, K and V never
  widened, a task a whole sequence (its blocks read as one): in the engine 0.85-0.89x the attention's time at
  8-64 streams of 512 positions (benchmarks/README.md, "Decode attention on bf16 dot products"). Elsewhere on AVX-512 (AMX
  CPUs), bf16 at head_dim 32, 64, 128 is widened without a shuffle and its scores summed 8 keys at a time
  (attend_split): 0.92x the attention's time in a 64-stream decode step on an Emerald Rapids. In every loop a task's PV
  fetches the thread's next task's keys into L2 (Ahead): 1.11-1.16x with the cache in memory.
- `prefill_attention(q, k_cache, v_cache, blocks, ctx, block_size, scale)`: causal attention of a prompt chunk over
  its context, read from the cache blocks, as a flash attention on AVX-512: in bf16 on its bf16 dot products
  (vdpbf16ps, where the CPU has AVX-512 BF16), 2.4-3.7x the gather + SDPA path at SmolLM2's shapes; in fp32 on
  FMAs, 1.5-1.8x (benchmarks/prefill_attention.py). Where the CPU has AMX, bf16 at head_dim 32 and 64 runs on its
  tiles instead (SDPA's tiles were 2.3-3.6x the bf16 loops there): 1.6-2.3x the gather + SDPA path on an Emerald
  Rapids, prompts of 512-2,048 and chunks of 512 over 1,024-2,048 (the fp32 loops stay: 1.2-1.5x SDPA there). Elsewhere
  that gather + SDPA: on AVX2 the same fp32 loops were 0.7-1.1x SDPA.

Every op computes in float32 and rounds once to the tensor's dtype. `TorchKernels` (inferd.kernels.ops) is the same
ops in torch: the reference the C++ ones are tested against (tests/engine/test_cpu_kernels.py), and the path
where they cannot be built (no compiler, INFERD_NO_CPP_KERNELS set, or a dtype they do not take).
Built for this machine's CPU (inferd.kernels.build: -march=native, AVX2, AVX-512 or AVX-512 BF16, whatever it has;
-ffast-math at compile time only, so that exp vectorizes, without the flush-to-zero start-up code a fast-math link
would add to the process) and cached per CPU.
"""
import os

import torch

from inferd.kernels.build import load
from inferd.kernels.ops import TorchKernels

DTYPES = (torch.float32, torch.bfloat16)  # what the C++ ops take


def kernels_for(dtype: torch.dtype, cpp: bool = True):
    """The C++ ops where they are wanted, take `dtype` and build here; else TorchKernels."""
    module = load_cpp_kernels() if cpp and dtype in DTYPES else None
    return TorchKernels if module is None else module


def load_cpp_kernels(march: str = "native"):
    """The compiled kernels (inferd.kernels), or None where they cannot be built here. `march` other than this CPU's
    own is for tests: "haswell" builds the AVX2 loops on an AVX-512 machine."""
    return None if os.environ.get("INFERD_NO_CPP_KERNELS") else load(march)
