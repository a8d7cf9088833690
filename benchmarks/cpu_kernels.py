"""The decoder's small ops at one SmolLM2 layer's shapes: the C++ kernels against their torch versions
(inferd.models.cpu_kernels), and what the int4 and int8 linears add to their kernels at one row (int4 has a
path for 2-D bf16 inputs without casts and reshapes; "general path" is a 3-D input), and the lm_head on int8
against its bf16 copy by rows (inferd.kernels.select.INT8_HEAD_MAX_ROWS).

Microseconds per call, median of --repeats runs of --calls calls each, this process's torch threads.

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_kernels.py --out benchmarks/results/cpu-kernels.json
"""
import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from benchmarks.machine import cpu_name
from inferd.kernels.variants import cpu_flags
from inferd.models.cpu_kernels import TorchKernels
from inferd.kernels.variants import load_kernels
from inferd.models.int4 import GROUP, Int4Linear, int4_available
from inferd.models.packed import PackedLinear
from inferd.models.quant import FUSED_MAX_M, Int8Linear

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, BLOCK, VOCAB = 576, 1536, 9, 3, 64, 16, 49152  # SmolLM2-135M


def per_call_us(fn, calls: int, repeats: int) -> float:
    for _ in range(calls // 10):
        fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t) / calls * 1e6)
    return round(statistics.median(runs), 1)


def kernel_cases(dtype: torch.dtype) -> dict:
    """name -> (op name, args) at B=1, and decode attention at B=1 and B=32 over 256 tokens."""
    x, w = torch.randn(1, HIDDEN).to(dtype), torch.randn(HIDDEN).to(dtype)
    qkv = torch.randn(1, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    angles = torch.outer(torch.arange(8192, dtype=torch.float32), torch.rand(HEAD_DIM // 2))
    k_cache = torch.randn(64 * 16 * BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    v_cache = k_cache.clone()
    cases = {"rms_norm": ("rms_norm", (x, w, 1e-5)),
             "add_rms_norm": ("add_rms_norm", (x, x.clone(), w, 1e-5)),
             "silu_mul": ("silu_mul", (torch.randn(1, 2 * INTERMEDIATE).to(dtype),)),
             "rope_cache": ("rope_cache", (qkv, angles.cos(), angles.sin(), torch.tensor([100]), k_cache, v_cache,
                                           torch.tensor([77]), HEADS, KV_HEADS))}
    for b in (1, 32):
        q = torch.randn(b, HEADS, HEAD_DIM).to(dtype)
        tables = torch.arange(b * 16).view(b, 16)  # 16 blocks of 16: 256 tokens each
        cases[f"paged_decode B={b}"] = ("paged_decode", (q, k_cache, v_cache, tables, torch.full((b,), 256),
                                                         BLOCK, HEAD_DIM ** -0.5))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cpp = load_kernels()
    assert cpp is not None, "the C++ kernels do not build here"
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__},
              "kernels_us": {}, "linears_us": {}}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for name, (op, a) in kernel_cases(dtype).items():
                calls = args.calls // 10 if "B=32" in name else args.calls
                row = {"cpp": per_call_us(lambda: getattr(cpp, op)(*a), calls, args.repeats),
                       "torch": per_call_us(lambda: getattr(TorchKernels, op)(*a), calls, args.repeats)}
                result["kernels_us"][f"{str(dtype).removeprefix('torch.')} {name}"] = row
                print(str(dtype), name, row, flush=True)
        linear = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        if int4_available():
            l4, x = Int4Linear(linear, 4), torch.randn(1, HIDDEN).to(torch.bfloat16)
            result["linears_us"]["int4 1x576 @ 1536"] = {
                "module (fast path)": per_call_us(lambda: l4(x), args.calls, args.repeats),
                "kernel alone": per_call_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x, l4.packed, GROUP, l4.scales), args.calls, args.repeats),
                "general path": per_call_us(lambda: l4(x.view(1, 1, HIDDEN)), args.calls, args.repeats)}
        kernel = load_kernels()
        if kernel is not None:
            l8, x = Int8Linear(linear, kernel), torch.randn(1, HIDDEN)
            result["linears_us"]["int8 1x576 @ 1536"] = {
                "module, 2-D input": per_call_us(lambda: l8(x), args.calls, args.repeats),
                "kernel alone": per_call_us(lambda: kernel.int8_linear(x, l8.weight, l8.scale, l8.bias,
                                                                       l8.out_features, FUSED_MAX_M),
                                            args.calls, args.repeats),
                "general path": per_call_us(lambda: l8(x.view(1, 1, HIDDEN)), args.calls, args.repeats)}
            head = nn.Linear(HIDDEN, VOCAB, bias=False)  # lm_head: int8 against the bf16 copy, by rows (INT8_HEAD_MAX_ROWS)
            h8, dense = Int8Linear(head, kernel), PackedLinear(head.to(torch.bfloat16))
            avx2 = load_kernels("avx2") if "avx512f" in cpu_flags() else None
            for rows in (1, 2, 3, 4, 8):
                x = torch.randn(rows, HIDDEN).to(torch.bfloat16)
                result["linears_us"][f"lm_head {rows}x576 @ {VOCAB}"] = {
                    "int8": per_call_us(lambda: h8(x), args.calls // 20, args.repeats),
                    "bf16 prepacked": per_call_us(lambda: dense(x), args.calls // 20, args.repeats)}
                if avx2 is not None:  # the kernel alone, this CPU's build and the AVX2 build, same int8 weights
                    xf = x.float()
                    result["linears_us"][f"lm_head {rows}x576 @ {VOCAB}"]["int8 kernel alone"] = per_call_us(
                        lambda: kernel.int8_linear(xf, h8.weight, h8.scale, h8.bias, VOCAB, FUSED_MAX_M),
                        args.calls // 20, args.repeats)
                    result["linears_us"][f"lm_head {rows}x576 @ {VOCAB}"]["int8, AVX2 build"] = per_call_us(
                        lambda: avx2.int8_linear(xf, h8.weight, h8.scale, h8.bias, VOCAB, FUSED_MAX_M),
                        args.calls // 20, args.repeats)
        print(json.dumps(result["linears_us"], indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
