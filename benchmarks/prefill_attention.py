"""Prefill attention alone (inferd.models.cpu_kernels.prefill_attention) at SmolLM2-135M's shapes (9 query heads,
3 KV heads, head_dim 64, blocks of 16), against the torch path (gather + SDPA), in one run, and as a share of the
matmul peak of its dtype measured in the same run (benchmarks/limits.py's: a 2,048-square product).

Cases: whole prompts (n = context, causal) and chunks of a longer prompt (the last n of the context, as chunked
prefill runs them); blocks scattered through the cache, as a running engine's are. FLOP: QK^T and PV over the
visible (query, key) pairs. Reported per call: milliseconds, medians of --repeats.

    PYTHONPATH=. .venv/bin/python benchmarks/prefill_attention.py --out benchmarks/results/prefill-attention-zen4.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 PYTHONPATH=. .venv/bin/python benchmarks/prefill_attention.py \
        --isa avx2 --dtypes float32 --out benchmarks/results/prefill-attention-avx2-build.json

The second runs the AVX2 build against torch held to AVX2 too, on an AVX-512 machine: the AVX2 fp32 loops were
0.7-1.1x SDPA (results/prefill-attention-zen4-avx2-build-fp32-loops.json), so AVX2 now takes SDPA.
"""
import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks import limits
from benchmarks.machine import cpu_name
from inferd.models.cpu_kernels import TorchKernels
from inferd.kernels.variants import load_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def setup(n: int, context: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = -(-context // BLOCK)
    k_cache, v_cache = (torch.randn(2 * blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in "kv")
    table = torch.randperm(2 * blocks, generator=g)[:blocks]
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, k_cache, v_cache, table, context, BLOCK, HEAD_DIM ** -0.5


def per_call_ms(op, args, repeats: int) -> float:
    runs = []
    for _ in range(repeats + 1):  # the first run warms up
        t = time.perf_counter()
        op(*args)
        runs.append((time.perf_counter() - t) * 1e3)
    return statistics.median(runs[1:])


def flop(n: int, context: int) -> int:
    pairs = sum(context - n + i + 1 for i in range(n))  # (query, key) pairs each query sees
    return 4 * pairs * HEADS * HEAD_DIM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="128:128,512:512,1024:1024,2048:2048,512:1024,512:2048",
                    help="queries:context pairs")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--isa", default="native", help="the kernels' variant (inferd.kernels.variants; avx2: the AVX2 loops alone)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cpp = load_kernels(args.isa)
    assert cpp is not None, "the C++ kernels do not build here"
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    rows, peaks = [], {}
    with torch.inference_mode():
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            peaks[name] = round(statistics.median(limits.matmul_peak(dtype) for _ in range(3)) / 1e9, 1)
            print(f"{name} matmul peak (benchmarks/limits.py): {peaks[name]} GFLOP/s, "
                  f"{torch.get_num_threads()} threads", flush=True)
            for case in args.cases.split(","):
                n, context = (int(x) for x in case.split(":"))
                inputs = setup(n, context, dtype)
                row = {"dtype": name, "queries": n, "context": context}
                for op_name, op in {"cpp": cpp.prefill_attention, "torch": TorchKernels.prefill_attention}.items():
                    ms = per_call_ms(op, inputs, args.repeats)
                    gflops = flop(n, context) / ms / 1e6
                    row[op_name] = {"ms": round(ms, 3), "gflop_s": round(gflops, 1),
                                    "share_of_matmul_peak": round(gflops / peaks[name], 3)}
                row["cpp_speedup"] = round(row["torch"]["ms"] / row["cpp"]["ms"], 2)
                print(json.dumps(row), flush=True)
                rows.append(row)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "cpu_capability": torch.backends.cpu.get_cpu_capability(), "kernel_isa": args.isa},
              "matmul_peak_gflop_s": peaks, "args": {k: str(v) for k, v in vars(args).items() if k != "out"},
              "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
