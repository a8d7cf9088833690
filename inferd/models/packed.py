"""Linear layers with weights prepacked once for oneDNN.

F.linear (MKL) repacks the weight on every call; packing once is 1.1-2x faster
for SmolLM2's linears on an AVX2 EPYC (benchmarks/linears.py). Where oneDNN
cannot pack a dtype on this CPU the layer stays a plain nn.Linear.
"""
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

PACK_FOR_BATCH = 32  # the packing oneDNN picks for this M serves all M measured (1..1024)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_FOR_BATCH)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


def can_pack(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), PACK_FOR_BATCH)
    except RuntimeError:
        return False
    return True


def pack_linears(model: nn.Module, dtype: torch.dtype) -> bool:
    """Replaces every nn.Linear of `model` (already in `dtype`) by a PackedLinear. True if it did."""
    if not can_pack(dtype):
        log.info("oneDNN cannot prepack %s weights on this CPU; using plain linears", dtype)
        return False
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
    return True
