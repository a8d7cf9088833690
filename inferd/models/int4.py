"""Weight-only 4-bit linears in GGUF Q4_1's own format (groups of 32 along K, w = d * q + m), bf16 or float32 rows.

Decoding one sequence reads every weight once per step, so bytes read set the step's time: 4-bit reads a
quarter of bf16. torch's `_weight_int4pack_mm_for_cpu` computes x @ W.T with W = (q - 8) * scale + zero per
group, which is Q4_1 exactly with scale = d and zero = m + 8 d (rounded to bf16, as the kernel takes them).
The packaged SmolLM2 file stores its linears as Q4_1, so `quantize_q4_1` on the weights the loader
dequantized gives back the file's own q, d and m (llama.cpp's Q4_1 puts each group's min at q = 0 and its
max at q = 15): the 4-bit model computes on the file's weights, not a second rounding of them.

Our own kernel (inferd.models.int4_kernel) takes the weights instead where it builds, with d and m in fp16 as the
file has them: bf16 rows on AVX-512 BF16 and VNNI, float32 rows on AVX2, where bf16 is emulated and torch's kernel
slow (benchmarks/int4_linear.py); both round their
inputs to 16 bits a group and multiply the nibbles as integers. Where the CPU has VNNI
(AMX or not), bf16 rows from `int8_rows` rows on are rounded to int8 a group and multiplied as integers
(inferd.kernels.select, INT4).

Either kernel's time grows with the rows, and with bf16 rows from a few rows on a dense bf16 matmul is faster. Each
layer therefore also keeps the same weights dequantized (oneDNN prepacked) and uses them above `max_rows` rows
(inferd.kernels.select, INT4: measured in benchmarks/int4_linear.py and benchmarks/quantization.py); float32
rows on AVX2 take our kernel at every row count (its int8 inputs outrun a dense float32 product there), and keep no
dense copy (max_rows None); where oneDNN has AVX-512 FMAs the dense float32 copy serves from 193 rows.
Measured against bf16, fp32 and int8 in benchmarks/quantization.py and benchmarks/engine.py.
"""
import logging

import torch
from torch import nn

from inferd.kernels.select import int4_rule
from inferd.models.int4_kernel import pack_panels
from inferd.models.packed import PackedLinear, can_pack, replace_linears

log = logging.getLogger(__name__)

GROUP = 32  # weights per (scale, min) pair along K, as in Q4_1
ROWS_MULTIPLE = 16  # the packing wants N divisible by 16: other N are padded with zero rows


_int4_mm = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)  # None in torch builds without it


def int4_available() -> bool:
    return _int4_mm is not None


# ---- weights

def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float (K divisible by 32) -> q uint8 [N, K] in 0..15, d and m fp32 [N, K/32]: w ~ d * q + m per
    group of 32, the group's min at q = 0 and its max at q = 15 (llama.cpp's Q4_1 rule)."""
    n, k = w.shape
    assert k % GROUP == 0, "K must be a multiple of 32"
    groups = w.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    d = (hi - lo) / 15
    steps = torch.where(d > 0, d, 1.0)[..., None]
    q = ((groups - lo[..., None]) / steps).round().clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), d, lo


def dequantize_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (q.float().view(*d.shape, GROUP) * d[..., None] + m[..., None]).reshape(q.shape)


def kernel_scales(d: torch.Tensor, m: torch.Tensor, rows: int) -> torch.Tensor:
    """d, m [N, K/32] -> the kernel's scales_and_zeros, bf16 [K/32, rows, 2] (zero rows past N)."""
    out = torch.zeros(d.shape[1], rows, 2)
    out[:, :d.shape[0], 0] = d.t()
    out[:, :d.shape[0], 1] = (m + 8 * d).t()
    return out.to(torch.bfloat16)


