"""This machine's limits and what a step of the engine costs against them.

Limits, measured here with torch on the threads it uses: read bandwidth (a sum over a 512 MiB float32 tensor,
far beyond any cache; on 4 KiB and on 2 MiB pages, the faster taken as the limit since the engine's weights lie
on 2 MiB pages) and the matmul peak of a dtype (2,048-square products). Costs, counted from the model as
the engine built it: the weight bytes one forward reads (each linear in the format it runs at that many rows:
int4 packed + scales, int8 + scales, or the dense copy; the embedding only if lm_head is tied to it) plus the
K/V bytes its attention reads; and its FLOP (2 per multiply-add of the linears, plus attention's).

share of limit = max(bytes per step / step time / bandwidth, FLOP per step / step time / peak of the
activations' dtype): the bound that binds. A model whose weights fit in the last-level cache can read faster than the measured bandwidth (shares
above 1 then say so, not a fault of the measure).

    PYTHONPATH=. .venv/bin/python benchmarks/limits.py  # prints this machine's limits
"""
import json
import os
import statistics
import time

import torch
from torch import nn

from inferd.models.config import ModelConfig
from inferd.models.huge_pages import huge_page_bytes
from inferd.models.int4 import Int4Linear
from inferd.models.packed import PackedLinear
from inferd.models.quant import Int8Linear, SmallRowsInt8


# The settings that run another machine's code here: AVX2 alone on an AVX-512 one is INFERD_KERNEL_ISA=avx2
# (inferd's C++ kernels), ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN), ATEN_CPU_CAPABILITY=avx2 (torch's own loops) and, on an
# Intel CPU, MKL_ENABLE_INSTRUCTIONS=AVX2 (MKL, torch's float32 matmul: without it an Emerald Rapids ran it at 438
# GFLOP/s on AVX-512, with it 226: results/limits-avx2-code-mkl-{unlimited,avx2}-emr.json).
ISA_LIMITS = ("INFERD_KERNEL_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def isa_limits() -> str:
    """Those of ISA_LIMITS set in this process, as NAME=value words; "none" where none is."""
    return " ".join(f"{n}={os.environ[n]}" for n in ISA_LIMITS if os.environ.get(n)) or "none"


def best_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def read_bandwidth(huge_pages: bool = False) -> float:
    """Bytes per second a sum over 512 MiB of float32 reads, on 4 KiB pages or on 2 MiB pages (as the engine's
    weights are: inferd/models/huge_pages.py); 0 where huge pages are refused."""
    n = 128 * 1024 * 1024
    if huge_pages:
        if (raw := huge_page_bytes(4 * n)) is None:
            return 0.0
        x = raw.view(torch.float32).fill_(1.0)
    else:
        x = torch.ones(n)
    return x.nbytes / best_seconds(lambda: x.sum())


def matmul_peak(dtype: torch.dtype, n: int = 2048) -> float:
    """FLOP per second of an n-square matrix product in dtype."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n ** 3 / best_seconds(lambda: torch.mm(a, b))


def machine_limits(dtypes: set[torch.dtype]) -> dict:
    """read_bandwidth_gb_s: the faster of the reads on 4 KiB and on 2 MiB pages (both kept): the limit."""
    small, huge = round(read_bandwidth() / 1e9, 2), round(read_bandwidth(huge_pages=True) / 1e9, 2)
    return {"read_bandwidth_gb_s": max(small, huge), "read_bandwidth_4k_pages_gb_s": small,
            "read_bandwidth_2m_pages_gb_s": huge,
            "matmul_peak_gflop_s": {str(d).removeprefix("torch."): round(matmul_peak(d) / 1e9, 1) for d in dtypes}}


def median_limits(runs: list[dict]) -> dict:
    """The median of each limit over several measures of machine_limits."""
    peaks = runs[0]["matmul_peak_gflop_s"]
    reads = [k for k in runs[0] if k.startswith("read_bandwidth")]
    return {**{k: statistics.median(r[k] for r in runs) for k in reads},
            "matmul_peak_gflop_s": {d: statistics.median(r["matmul_peak_gflop_s"][d] for r in runs) for d in peaks},
            "measures": len(runs)}


def weight_bytes(net: nn.Module, rows: int) -> int:
    """Bytes of weights a forward of `rows` token rows reads, each linear in the format it runs at that size."""
    total = 0

    def visit(m: nn.Module) -> None:
        nonlocal total
        if isinstance(m, Int4Linear):
            if m.four_bit_at(rows):
                total += m.four_bit_bytes()
            else:
                total += m.in_features * m.out_features * m.dtype.itemsize  # its dense copy
            return
        if isinstance(m, SmallRowsInt8):
            visit(m.int8 if rows <= m.max_rows else m.dense)
            return
        if isinstance(m, Int8Linear):
            total += m.weight.nbytes + m.scale.nbytes
            return
        if isinstance(m, PackedLinear):
            total += m.in_features * m.out_features * m.packed.element_size()
            return
        if isinstance(m, nn.Linear):
            total += m.weight.nbytes
            return
        if isinstance(m, nn.Embedding):
            return  # a tied lm_head counts it as its weight; else only a few rows are read
        total += sum(p.nbytes for p in m.parameters(recurse=False))
        for child in m.children():
            visit(child)
    visit(net)
    return total


def linear_params(c: ModelConfig, lm_head_rows: bool = True) -> int:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * per_layer + (c.hidden_size * c.vocab_size if lm_head_rows else 0)


def decode_step_cost(net: nn.Module, batch: int, context: int, kv_itemsize: int) -> dict:
    """Bytes and FLOP of one decode step of `batch` sequences with `context` tokens each."""
    c = net.config
    kv = batch * context * c.num_layers * 2 * c.num_kv_heads * c.head_dim * kv_itemsize
    attention = 4 * batch * context * c.num_heads * c.head_dim * c.num_layers
    return {"bytes": weight_bytes(net, batch) + kv, "flop": 2 * batch * linear_params(c) + attention}


def prefill_cost(net: nn.Module, tokens: int) -> dict:
    """One prompt of `tokens` in one forward, logits for its last token only."""
    c = net.config
    attention = 2 * tokens * tokens * c.num_heads * c.head_dim * c.num_layers  # causal: half of QK^T and PV
    flop = 2 * tokens * linear_params(c, lm_head_rows=False) + 2 * c.hidden_size * c.vocab_size + attention
    return {"bytes": weight_bytes(net, tokens), "flop": flop}


def share(cost: dict, seconds: float, limits: dict, dtype: torch.dtype) -> dict:
    """What a step of cost taking `seconds` uses of the bandwidth and of dtype's matmul peak."""
    memory = cost["bytes"] / seconds / (limits["read_bandwidth_gb_s"] * 1e9)
    compute = cost["flop"] / seconds / (limits["matmul_peak_gflop_s"][str(dtype).removeprefix("torch.")] * 1e9)
    return {"memory": round(memory, 3), "compute": round(compute, 3), "of_limit": round(max(memory, compute), 3),
            "bound": "memory" if memory >= compute else "compute"}


if __name__ == "__main__":
    print(json.dumps({"threads": torch.get_num_threads(), "isa_limits": isa_limits(),
                      **machine_limits({torch.float32, torch.bfloat16})}, indent=2))
