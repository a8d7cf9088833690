"""Linear layers with weights prepacked once: for oneDNN (PackedLinear), or kept in bf16 for float32 rows on our
AVX2 kernel (PanelLinear).

F.linear (MKL) repacks the weight on every call; packing once is 1.1-2x faster
for SmolLM2's linears on an AVX2 EPYC (benchmarks/linears.py). Where oneDNN
cannot pack a dtype on this CPU the layer stays a plain nn.Linear.
"""
import logging

import torch
from torch import nn

from inferd.kernels.select import plan


log = logging.getLogger(__name__)

EMPTY = torch.empty(0)

PACK_FOR_BATCH = 32  # the packing oneDNN picks for this M serves all M measured (1..1024)
AMX_MAX_ROWS = 64  # the most rows amx_gated and amx_linear_f32 take (and the decode loop's plans)


class PackedLinear(nn.Module):
    """one_row: the C++ ops (inferd.models.cpu_kernels) to run bf16 rows on where inferd.kernels.select's plan
    says (a single row; on AMX tiles more, K a multiple of 32), from a second copy of the weights in pairs along K
    (`pair_weights`), or None: every batch on oneDNN."""

    def __init__(self, linear: nn.Linear, one_row=None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_FOR_BATCH)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.one_row = one_row
        if one_row is not None:
            self.pairs = pair_weights(linear.weight.detach())
            self.row_bias = torch.empty(0) if linear.bias is None else torch.zeros(self.pairs.shape[0] * 16)
            if linear.bias is not None:
                self.row_bias[:self.out_features] = linear.bias.detach()
        self.amx = one_row is not None and self.in_features % 32 == 0 and one_row.amx_linear_native()  # the OS lets it

    def _row_kernel(self, rows: int, dtype: torch.dtype, kind: str = "linear") -> str | None:
        """The C++ op (by name) that serves `rows` rows of `dtype` from the pairs, or None: oneDNN. kind "gated": the
        op that also takes silu(gate) * up of this fused [gate; up] projection (both halves whole panels of 16
        outputs), "linear_f32": the op writing float32 outputs (logits), each up to AMX_MAX_ROWS rows (a prefill's
        go through oneDNN, then silu_mul or a cast)."""
        if self.one_row is None or dtype is not torch.bfloat16 or rows < 1:
            return None
        if (kind != "linear" and rows > AMX_MAX_ROWS) or (kind == "gated" and self.out_features % 32):
            return None
        kernel = plan("bfloat16", "none", rows, self.out_features).linear
        if kernel == "one_row" or (kernel == "amx" and self.amx):
            return f"{kernel}_{kind}"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.op(x.dtype)(x.reshape(-1, self.in_features).contiguous())
        return y.view(*x.shape[:-1], self.out_features)

    def kernel_call(self, rows: int, dtype: torch.dtype, gated: bool = False):
        """What the C++ decode loop (decode_loop.py) calls for `rows` rows of `dtype`: the C++ op on the pairs where
        one serves that many (the module, the op's name, its weights, N), else None (oneDNN serves). gated: the op
        that also takes silu(gate) * up (N then half the outputs), None where there is none."""
        name = self._row_kernel(rows, dtype, "gated" if gated else "linear")
        if name is None:
            return None
        return self.one_row, name, [self.pairs, EMPTY, self.row_bias], self.out_features // 2 if gated else \
            self.out_features

    def op(self, dtype: torch.dtype):
        """This linear as one function of a 2-D contiguous input, its weights bound once (the decoder's calls)."""
        linear, packed, bias = torch.ops.mkldnn._linear_pointwise, self.packed, self.bias
        return self._by_rows(dtype, "linear", lambda x: linear(x, packed, bias, "none", [None], ""))

    def gated_op(self, dtype: torch.dtype, silu):
        """silu(gate) * up of this fused [gate; up] projection as one function of a 2-D contiguous input: the C++ op
        that does both where one serves that many rows (the activation computed as the projection's outputs are
        stored, no pass of its own), else op(dtype) then `silu` (kernels' silu_mul)."""
        linear = self.op(dtype)
        return self._by_rows(dtype, "gated", lambda x: silu(linear(x)))

    def float_op(self, dtype: torch.dtype):
        """This linear's float32 outputs (a model's logits) as one function of a 2-D contiguous input: the C++ op that
        writes them where one serves that many rows (at 64 rows of SmolLM2's vocabulary a cast of the bf16 logits
        took 0.3 ms of a 25 ms step), else op(dtype) then a cast."""
        linear = self.op(dtype)
        return self._by_rows(dtype, "linear_f32", lambda x: linear(x).float())

    def _by_rows(self, dtype: torch.dtype, kind: str, otherwise):
        """The C++ op of `kind` (_row_kernel) on the pairs at the row counts one serves, `otherwise` at the others."""
        if self.one_row is None:
            return otherwise
        names = [self._row_kernel(rows, dtype, kind) for rows in range(AMX_MAX_ROWS + 2)]  # the rule, looked up per call
        by_rows = [None if name is None else getattr(self.one_row, name) for name in names]  # [-1]: any more rows
        pairs, row_bias, n = self.pairs, self.row_bias, self.out_features // 2 if kind == "gated" else self.out_features

        def run(x: torch.Tensor) -> torch.Tensor:
            kernel = by_rows[min(x.shape[0], AMX_MAX_ROWS + 1)]
            if kernel is None:
                return otherwise(x)
            y = kernel(x, pairs, row_bias)
            return y if y.shape[1] == n else y[:, :n].contiguous()
        return run


