"""SmolLM2-135M's 120 layer linears (qkv, o, gate_up, down of its 30 layers) at a few rows, in 4 bits and dense.
One pass runs all 120 in a row, so each reads its weights from memory (66 MB of 4-bit weights, far past the
last-level cache), as a decode step does, each called as the engine calls it (its `op`). Median of --repeats
passes per size, the candidates taking turns.

--dtype bfloat16: our Q4_1 kernel (inferd.models.int4_kernel, AVX-512 BF16), torch's
`_weight_int4pack_mm_for_cpu` on the same weights, and the dense bf16 copy the engine takes above int4_max_rows
(oneDNN prepacked).
--dtype float32: our Q4_1 kernel's float32 rows (AVX2 loops: 16-bit inputs, int8 ones from int4_int8_rows rows, as
the engine calls it), our int8 kernel (inferd.models.quant), and a dense float32 copy (oneDNN prepacked).
`--isa avx2` builds our kernels for AVX2 alone; with the other limits of benchmarks/limits.py (ISA_LIMITS)
oneDNN, torch and MKL keep to AVX2 too: an AVX2 machine's code on this one (its memory and cores stay this
machine's).

    PYTHONPATH=. .venv/bin/python benchmarks/int4_linear.py --out benchmarks/results/int4-linear-zen4.json
    MKL_ENABLE_INSTRUCTIONS=AVX2 INFERD_KERNEL_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \
        PYTHONPATH=. .venv/bin/python benchmarks/int4_linear.py --dtype float32 --isa avx2 \
        --rows 1,4,16,32,64,128,256,1024 --out benchmarks/results/int4-linear-fp32-avx2-code-emr.json
"""
import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
from torch import nn

from benchmarks.machine import cpu_name
from benchmarks.limits import isa_limits
from benchmarks.quantization import save_report
from inferd.models.int4 import Int4Linear, takes
from inferd.models.int4_kernel import load_int4_kernel
from inferd.models.loader import load_model
from inferd.models.quant import Int8Linear
from inferd.kernels.variants import load_kernels

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def layer_linears(weights: dict) -> list[torch.Tensor]:
    out = []
    for i in range(30):
        p = f"model.layers.{i}."
        qkv = torch.cat([weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        gate_up = torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]])
        out += [qkv, weights[p + "self_attn.o_proj.weight"], gate_up, weights[p + "mlp.down_proj.weight"]]
    return [w.float() for w in out]


def as_linear(w: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    return linear


def seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def one_by_one(fn, args) -> Callable[[], None]:
    """A pass calling fn on each of args in turn, each output dropped at once, as a forward drops a layer's output
    once the next has read it. Until 2026-12-06 these benchmarks kept a pass's 120 outputs alive to its end: up to
    40 MB of new pages a pass at 64 rows, each first touched in a timed call (on an Emerald Rapids in AVX2 code,
    scratch timings: the int8-input rows' 120 linears 50-53 ms so, 37-41 dropped at once)."""
    args = list(args)

    def run() -> None:
        for a in args:
            fn(*a)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--isa", default="native", help="the kernels' variant (inferd.kernels.variants; avx2: the AVX2 loops alone)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    kernel = load_int4_kernel(args.isa)
    assert kernel is not None and takes(kernel, dtype), f"our int4 kernel takes no {args.dtype} rows on this build"
    weights = layer_linears(load_model(None, progress=False).weights)
    ours = [Int4Linear(as_linear(w), 1 << 30, kernel, dtype) for w in weights]
    dense = [layer.dense for layer in ours]
    targets = {"ours": (ours, sum(layer.four_bit_bytes() for layer in ours))}
    if dtype is torch.bfloat16:
        torchs = [Int4Linear(as_linear(w), 1 << 30) for w in weights]
        targets["torch int4"] = (torchs, sum(layer.four_bit_bytes() for layer in torchs))
    else:
        int8 = [Int8Linear(as_linear(w), load_kernels(args.isa)) for w in weights]
        targets["int8"] = (int8, sum(layer.weight.nbytes + layer.scale.nbytes for layer in int8))
    targets[f"dense {DTYPE_NAMES[dtype]}"] = (dense, sum(w.numel() * dtype.itemsize for w in weights))
    targets = {name: ([layer.op(dtype) for layer in layers], b) for name, (layers, b) in targets.items()}  # as the engine calls them
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "python": platform.python_version(), "kernel_isa": args.isa, "isa_limits": isa_limits()},
              "dtype": args.dtype, "bytes": {name: b for name, (_, b) in targets.items()}, "rows": {}}
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, w.shape[1]).to(dtype) for w in weights]
            runs = {name: [] for name in targets}
            for _ in range(args.repeats + 1):  # the first pass warms
                for name, (ops, _) in targets.items():
                    runs[name].append(seconds(one_by_one(lambda op, x: op(x), zip(ops, xs))))
            row = {name: {"ms": round(statistics.median(r[1:]) * 1e3, 3),
                          "gb_s": round(targets[name][1] / statistics.median(r[1:]) / 1e9, 1)} for name, r in runs.items()}
            result["rows"][m] = row
            print(f"rows {m:3d}: " + ", ".join(f"{n} {v['ms']:.2f} ms ({v['gb_s']} GB/s)" for n, v in row.items())
                  + "; " + ", ".join(f"{n} / ours {v['ms'] / row['ours']['ms']:.2f}x" for n, v in row.items()
                                     if n != "ours"), flush=True)
    save_report(result, table(result, " ".join(sys.argv[1:])), args.out)


def table(r: dict, args: str) -> str:
    machine, names = r["machine"], list(next(iter(r["rows"].values())))
    env = machine.get("isa_limits") or " ".join(  # before 2026-12-06 two of the limits, by name
        f"{k}={machine[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if machine.get(k))
    env = "" if env == "none" else env
    lines = [f"# SmolLM2-135M's 120 layer linears in 4 bits and dense, {r.get('dtype', 'bfloat16')} rows ({r['date']}; "
             f"{machine['cpu']}, {machine['threads']} threads, torch {machine['torch']}, our kernels built for "
             f"kernels {machine.get('kernel_isa', machine.get('march', 'native'))})", "",
             f"`{env + ' ' if env else ''}PYTHONPATH=. .venv/bin/python benchmarks/int4_linear.py {args}`: ms for all "
             "120 (weights from memory), and the GB/s of each one's weight bytes.", "",
             "| rows | " + " | ".join(names) + " | " + " | ".join(f"{n} / ours" for n in names[1:]) + " |",
             "|---:|" + "---:|" * (2 * len(names) - 1)]
    for m, v in r["rows"].items():
        lines.append(f"| {m} | " + " | ".join(f"{v[n]['ms']:.2f} ms ({v[n]['gb_s']} GB/s)" for n in names) + " | "
                     + " | ".join(f"{v[n]['ms'] / v['ours']['ms']:.2f}x" for n in names[1:]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
