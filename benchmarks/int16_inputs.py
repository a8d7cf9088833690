"""bf16 rows multiplied as 16-bit integers (vpdpwssd) against the loops of --baseline REV, in one process:
SmolLM2-135M's int4 layer linears and its int8 lm_head at 1-3 rows, the same packed weights.

Since 2026-12-05 our int4 kernel's bf16 rows and the int8 kernel's one row on AVX-512 VNNI round their inputs to
16-bit integers a group of 32 and multiply them on vpdpwssd (inferd/models/int4_kernel.py, quant.py); before, the
nibbles were widened to bf16 (vdpbf16ps) and the int8 weights to float32 (FMAs). The lm_head's 2-3 rows
moved to the 16-bit loops later the same day (d3fb2a4 and before: one row only). Two measures of each, the
candidates taking turns, medians of --repeats:

- from memory: all 120 layer linears in a row (66 MB), and lm_head (28 MB) after them, as a decode step reads them;
- hot: one layer's four linears (2.2 MB) again and again, and a 2,048-channel slice of lm_head: the loops' own
  speed, which bounds them where memory is faster than they are.

    PYTHONPATH=. .venv/bin/python benchmarks/int16_inputs.py --baseline d17cda3 \\
        --out benchmarks/results/int16-inputs-zen4.json
"""
import argparse
import json
import statistics
import time
from datetime import datetime, timezone

import torch
from torch import nn

from benchmarks import limits
from benchmarks.machine import cpu_name
from benchmarks.int4_linear import as_linear, layer_linears
from benchmarks.paged_decode import built_at
from inferd.models.int4 import Int4Linear
from inferd.models.int4_kernel import load_int4_kernel
from inferd.models.loader import load_model
from inferd.models.quant import Int8Linear
from inferd.kernels.variants import load_kernels


def seconds_each(calls: dict, repeats: int, before=lambda: None) -> dict:
    """Median seconds of each zero-argument function, taking turns; `before` runs untimed before each call."""
    runs = {name: [] for name in calls}
    for _ in range(repeats + 1):  # the first pass warms
        for name, fn in calls.items():
            before()
            t = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t)
    return {name: statistics.median(r[1:]) for name, r in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a git revision whose kernels to time beside today's")
    ap.add_argument("--rows", default="1,2,3")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    int4 = {"today": load_int4_kernel(), args.baseline: built_at(args.baseline, "inferd/models/int4_kernel.py",
                                                                  ("int4_linear",), ())}
    int8 = {"today": load_kernels(), args.baseline: built_at(args.baseline, "inferd/models/quant.py",
                                                                  ("int8_linear",), ())}
    assert int4["today"].int4_linear_bf16_native(), "needs AVX-512 BF16 and VNNI"
    model = load_model(None, progress=False)
    layers = [Int4Linear(as_linear(w), 1 << 30, int4["today"], torch.bfloat16)
              for w in layer_linears(model.weights)]
    head = Int8Linear(as_linear(model.weights["model.embed_tokens.weight"].float()), int8["today"])  # tied lm_head
    four_bit = [layer.four_bit_bytes() for layer in layers]
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "read_bandwidth_gb_s": round(limits.read_bandwidth(huge_pages=True) / 1e9, 1)},
              "baseline": args.baseline, "linears": {}, "lm_head": {}, "lm_head_bytes": head.weight.nbytes}
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, layer.in_features).bfloat16() for layer in layers]
            args4 = [(layer.nibbles, layer.dm, layer.row_bias, layer.out_features) for layer in layers]
            cold = seconds_each({name: lambda k=k: [k.int4_linear(x, *a) for x, a in zip(xs, args4)]
                                 for name, k in int4.items()}, args.repeats)
            hot = seconds_each({name: lambda k=k: [k.int4_linear(x, *a) for _ in range(30)
                                                   for x, a in zip(xs[:4], args4[:4])] for name, k in int4.items()},
                               args.repeats)
            result["linears"][m] = {
                "from_memory_gb_s": {n: round(sum(four_bit) / s / 1e9, 1) for n, s in cold.items()},
                "hot_gb_s": {n: round(30 * sum(four_bit[:4]) / s / 1e9, 1) for n, s in hot.items()}}
            print(f"linears, rows {m}: {result['linears'][m]}", flush=True)
        xs = [torch.randn(1, layer.in_features).bfloat16() for layer in layers]
        layers_first = lambda: [int4["today"].int4_linear(x4, *a) for x4, a in zip(xs, args4)]  # noqa: E731
        part = head.weight[:128].contiguous(), head.scale[:2048].contiguous()  # 128 panels: 2,048 channels
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, head.in_features)
            heads = {name: lambda k=k: k.int8_linear(x, head.weight, head.scale, head.bias, head.out_features, 12)
                     for name, k in int8.items()}
            parts = {name: lambda k=k: [k.int8_linear(x, *part, head.bias, 2048, 12) for _ in range(20)]
                     for name, k in int8.items()}
            cold = seconds_each(heads, args.repeats, before=layers_first)  # the layers' 66 MB push lm_head out
            hot = seconds_each(parts, args.repeats)
            result["lm_head"][m] = {
                "from_memory_gb_s": {n: round(head.weight.nbytes / s / 1e9, 1) for n, s in cold.items()},
                "hot_gb_s": {n: round(20 * part[0].nbytes / s / 1e9, 1) for n, s in hot.items()}}
        print(f"lm_head: {result['lm_head']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
