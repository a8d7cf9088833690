"""float32 rows on weights kept in bf16 (`bf16w_linear`, inferd.models.packed.PanelLinear) against oneDNN's prepacked
float32 product (PackedLinear), the engine's two ways to run a float32 linear where bf16 is not native: all of
SmolLM2's linears (30 x qkv, o, gate_up, down + lm_head) at M rows, on 1 and on 2 threads; each pass reads every
weight once, so a few rows read them from memory as a decode step does. Rounds take turns; medians. With --busy,
a Python busy loop runs beside it (a CPU-bound neighbour on one of the cores).

    PYTHONPATH=. .venv/bin/python benchmarks/bf16w_linear.py --out benchmarks/results/bf16w-linear.json
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.linears import SHAPES
from benchmarks.machine import describe
from inferd.kernels.variants import load_kernels
from inferd.models.packed import PACK_FOR_BATCH, panel_weights

EMPTY = torch.empty(0)


def pass_ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256,1024")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--busy", action="store_true", help="a Python busy loop beside the run")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    kernels = load_kernels()
    if kernels is None or not kernels.bf16w_linear_native():
        sys.exit("bf16w_linear.py: no C++ kernels with AVX2 built here")
    torch.manual_seed(0)
    weights = [torch.randn(s) * 0.02 for s in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_BATCH) for w in weights]
    panels = [panel_weights(w) for w in weights]
    onednn, ours = torch.ops.mkldnn._linear_pointwise, kernels.bf16w_linear
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    rows_out = []
    try:
        time.sleep(1.0 if busy else 0.0)
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            for m in map(int, args.rows.split(",")):
                x = {k: torch.randn(m, k) for k in (576, 1536)}
                runs = {"onednn_float32": lambda: [onednn(x[w.shape[1]], p, None, "none", [None], "")
                                                   for w, p in zip(weights, packed)],
                        "bf16w": lambda: [ours(x[w.shape[1]], p, EMPTY) for w, p in zip(weights, panels)]}
                times = {name: [] for name in runs}
                for fn in runs.values():
                    fn()  # warm-up
                for _ in range(args.rounds if m < 256 else 3):
                    for name, fn in runs.items():
                        times[name].append(pass_ms(fn))
                med = {name: statistics.median(ts) for name, ts in times.items()}
                rows_out.append({"threads": threads, "rows": m, "ms": {k: round(v, 2) for k, v in med.items()},
                                 "bf16w_speedup": round(med["onednn_float32"] / med["bf16w"], 2)})
                print(json.dumps(rows_out[-1]), flush=True)
    finally:
        if busy:
            busy.kill()
    table = ["| threads | rows | oneDNN float32 ms | bf16w ms | bf16w speedup |", "|---|---|---|---|---|"]
    table += [f"| {r['threads']} | {r['rows']} | {r['ms']['onednn_float32']} | {r['ms']['bf16w']} | "
              f"{r['bf16w_speedup']}x |" for r in rows_out]
    print("\n".join(table))
    if args.out:
        result = {"machine": describe(), "beside": "a Python busy loop" if args.busy else "nothing",
                  "settings": vars(args) | {"out": args.out.name}, "results": rows_out}
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(
            f"# bf16w_linear against oneDNN's float32 product ({result['machine']['cpu']}, family "
            f"{result['machine']['family']}, {result['machine']['cores']} cores; beside: {result['beside']})\n\n"
            f"All of SmolLM2's linears a pass, medians of {args.rounds} rounds (3 from 256 rows) taking turns.\n\n"
            + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