class PanelLinear(nn.Module):
    """A linear whose weights are kept in bf16, in panels of 16 outputs (panel_weights), run on float32 rows by the C++
    bf16w_linear at every row count: a decode step reads half the bytes of float32 weights (inferd.kernels.select's
    bf16_weights says where). `kernels`: the compiled module."""

    def __init__(self, linear: nn.Linear, kernels):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernels = kernels
        self.panels = panel_weights(linear.weight.detach())
        self.bias = EMPTY
        if linear.bias is not None:
            self.bias = torch.zeros(self.panels.shape[0] * 16)
            self.bias[:self.out_features] = linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.op(x.dtype)(x.reshape(-1, self.in_features).contiguous())
        return y.view(*x.shape[:-1], self.out_features)

    def _bound(self, name: str, n: int):
        kernel, panels, bias = getattr(self.kernels, name), self.panels, self.bias

        def run(x: torch.Tensor) -> torch.Tensor:
            y = kernel(x, panels, bias)
            return y if y.shape[1] == n else y[:, :n].contiguous()
        return run

    def op(self, dtype: torch.dtype):
        return self._bound("bf16w_linear", self.out_features)

    def gated_op(self, dtype: torch.dtype, silu):
        """silu(gate) * up of this fused [gate; up] projection in one call where both halves are whole panels."""
        if self.out_features % 32:
            linear = self.op(dtype)
            return lambda x: silu(linear(x))
        return self._bound("bf16w_gated", self.out_features // 2)

    def float_op(self, dtype: torch.dtype):
        return self.op(dtype)  # float32 rows in, float32 out

    def kernel_call(self, rows: int, dtype: torch.dtype, gated: bool = False):
        """What the C++ decode loop calls (as PackedLinear.kernel_call): bf16w_linear, or bf16w_gated for a gated
        projection whose halves are whole panels (else None)."""
        if gated and self.out_features % 32:
            return None
        n = self.out_features // 2 if gated else self.out_features
        return self.kernels, "bf16w_gated" if gated else "bf16w_linear", [self.panels, EMPTY, self.bias], n


def linear_op(module: nn.Module, dtype: torch.dtype):
    """What a linear runs a 2-D contiguous input of `dtype` with: its own op(dtype) where it has one (prepacked,
    int4, int8: their kernel and weights bound once), else the module itself."""
    op = getattr(module, "op", None)
    return module if op is None else op(dtype)


def gated_op(module: nn.Module, dtype: torch.dtype, silu):
    """silu(gate) * up of a fused [gate; up] projection (an MLP's gate_up_proj) as one function of a 2-D contiguous
    input: the module's gated_op where it has one, else its linear_op then `silu`."""
    op = getattr(module, "gated_op", None)
    if op is not None:
        return op(dtype, silu)
    linear = linear_op(module, dtype)
    return lambda x: silu(linear(x))


def float_op(module: nn.Module, dtype: torch.dtype):
    """A linear's float32 outputs (logits) as one function of a 2-D contiguous input: the module's float_op where it
    has one, else its linear_op then a cast."""
    op = getattr(module, "float_op", None)
    if op is not None:
        return op(dtype)
    linear = linear_op(module, dtype)
    return lambda x: linear(x).float()


def pair_weights(w: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (K even) -> [ceil(N / 16), K / 2, 16, 2]: 16 outputs' pairs of weights side by side for each pair
    of inputs, N padded with zero rows, the layout of the C++ `one_row_linear`."""
    n, k = w.shape
    padded = torch.zeros(-(-n // 16) * 16, k, dtype=torch.bfloat16)
    padded[:n] = w
    return padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


PANEL_ORDER = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])


def panel_weights(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> bf16 [ceil(N / 16), K, 16]: for each input, 16 outputs' weights side by side, in the order that
    widening a 256-bit load against zero (vpunpcklwd, vpunpckhwd) gives outputs 0-7 and 8-15; N padded with zero
    rows. The layout of the C++ `bf16w_linear`."""
    n, k = w.shape
    padded = torch.zeros(-(-n // 16) * 16, k, dtype=torch.bfloat16)
    padded[:n] = w
    return padded.view(-1, 16, k)[:, PANEL_ORDER, :].permute(0, 2, 1).contiguous()


def replace_linears(model: nn.Module, make, takes=lambda name, linear: True) -> list[nn.Module]:
    """Replaces every nn.Linear of `model` that `takes` (its attribute name, the linear) by `make(linear)`; returns
    the new modules."""
    made = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and takes(name, child):
                made.append(make(child))
                setattr(parent, name, made[-1])
    return made


def panel_linears(model: nn.Module, kernels) -> None:
    """Replaces every nn.Linear of `model` (float32) by a PanelLinear on `kernels` (bf16 weights, float32 rows)."""
    replace_linears(model, lambda linear: PanelLinear(linear, kernels))


def one_row_ops(kernels, dtype: torch.dtype):
    """The C++ ops where inferd.kernels.select runs a single bf16 row on them, not on oneDNN (for a second copy of
    the bf16 weights: EngineConfig.one_row_weights), else None."""
    if dtype is not torch.bfloat16 or not hasattr(kernels, "one_row_linear_native"):
        return None
    return kernels if plan("bfloat16", "none", 1).linear == "one_row" and kernels.one_row_linear_native() else None


def can_pack(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), PACK_FOR_BATCH)
    except RuntimeError:
        return False
    return True


def pack_linears(model: nn.Module, dtype: torch.dtype, one_row=None) -> bool:
    """Replaces every nn.Linear of `model` (already in `dtype`) by a PackedLinear (one_row: as PackedLinear takes
    it). True if it did."""
    if not can_pack(dtype):
        log.info("oneDNN cannot prepack %s weights on this CPU; using plain linears", dtype)
        return False
    replace_linears(model, lambda linear: PackedLinear(linear, one_row if linear.in_features % 2 == 0 else None))
    return True
