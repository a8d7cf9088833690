"""The decoder layers of a decode step as one C++ call: the same kernels, in the same order, without Python
between them.

At one sequence an int4 SmolLM2 forward is ~4.3 ms, of which ~0.5 ms was Python between the ~270 kernel calls of
its 30 layers (benchmarks/decode_step.py; benchmarks/README.md, "A decode step's layers in C++"). Here a
`LayerPlan` is made once per number of rows (decode tokens) from the layers' ops: for each layer its norms'
weights and, for each linear, the C++ function its op would call at that many rows (int4 bf16 rows, int4 with
int8 inputs, the one-row bf16 loop, the AMX tiles) with its weights; `run(first, last, ...)` then runs those layers,
calling the kernels directly (inferd/kernels/csrc/decode_loop.cpp, in the same module): the results are bit for bit
those of the Python loop (tests/engine/test_decode_loop.py).

A plan exists only where every linear of every layer has such a kernel at that many rows, and the model's small
ops are the C++ ones (cpu_kernels); elsewhere (oneDNN's dense products, int8 linears, torch ops) the Python loop
runs. lm_head and the final norm stay in Python: one call each.
"""
import torch


GATE_UP = 2  # the index of the fused [gate; up] projection in a layer's linears




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
        drop = getattr(getattr(self, "module", None), "drop_plan", None)  # None at the interpreter's exit
        if drop is not None and getattr(self, "id", None) is not None:
            drop(self.id)


def layer_plan(layers, kernels, rows: int, dtype: torch.dtype) -> LayerPlan | None:
    """The plan of `layers` (LlamaForCausalLM.layer_ops, each with its linear modules in .linears) at `rows` rows of
    `dtype`, or None where a linear has no C++ kernel of the same build at that many rows, or the small ops are not
    the C++ ones (`kernels` TorchKernels)."""
    if not hasattr(kernels, "make_plan") or not layers:
        return None
    names = kernels.plan_linears()
    tensors, ints = [], [len(layers), layers[0].heads, layers[0].kv_heads, layers[0].q_size]
    for ops in layers:
        tensors += [ops.norm_in, ops.norm_post]
        for i, linear in enumerate(ops.linears):
            call = linear.kernel_call(rows, dtype, gated=True) if i == GATE_UP and hasattr(linear, "gated_op") else None
            if call is None and hasattr(linear, "kernel_call"):
                call = linear.kernel_call(rows, dtype)
            if call is None or call[0] is not kernels:
                return None
            _, name, weights, n = call
            tensors += weights
            ints += [names.index(name), n]
    return LayerPlan(kernels, tensors, ints, [layers[0].eps, layers[0].scale])