def kernel_dequantized(scales: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] the kernel computes with: its bf16 scales applied to q."""
    n = q.shape[0]
    d, zero = scales[:, :n, 0].float().t(), scales[:, :n, 1].float().t()
    return dequantize_q4_1(q, d, zero - 8 * d)


class Int4Linear(nn.Module):
    """nn.Linear with 4-bit weights (Q4_1 groups), in and out in `dtype` (bf16 or float32), a 4-bit kernel up to
    max_rows rows (None: at every row count, and no dense copy): ours (`kernel`, from load_int4_kernel) where it
    takes `dtype` here, else torch's (bf16 only)."""

    def __init__(self, linear: nn.Linear, max_rows: int | None, kernel=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features, self.max_rows, self.dtype = linear.in_features, linear.out_features, max_rows, dtype
        q, d, m = quantize_q4_1(linear.weight)
        self.exact = bool((dequantize_q4_1(q, d, m) - linear.weight.float()).abs().max() <= 1e-3 * d.max())
        if kernel is not None and not takes(kernel, dtype):
            kernel = None
        assert kernel is not None or dtype is torch.bfloat16, "float32 rows need our kernel (AVX2)"
        assert kernel is not None or max_rows is not None, "torch's int4 kernel serves a few rows, a dense copy more"
        self.kernel = kernel
        # from these rows on (up to max_rows) the kernel's inputs are rounded to int8 (int4_linear_int8); None: never
        rule = int4_rule(str(dtype).removeprefix("torch."), True) if kernel is not None else None
        self.int8_rows = rule[0] if rule is not None else None
        bias = None if linear.bias is None else linear.bias.detach()
        if kernel is not None:  # d and m in fp16, as a Q4_1 file has them
            d, m = d.half().float(), m.half().float()
            self.nibbles, self.dm = pack_panels(q, d, m)
            self.row_bias = torch.zeros(self.nibbles.shape[0] * 16) if bias is not None else torch.empty(0)
            if bias is not None:
                self.row_bias[:self.out_features] = bias.float()
            weight = dequantize_q4_1(q, d, m)
        else:
            rows = -(-self.out_features // ROWS_MULTIPLE) * ROWS_MULTIPLE
            padded = torch.zeros(rows, self.in_features, dtype=torch.int32)
            padded[:self.out_features] = q
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded, 1)
            self.scales = kernel_scales(d, m, rows)
            weight = kernel_dequantized(self.scales, q)
        self.bias = None if bias is None else bias.to(dtype).clone()
        self.dense = None
        if max_rows is None:
            return
        dense = nn.Linear(self.in_features, self.out_features, bias=bias is not None, dtype=dtype)
        with torch.no_grad():
            dense.weight.copy_(weight)
            if bias is not None:
                dense.bias.copy_(self.bias)
        self.dense = PackedLinear(dense) if can_pack(dtype) else dense.requires_grad_(False)

    def four_bit_bytes(self) -> int:
        """Bytes of the 4-bit weights and their scales, as the kernel reads them."""
        if self.kernel is not None:
            return self.nibbles.nbytes + self.dm.nbytes
        return self.packed.nbytes + self.scales.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        return self.op(self.dtype)(flat).view(*x.shape[:-1], self.out_features).to(x.dtype)

    def four_bit_at(self, rows: int) -> bool:
        """Whether the 4-bit weights serve `rows` rows (ours or torch's kernel), not the dense copy."""
        return self.max_rows is None or rows <= self.max_rows

    def kernel_at(self, rows: int):
        """Our kernel function for `rows` rows of the layer's dtype, or None where the dense copy (or, without our
        kernel, torch's int4 kernel) serves: bf16 or float32 rows up to int8_rows, inputs rounded to int8 from
        there, dense above max_rows."""
        if self.kernel is None or not self.four_bit_at(rows):
            return None
        int8 = self.int8_rows is not None and rows >= self.int8_rows
        return self.kernel.int4_linear_int8 if int8 else self.kernel.int4_linear

    def kernel_call(self, rows: int, dtype: torch.dtype):
        """What the C++ decode loop (decode_loop.py) calls for `rows` rows of `dtype`: (the module, the function's
        name, its weights, N), or None where it is not one of our kernels."""
        kernel = self.kernel_at(rows) if dtype is self.dtype else None
        if kernel is None:
            return None
        return self.kernel, kernel.__name__, [self.nibbles, self.dm, self.row_bias], self.out_features

    def op(self, dtype: torch.dtype):
        """This linear as one function of a 2-D contiguous input of `dtype`, its weights bound once (the decoder's
        calls): the 4-bit kernel up to max_rows rows (read at each call), the dense copy above. Inputs of another
        dtype than the layer's take forward's casts."""
        if dtype is not self.dtype:
            return self
        dense = self.dense.op(dtype) if isinstance(self.dense, PackedLinear) else self.dense  # None: never used
        n = self.out_features
        if self.kernel is not None:
            nibbles, dm, bias, kernel_at = self.nibbles, self.dm, self.row_bias, self.kernel_at

            def rows_by_size(x: torch.Tensor) -> torch.Tensor:
                kernel = kernel_at(x.shape[0])
                return dense(x) if kernel is None else kernel(x, nibbles, dm, bias, n)
            return rows_by_size
        packed, scales, bias, cut = self.packed, self.scales, self.bias, self.scales.shape[1] != n

        def torch_kernel(x: torch.Tensor) -> torch.Tensor:
            if not self.four_bit_at(x.shape[0]):
                return dense(x)
            y = _int4_mm(x, packed, GROUP, scales)
            y = y[:, :n].contiguous() if cut else y
            return y if bias is None else y + bias
        return torch_kernel


def takes(kernel, dtype: torch.dtype) -> bool:
    """Whether our compiled int4 kernel takes rows of `dtype` on this build."""
    if dtype is torch.bfloat16:
        return kernel.int4_linear_bf16_native()
    return dtype is torch.float32 and kernel.int4_linear_fp32_native()


def quantize_int4_linears(model: nn.Module, max_rows: int | None, skip: tuple[str, ...] = (),
                          dtype: torch.dtype = torch.bfloat16, kernel=None) -> int:
    """Replaces every nn.Linear of `model` (float32 weights) whose in_features is a multiple of 32 and whose
    name is not in `skip` by an Int4Linear computing in `dtype` on `kernel` (ours; None: torch's); returns how many."""
    made = replace_linears(model, lambda linear: Int4Linear(linear, max_rows, kernel, dtype),
                           lambda name, linear: linear.in_features % GROUP == 0 and name not in skip)
    count, exact = len(made), sum(layer.exact for layer in made)
    log.info("int4 weights for %d linears (%d of them exactly the source's Q4_1 blocks), %s rows, the int4 kernel %s",
             count, exact, str(dtype).removeprefix("torch."),
             "at every row count" if max_rows is None else f"up to {max_rows} rows, dense above")
    return count

