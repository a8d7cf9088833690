"""Weight-only int8 linears: per-output-channel symmetric scales, fp32 activations.

Decode is memory-bound on the weights; int8 reads a quarter of fp32's bytes. The kernel (inferd/kernels/csrc/
int8.cpp, AVX2 FMA) keeps the weights as int8 panels of 16 output channels, [N/16, K, 16], and widens them to fp32
in registers for up to FUSED_MAX_M rows (decode batches), or one panel at a time into an L2-sized fp32 buffer that
all rows then reuse (prefill). One row (decode of one sequence, and the int4 model's lm_head) runs on AVX-512
where the CPU has it: a panel is one register there. Activations stay fp32, so the only error is the weights'
rounding, except at 1-3 rows on AVX-512 VNNI: there each row is rounded to 16-bit integers a group of 32 (at most
1/65534 of the group's largest |x|) and the products are summed as integers on vpdpwssd. Where there is no kernel,
torch's `_weight_int8pack_mm` on the same int8 values serves. Measured against the alternatives in
benchmarks/quantization.py.
"""
import logging

import torch
from torch import nn

from inferd.kernels.select import INT8_HEAD_MAX_ROWS
from inferd.models.packed import linear_op, replace_linears

log = logging.getLogger(__name__)

PANEL = 16  # output channels per panel: two AVX2 registers
FUSED_MAX_M = 12  # up to this many rows widen the int8 weights in registers; more widen each panel once to fp32



# ---- weights

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> int8 [N, K] and fp32 scales [N], symmetric per output channel: w ~ q * scale[:, None]."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def pack_panels(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [ceil(N/16), K, 16], zero-padded: a panel's 16 channels side by side for each k."""
    n, k = q.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.int8)
    padded[:n] = q
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


class Int8Linear(nn.Module):
    """nn.Linear with int8 weights; fp32 in and out."""

    def __init__(self, linear: nn.Linear, kernel=None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_int8(linear.weight)
        self.kernel = kernel
        if kernel is None:
            self.weight, self.scale = q, scale
        else:
            self.weight = pack_panels(q)
            self.scale = torch.zeros(self.weight.shape[0] * PANEL)
            self.scale[:self.out_features] = scale
        self.bias = torch.empty(0) if linear.bias is None else linear.bias.detach().float().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        return self.op(x.dtype)(flat).view(*x.shape[:-1], self.out_features)

    def op(self, dtype: torch.dtype):
        """This linear as one function of a 2-D contiguous input of `dtype`, its weights bound once (the decoder's
        calls). It computes in float32: other inputs are cast to it, and the output back to `dtype`."""
        weight, scale, bias, n = self.weight, self.scale, self.bias, self.out_features
        if self.kernel is not None:
            int8 = self.kernel.int8_linear
            run = lambda x: int8(x, weight, scale, bias, n, FUSED_MAX_M)  # noqa: E731
        else:
            mm = torch.ops.aten._weight_int8pack_mm
            run = (lambda x: mm(x, weight, scale) + bias) if bias.numel() else (lambda x: mm(x, weight, scale))
        return run if dtype is torch.float32 else lambda x: run(x.float()).to(dtype)


def quantize_linears(model: nn.Module, kernel=None) -> int:
    """Replaces every nn.Linear of `model` by an Int8Linear; returns how many."""
    count = len(replace_linears(model, lambda linear: Int8Linear(linear, kernel)))
    log.info("int8 weights for %d linears (%s)", count, "C++ kernel" if kernel else "torch _weight_int8pack_mm")
    return count




class SmallRowsInt8(nn.Module):
    """A linear kept twice: int8 (Int8Linear, the C++ kernel) for up to max_rows rows, where it reads half of
    bf16's bytes and oneDNN's bf16 product is slow, and the dense module above. The engine's int4 model uses it
    for lm_head, whose 4-bit weights cost too much perplexity (benchmarks/quantization.py)."""

    def __init__(self, int8: Int8Linear, dense: nn.Module, max_rows: int = INT8_HEAD_MAX_ROWS):
        super().__init__()
        self.int8, self.dense, self.max_rows = int8, dense, max_rows
        self.in_features, self.out_features = int8.in_features, int8.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.int8(x) if x.numel() <= self.max_rows * self.in_features else self.dense(x)

    def op(self, dtype: torch.dtype):
        """As forward, for a 2-D contiguous input of `dtype`, both linears' ops bound once (max_rows read at each
        call)."""
        int8, dense = linear_op(self.int8, dtype), linear_op(self.dense, dtype)
        return lambda x: int8(x) if x.shape[0] <= self.max_rows else dense(x)
