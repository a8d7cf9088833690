"""SmolLM2-135M's 120 layer linears (qkv, o, gate_up, down of its 30 layers) in bf16 at a few rows, as a decode
step runs them, or at a prefill chunk's (--rows 128,256,512: then GFLOP/s is the figure to read): oneDNN's product
on the weights prepacked once (inferd.models.packed.PackedLinear, AMX tiles where the CPU has them) against
cpu_kernels' `amx_linear` on the copy in pairs along K (above 64 rows the engine takes it only for linears of at
most select.DENSE_BF16's outputs; here all 120 run on each). One pass runs all 120 in a row,
so each reads its weights from memory (270 MB); the two take turns, --repeats passes each per row count, medians.
Needs a CPU with AMX.

    PYTHONPATH=. .venv/bin/python benchmarks/amx_linear.py --out benchmarks/results/amx-linear-emr.json
    PYTHONPATH=. .venv/bin/python benchmarks/amx_linear.py --rows 65,128,256,384,512 \
        --out benchmarks/results/amx-linear-many-rows-emr.json
    PYTHONPATH=. .venv/bin/python benchmarks/amx_linear.py --shapes --rows 96,128,256,384,512 \
        --out benchmarks/results/amx-linear-shapes-emr.json

--shapes: each distinct layer shape alone, hot (its weights and rows in cache, as a prefill chunk's linear finds
them), oneDNN's prepacked product, amx_linear and torch's F.linear on the plain weights, GFLOP/s by turns: the
measure behind select.DENSE_BF16's last row. With it the bf16 matmul peak (limits.py) at one thread and at all.
"""
import argparse
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from benchmarks.machine import cpu_name
from benchmarks.quantization import save_report
from benchmarks.int4_linear import layer_linears, one_by_one
from inferd.kernels.variants import load_kernels
from inferd.models.loader import load_model
from inferd.models.packed import EMPTY, PACK_FOR_BATCH, pair_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="2,4,8,16,24,32,48,64")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--shapes", action="store_true", help="each distinct shape alone, hot (see above)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernels = load_kernels()
    assert kernels is not None and kernels.amx_linear_native(), "no AMX bf16 on this CPU (or no C++ build)"
    weights = [w.to(torch.bfloat16) for w in layer_linears(load_model(None, progress=False).weights)]
    if args.shapes:
        return shapes(kernels, weights, [int(r) for r in args.rows.split(",")], args.repeats, args.out)
    nbytes = sum(w.numel() * 2 for w in weights)
    macs = sum(w.numel() for w in weights)  # a row's multiply-adds
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_BATCH) for w in weights]
    pairs = [pair_weights(w) for w in weights]
    linear, amx = torch.ops.mkldnn._linear_pointwise, kernels.amx_linear
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "python": platform.python_version()}, "bytes": nbytes, "rows": {}}
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, w.shape[1]).bfloat16() for w in weights]
            targets = {"oneDNN": one_by_one(lambda x, p: linear(x, p, None, "none", [None], ""), zip(xs, packed)),
                       "amx_linear": one_by_one(lambda x, p: amx(x, p, EMPTY), zip(xs, pairs))}
            row = {name: {"ms": round(s * 1e3, 3), "gb_s": round(nbytes / s / 1e9, 1),
                          "gflop_s": round(2 * macs * m / s / 1e9)}
                   for name, s in by_turns(targets, args.repeats).items()}
            row["oneDNN / amx_linear"] = round(row["oneDNN"]["ms"] / row["amx_linear"]["ms"], 2)
            result["rows"][m] = row
            print(f"rows {m:3d}: " + ", ".join(f"{n} {row[n]['ms']:.2f} ms ({row[n]['gb_s']} GB/s, "
                                               f"{row[n]['gflop_s']} GFLOP/s)" for n in targets)
                  + f"; amx_linear {row['oneDNN / amx_linear']:.2f}x as fast", flush=True)
    save_report(result, table(result, " ".join(sys.argv[1:])), args.out)


