"""Our Q4_1 kernel's two ways with bf16 rows, on the same packed weights: the inputs rounded to int8 a group
(`int4_linear_int8`, AVX-512 VNNI: vpdpbusd adds 4 nibble x int8 products a lane exactly in 32 bits, as llama.cpp
multiplies Q4_1 by Q8_1) against the bf16 rows (`int4_linear`: inputs rounded to int16 a group, vpdpwssd; before
2026-12-05 nibbles widened to bf16, vdpbf16ps). SmolLM2-135M's 120 layer
linears, from memory, at a few rows (inferd.models.cpu.int4_int8_rows is set from this), and each one's error
against the float64 product of the file's weights on random inputs.

    PYTHONPATH=. .venv/bin/python benchmarks/int4_int8_inputs.py --out benchmarks/results/int4-int8-inputs-zen4.md
"""
import argparse
import statistics
import sys
from datetime import datetime, timezone

import torch

from benchmarks.engine import _cpu_name
from benchmarks.int4_linear import as_linear, layer_linears, seconds
from inferd.models.int4 import Int4Linear, dequantize_q4_1, quantize_q4_1
from inferd.models.int4_kernel import load_int4_kernel
from inferd.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernel = load_int4_kernel()
    assert kernel is not None and kernel.int4_linear_bf16_native(), "needs AVX-512 VNNI and BF16"
    weights = layer_linears(load_model(None, progress=False).weights)
    layers = [Int4Linear(as_linear(w), 1 << 30, kernel, torch.bfloat16) for w in weights]
    ops = {"bf16 rows": lambda l, x: kernel.int4_linear(x, l.nibbles, l.dm, l.row_bias, l.out_features),
           "int8 inputs": lambda l, x: kernel.int4_linear_int8(x, l.nibbles, l.dm, l.row_bias, l.out_features)}
    lines = [f"# Q4_1 linears: int8 inputs (VNNI) against bf16 rows ({datetime.now(timezone.utc):%Y-%m-%d}; "
             f"{_cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__})", "",
             f"`PYTHONPATH=. .venv/bin/python benchmarks/int4_int8_inputs.py {' '.join(sys.argv[1:])}`", "",
             "Error: |y - y_ref| / |y_ref| over 8 random rows of each of the 4 linears of layer 0 (y_ref: float64, the "
             "file's Q4_1 weights).", ""]
    g = torch.Generator().manual_seed(0)
    for name, op in ops.items():
        errs = []
        for w in weights[:4]:
            layer = Int4Linear(as_linear(w), 1 << 30, kernel, torch.bfloat16)
            x = torch.randn(8, w.shape[1], generator=g).bfloat16()
            q, d, m = quantize_q4_1(w)  # d and m in fp16, as the layer packs them
            ref = x.double() @ dequantize_q4_1(q, d.half().float(), m.half().float()).double().T
            errs.append(((op(layer, x).double() - ref).norm() / ref.norm()).item())
        lines.append(f"- {name}: {statistics.median(errs):.4f}")
    lines += ["", "| rows | " + " | ".join(f"{n}, ms" for n in ops) + " | int8 inputs' speed / bf16 rows' |", "|---:|---:|---:|---:|"]
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, w.shape[1]).bfloat16() for w in weights]
            runs = {name: [] for name in ops}
            for _ in range(args.repeats + 1):  # the first pass warms
                for name, op in ops.items():
                    runs[name].append(seconds(lambda: [op(layer, x) for layer, x in zip(layers, xs)]))
            ms = [statistics.median(r[1:]) * 1e3 for r in runs.values()]
            lines.append(f"| {m} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[0] / ms[1]:.2f}x |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
