"""SmolLM2-135M's 120 layer linears (qkv, o, gate_up, down of its 30 layers) at a few rows, in 4 bits and dense:
our Q4_1 kernel (inferd.models.int4_kernel, AVX-512 BF16), torch's `_weight_int4pack_mm_for_cpu` on the same
weights, and the dense bf16 copy the engine takes above int4_max_rows (oneDNN prepacked). One pass runs all 120
in a row, so each reads its weights from memory (66 MB of 4-bit weights, far past the last-level cache), as a
decode step does. Median of --repeats passes per size, the three taking turns.

    PYTHONPATH=. .venv/bin/python benchmarks/int4_linear.py --out benchmarks/results/int4-linear-zen4.json
"""
import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
from torch import nn

from benchmarks.engine import _cpu_name
from inferd.models.int4 import Int4Linear
from inferd.models.int4_kernel import load_int4_kernel
from inferd.models.loader import load_model


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernel = load_int4_kernel()
    assert kernel is not None, "our int4 kernel needs AVX-512 BF16"
    weights = layer_linears(load_model(None, progress=False).weights)
    ours = [Int4Linear(as_linear(w), 1 << 30, kernel) for w in weights]
    torchs = [Int4Linear(as_linear(w), 1 << 30) for w in weights]
    dense = [layer.dense for layer in ours]
    bytes_ours = sum(layer.four_bit_bytes() for layer in ours)
    bytes_torch = sum(layer.four_bit_bytes() for layer in torchs)
    bytes_dense = sum(w.numel() * 2 for w in weights)
    targets = {"ours": (ours, bytes_ours), "torch int4": (torchs, bytes_torch), "dense bf16": (dense, bytes_dense)}
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": _cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "python": platform.python_version()},
              "bytes": {name: b for name, (_, b) in targets.items()}, "rows": {}}
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, w.shape[1]).bfloat16() for w in weights]
            runs = {name: [] for name in targets}
            for _ in range(args.repeats + 1):  # the first pass warms
                for name, (layers, _) in targets.items():
                    runs[name].append(seconds(lambda: [layer(x) for layer, x in zip(layers, xs)]))
            row = {name: {"ms": round(statistics.median(r[1:]) * 1e3, 3),
                          "gb_s": round(targets[name][1] / statistics.median(r[1:]) / 1e9, 1)} for name, r in runs.items()}
            result["rows"][m] = row
            print(f"rows {m:3d}: " + ", ".join(f"{n} {v['ms']:.2f} ms ({v['gb_s']} GB/s)" for n, v in row.items())
                  + f"; torch / ours {row['torch int4']['ms'] / row['ours']['ms']:.2f}x,"
                  f" dense / ours {row['dense bf16']['ms'] / row['ours']['ms']:.2f}x", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        with open(args.out.removesuffix(".json") + ".md", "w") as f:
            f.write(table(result, " ".join(sys.argv[1:])))


def table(r: dict, args: str) -> str:
    lines = [f"# SmolLM2-135M's 120 layer linears in 4 bits and dense ({r['date']}; {r['machine']['cpu']}, "
             f"{r['machine']['threads']} threads, torch {r['machine']['torch']})", "",
             f"`PYTHONPATH=. .venv/bin/python benchmarks/int4_linear.py {args}`: ms for all 120 (weights from memory),"
             " and the GB/s of each one's weight bytes.", "",
             "| rows | ours (Q4_1, fp16 d/m) | torch `_weight_int4pack_mm_for_cpu` | dense bf16 (oneDNN) | torch / ours "
             "| dense / ours |", "|---:|---:|---:|---:|---:|---:|"]
    for m, v in r["rows"].items():
        o, t, d = v["ours"], v["torch int4"], v["dense bf16"]
        lines.append(f"| {m} | {o['ms']:.2f} ms ({o['gb_s']} GB/s) | {t['ms']:.2f} ms ({t['gb_s']} GB/s) | {d['ms']:.2f} ms"
                     f" ({d['gb_s']} GB/s) | {t['ms'] / o['ms']:.2f}x | {d['ms'] / o['ms']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