def by_turns(targets: dict, repeats: int) -> dict[str, float]:
    """Each target's median seconds over `repeats` passes, the targets taking turns; a first pass warms."""
    runs = {name: [] for name in targets}
    for _ in range(repeats + 1):
        for name, run in targets.items():
            t = time.perf_counter()
            run()
            runs[name].append(time.perf_counter() - t)
    return {name: statistics.median(r[1:]) for name, r in runs.items()}


def shapes(kernels, weights: list[torch.Tensor], rows: list[int], repeats: int, out: str | None) -> None:
    from benchmarks.limits import matmul_peak

    threads = torch.get_num_threads()
    peaks = {}
    for n in (1, threads):
        torch.set_num_threads(n)
        peaks[n] = round(matmul_peak(torch.bfloat16) / 1e9)
    torch.set_num_threads(threads)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "threads": threads, "torch": torch.__version__,
                          "bf16_matmul_peak_gflop_s_by_threads": peaks}, "shapes": {}}
    print(f"bf16 matmul peak by threads: {peaks} GFLOP/s", flush=True)
    linear = torch.ops.mkldnn._linear_pointwise
    with torch.inference_mode():
        for w in {tuple(w.shape): w for w in weights}.values():
            packed, pairs = torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_BATCH), pair_weights(w)
            row = {}
            for m in rows:
                x = torch.randn(m, w.shape[1]).bfloat16()
                targets = {"oneDNN": lambda: linear(x, packed, None, "none", [None], ""),
                           "amx_linear": lambda: kernels.amx_linear(x, pairs, EMPTY),
                           "F.linear": lambda: torch.nn.functional.linear(x, w)}
                row[m] = {name: round(2 * w.numel() * m / s / 1e9) for name, s in by_turns(targets, repeats).items()}
            label = f"{w.shape[0]}x{w.shape[1]}"
            result["shapes"][label] = row
            print(f"{label} (outputs x inputs), GFLOP/s: "
                  + "; ".join(f"{m} rows " + "/".join(str(v) for v in r.values()) for m, r in row.items())
                  + " (oneDNN/amx_linear/F.linear)", flush=True)
    lines = [f"# SmolLM2-135M's layer shapes alone, hot, bf16: GFLOP/s ({result['date']}; {cpu_name()}, {threads} "
             f"threads, torch {torch.__version__}; bf16 matmul peak {peaks} GFLOP/s by threads)", "",
             "| outputs x inputs | rows | oneDNN (prepacked) | amx_linear | F.linear |", "|---|---:|---:|---:|---:|"]
    for label, row in result["shapes"].items():
        for m, v in row.items():
            lines.append(f"| {label} | {m} | {v['oneDNN']} | {v['amx_linear']} | {v['F.linear']} |")
    save_report(result, "\n".join(lines), out)


def table(r: dict, args: str) -> str:
    m = r["machine"]
    lines = [f"# SmolLM2-135M's 120 layer linears in bf16 at a few rows: oneDNN (prepacked) against amx_linear "
             f"({r['date']}; {m['cpu']}, {m['threads']} threads, torch {m['torch']})", "",
             f"`PYTHONPATH=. .venv/bin/python benchmarks/amx_linear.py {args}`: ms for all 120 (weights from memory, "
             f"{r['bytes'] / 1e6:.0f} MB), the GB/s of their weight bytes and the GFLOP/s.", "",
             "| rows | oneDNN | amx_linear | amx_linear as fast as oneDNN |", "|---:|---:|---:|---:|"]
    for rows, v in r["rows"].items():
        cell = [f"{v[n]['ms']:.2f} ms ({v[n]['gb_s']} GB/s, {v[n].get('gflop_s', '-')} GFLOP/s)"
                for n in ("oneDNN", "amx_linear")]
        lines.append(f"| {rows} | {cell[0]} | {cell[1]} | {v['oneDNN / amx_linear']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
