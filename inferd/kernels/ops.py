"""The kernels' Python face: what every op takes and returns (`Ops`, and `Kernels`, the compiled module's whole set),
and the same small ops in plain torch (`TorchKernels`): the reference the C++ ones are tested against
(tests/engine/test_cpu_kernels.py), and the path where there is none (no build for this CPU, INFERD_NO_CPP_KERNELS set,
or a dtype they do not take). The compiled module (`inferd.kernels.variants.load_kernels`) is a `Kernels`; csrc/kernels.h
declares the same functions in C++.
"""
from typing import Protocol

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


class Ops(Protocol):
    """The decoder's small ops and the sampler's: TorchKernels and the compiled module alike. Every op computes in
    float32 and rounds once to the tensor's dtype (float32 or bfloat16)."""

    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor: ...

    def add_rms_norm(self, x: Tensor, residual: Tensor, w: Tensor, eps: float) -> Tensor:
        """residual += x (in place), then its norm."""

    def rope_cache(self, qkv: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slots: Tensor, heads: int, kv_heads: int) -> Tensor:
        """RoPE on q and k, k and v written to their cache slots; the rotated q as [T, heads, head_dim]."""

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """silu(gate) * up of the fused [T, 2I] projection."""

    def paged_decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                     block_size: int, scale: float) -> Tensor: ...

    def prefill_attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, blocks: Tensor, ctx: int,
                          block_size: int, scale: float) -> Tensor: ...

    def best_rows(self, logits: Tensor) -> Tensor:
        """Each row's argmax, the first of equal maxima."""

    def sample_rows(self, logits: Tensor, temperature: Tensor, u: Tensor) -> Tensor: ...


class Kernels(Ops, Protocol):
    """The compiled module: the small ops, the linears (their weights in the layouts of inferd.models.packed,
    int4_kernel, quant) and the decode loop (inferd.models.decode_loop). *_native(): whether this build has the
    instructions the op's fast loops need."""

    def one_row_linear_native(self) -> bool: ...
    def one_row_linear(self, x: Tensor, w: Tensor, bias: Tensor) -> Tensor: ...
    def one_row_gated(self, x: Tensor, w: Tensor, bias: Tensor) -> Tensor: ...
    def one_row_linear_f32(self, x: Tensor, w: Tensor, bias: Tensor) -> Tensor: ...
    def amx_linear_native(self) -> bool: ...
    def amx_linear(self, x: Tensor, w: Tensor, bias: Tensor) -> Tensor: ...
    def amx_gated(self, x: Tensor, w: Tensor, bias: Tensor) -> Tensor: ...
    def amx_linear_f32(self, x: Tensor, w: Tensor, bias: Tensor) -> Tensor: ...
    def bf16w_linear_native(self) -> bool: ...
    def bf16w_linear(self, x: Tensor, w: Tensor, bias: Tensor) -> Tensor: ...
    def bf16w_gated(self, x: Tensor, w: Tensor, bias: Tensor) -> Tensor: ...
    def int4_linear_bf16_native(self) -> bool: ...
    def int4_linear_fp32_native(self) -> bool: ...
    def int4_linear(self, x: Tensor, w: Tensor, dm: Tensor, bias: Tensor, n: int) -> Tensor: ...
    def int4_linear_int8(self, x: Tensor, w: Tensor, dm: Tensor, bias: Tensor, n: int) -> Tensor: ...
    def int8_linear(self, x: Tensor, packed: Tensor, scale: Tensor, bias: Tensor, n: int, fused_max_m: int) -> Tensor: ...
    def make_plan(self, tensors: list[Tensor], ints: list[int], floats: list[float]) -> int: ...
    def drop_plan(self, plan: int) -> None: ...
    def run_plan(self, plan: int, first: int, last: int, h: Tensor, residual: Tensor, cos: Tensor, sin: Tensor,
                 positions: Tensor, slots: Tensor, kv_cache: Tensor, blocks: Tensor, lens: Tensor,
                 block_size: int) -> list[Tensor]: ...
    def plan_linears(self) -> list[str]: ...


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [slots, KVH, hd], [..., nb] block ids -> [..., nb * block_size, KVH, hd], a whole block at a time."""
    paged = cache.view(-1, block_size, *cache.shape[1:])
    return paged.index_select(0, blocks.flatten()).view(*blocks.shape[:-1], -1, *cache.shape[1:])


class TorchKernels:
    """The ops in plain torch, with the C++ ops' signatures."""

    # the last rotation made (positions, cos, its [T, 1, hd/2] complex factors): every layer of a forward passes
    # the same positions tensor, so the rotation is made once per forward, not once per layer
    _rotation: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def rms_norm(x, w, eps):
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    @staticmethod
    def add_rms_norm(x, residual, w, eps):
        residual.add_(x)
        return F.rms_norm(residual, (x.shape[-1],), w, eps)

    @staticmethod
    def silu_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @classmethod
    def rope_cache(cls, qkv, cos, sin, positions, k_cache, v_cache, slots, heads, kv_heads):
        hd = k_cache.shape[-1]
        qk = qkv[:, :(heads + kv_heads) * hd].view(-1, heads + kv_heads, hd)
        pairs = torch.view_as_complex(qk.float().reshape(*qk.shape[:-1], -1, 2))
        last = cls._rotation  # read once: another engine's thread may replace it
        if last is not None and last[0] is positions and last[1] is cos:
            cis = last[2]
        else:
            cis = torch.complex(cos[positions], sin[positions]).unsqueeze(1)
            cls._rotation = (positions, cos, cis)
        q, k = torch.view_as_real(pairs * cis).flatten(-2).to(qkv.dtype).split([heads, kv_heads], dim=1)
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, qkv[:, (heads + kv_heads) * hd:].view(-1, kv_heads, hd))
        return q

    @staticmethod
    def paged_decode(q, k_cache, v_cache, block_tables, context_lens, block_size, scale):
        d, heads, hd = q.shape
        kv_heads = k_cache.shape[1]
        keys = gather_blocks(k_cache, block_tables, block_size).transpose(1, 2)  # [D, KVH, S, hd]
        values = gather_blocks(v_cache, block_tables, block_size).transpose(1, 2)
        q = q.view(d, kv_heads, heads // kv_heads, hd)
        visible = torch.arange(keys.shape[2]) < context_lens.unsqueeze(1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None, None, :], scale=scale)
        return out.reshape(d, heads, hd)

    @staticmethod
    def prefill_attention(q, k_cache, v_cache, blocks, ctx, block_size, scale):
        n = q.shape[0]
        keys = gather_blocks(k_cache, blocks, block_size)[:ctx].transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, hd]
        values = gather_blocks(v_cache, blocks, block_size)[:ctx].transpose(0, 1).unsqueeze(0)
        q = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        if n == ctx:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            visible = torch.arange(ctx) <= torch.arange(ctx - n, ctx).unsqueeze(1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)

    @staticmethod
    def best_rows(logits):
        # the first of equal maxima; max over a dim found it 2.4x sooner than argmax at 64 rows of SmolLM2's
        # vocabulary (0.84 vs 2.0 ms on a 2-core Sapphire Rapids)
        return logits.max(dim=-1).indices

    @staticmethod
    def sample_rows(logits, temperature, u):
        cdf = (logits / temperature.unsqueeze(1)).softmax(dim=-1).double().cumsum(dim=-1)
        # u < 1, so u * total < total (rounded too): the first sum above it is a token's with probability, never a
        # masked one, and u = 0 takes the first such token
        return torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
