"""Our Q4_1 kernel's two ways, on the same packed weights: the inputs rounded to int8 a group (`int4_linear_int8`,
as llama.cpp multiplies Q4_1 by Q8_1) against 16 bits a group (`int4_linear`). bf16 rows (AVX-512 VNNI): vpdpbusd
adds 4 nibble x int8 products a lane exactly in 32 bits, against vpdpwssd on the 16-bit inputs (before 2026-12-05
nibbles widened to bf16, vdpbf16ps). float32 rows (AVX2, `--dtype float32 --isa avx2`): vpmaddubsw's 32
products an instruction against vpmaddwd's 16. SmolLM2-135M's 120 layer linears, from memory, at a few rows
(inferd.kernels.select's INT4 rule is set from this), and each one's error against the float64 product of the file's
weights on random inputs.

    PYTHONPATH=. .venv/bin/python benchmarks/int4_int8_inputs.py --out benchmarks/results/int4-int8-inputs-zen4.md
    MKL_ENABLE_INSTRUCTIONS=AVX2 INFERD_KERNEL_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \
        PYTHONPATH=. .venv/bin/python benchmarks/int4_int8_inputs.py --dtype float32 --isa avx2 \
        --out benchmarks/results/int4-int8-inputs-avx2-code-emr.md
"""
import argparse
import statistics
import sys
from datetime import datetime, timezone

import torch

from benchmarks.machine import cpu_name
from benchmarks.int4_linear import as_linear, layer_linears, one_by_one, seconds
from benchmarks.limits import isa_limits
from inferd.models.int4 import Int4Linear, dequantize_q4_1, quantize_q4_1, takes
from inferd.models.int4_kernel import load_int4_kernel
from inferd.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--isa", default="native", help="the kernels' variant (inferd.kernels.variants; avx2: the AVX2 loops alone)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype, kernel = getattr(torch, args.dtype), load_int4_kernel(args.isa)
    assert kernel is not None and takes(kernel, dtype), f"our int4 kernel takes no {args.dtype} rows on this build"
    weights = layer_linears(load_model(None, progress=False).weights)
    layers = [Int4Linear(as_linear(w), 1 << 30, kernel, dtype) for w in weights]
    rows_name = "bf16 rows" if dtype is torch.bfloat16 else "float32 rows, 16 bits"
    ops = {rows_name: lambda l, x: kernel.int4_linear(x, l.nibbles, l.dm, l.row_bias, l.out_features),
           "int8 inputs": lambda l, x: kernel.int4_linear_int8(x, l.nibbles, l.dm, l.row_bias, l.out_features)}
    lines = [f"# Q4_1 linears: int8 inputs against {rows_name} ({datetime.now(timezone.utc):%Y-%m-%d}; "
             f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, kernels {args.isa}; "
             f"limits: {isa_limits()})", "",
             f"`PYTHONPATH=. .venv/bin/python benchmarks/int4_int8_inputs.py {' '.join(sys.argv[1:])}`", "",
             "Error: |y - y_ref| / |y_ref| over 8 random rows of each of the 4 linears of layer 0 (y_ref: float64, the "
             "file's Q4_1 weights).", ""]
    g = torch.Generator().manual_seed(0)
    for name, op in ops.items():
        errs = []
        for w in weights[:4]:
            layer = Int4Linear(as_linear(w), 1 << 30, kernel, dtype)
            x = torch.randn(8, w.shape[1], generator=g).to(dtype)
            q, d, m = quantize_q4_1(w)  # d and m in fp16, as the layer packs them
            ref = x.double() @ dequantize_q4_1(q, d.half().float(), m.half().float()).double().T
            errs.append(((op(layer, x).double() - ref).norm() / ref.norm()).item())
        lines.append(f"- {name}: {statistics.median(errs):.4f}")
    lines += ["", "| rows | " + " | ".join(f"{n}, ms" for n in ops) + f" | int8 inputs' speed / {rows_name}' |",
              "|---:|---:|---:|---:|"]
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, w.shape[1]).to(dtype) for w in weights]
            runs = {name: [] for name in ops}
            for _ in range(args.repeats + 1):  # the first pass warms
                for name, op in ops.items():
                    runs[name].append(seconds(one_by_one(op, zip(layers, xs))))
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
