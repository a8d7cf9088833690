"""Decode attention alone (inferd.models.cpu_kernels.paged_decode) at SmolLM2-135M's shapes (9 query heads, 3 KV
heads, head_dim 64, blocks of 16), against the torch path (gather + SDPA), hot and cold, and as a share of the
read bandwidth measured in the same
run (benchmarks/limits.py's: a sum over 512 MiB). --baseline REV also builds the kernels as they were at a git
revision, and times them in the same run (the ratio of a kernel change).

- hot: the same layer's cache again and again (K/V stay in the CPU's caches);
- cold: one call per layer over --layers layers' caches, each as large as the engine's, the way a decode step
  reads them (each layer's K/V come from memory where all layers' caches exceed the CPU's L3: on a 300 MiB L3
  (an Emerald Rapids VM) 30 layers of 64 streams of 192 positions, 283 MB, partly come from L3; --layers 64 does not).

Blocks are scattered through the cache (a random permutation), as a running engine's are. Reported per call:
microseconds, medians of --repeats; and GB/s of K/V read, and that as a share of the bandwidth.

    PYTHONPATH=. .venv/bin/python benchmarks/paged_decode.py --baseline f0f1571 \
        --out benchmarks/results/paged-decode-zen4.json
"""
import argparse
import ast
import json
import statistics
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks import limits
from benchmarks.machine import cpu_name
from inferd.models.cpu_kernels import TorchKernels
from inferd.kernels.variants import load_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def built_at(rev: str, path: str = "inferd/models/cpu_kernels.py", functions: tuple[str, ...] = ("paged_decode",),
             cflags: tuple[str, ...] = ("-ffast-math",)):
    """The C++ kernels as they were at git revision `rev`, built for this CPU: inferd/kernels/csrc's files as one
    module, or at revisions before them the SOURCE string of the module at `path` exporting `functions`."""
    from torch.utils.cpp_extension import load, load_inline

    def show(name: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{name}"], check=True, capture_output=True, text=True).stdout

    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "inferd/kernels/csrc/"], capture_output=True,
                           text=True).stdout.split()
    if names:
        out = Path(tempfile.mkdtemp(prefix=f"inferd-kernels-{rev}-"))
        for name in names:
            (out / Path(name).name).write_text(show(name))
        return load(name=f"inferd_kernels_{rev}", sources=sorted(str(p) for p in out.glob("*.cpp")),
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"])
    source = next(ast.literal_eval(node.value) for node in ast.parse(show(path)).body
                  if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "SOURCE")
    return load_inline(name=f"{Path(path).stem}_{rev}", cpp_sources=[source], functions=list(functions),
                       extra_cflags=["-O3", "-march=native", "-fopenmp", *cflags], extra_ldflags=["-fopenmp"])


def setup(batch: int, context: int, layers: int, blocks_per_layer: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK)
    assert batch * per_seq <= blocks_per_layer, "the cache is too small for this batch"
    caches = [(torch.randn(blocks_per_layer * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype),
               torch.randn(blocks_per_layer * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype))
              for _ in range(layers)]
    tables = torch.randperm(blocks_per_layer, generator=g)[:batch * per_seq].view(batch, per_seq)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, caches, tables, torch.full((batch,), context)


def per_call_us(op, q, caches, tables, lens, calls: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats + 1):  # the first run warms up
        t = time.perf_counter()
        for i in range(calls):
            k, v = caches[i % len(caches)]
            op(q, k, v, tables, lens, BLOCK, HEAD_DIM ** -0.5)
        runs.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(runs[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=192, help="tokens per sequence (engine.py's decode: 128-256)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--blocks-per-layer", type=int, default=1024, help="each layer's cache, in blocks of 16")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True, help="also time gather + SDPA")
    ap.add_argument("--baseline", default=None, help="a git revision whose kernels to time beside today's")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cpp = load_kernels()
    assert cpp is not None, "the C++ kernels do not build here"
    baseline = built_at(args.baseline) if args.baseline else None
    bandwidth = round(statistics.median(limits.read_bandwidth() for _ in range(args.repeats)) / 1e9, 1)
    print(f"read bandwidth (benchmarks/limits.py): {bandwidth} GB/s, {torch.get_num_threads()} threads", flush=True)
    rows = []
    with torch.inference_mode():
        for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
            for b in [int(x) for x in args.batches.split(",")]:
                q, caches, tables, lens = setup(b, args.context, args.layers, args.blocks_per_layer, dtype)
                kv_bytes = 2 * b * args.context * KV_HEADS * HEAD_DIM * q.element_size()
                calls = max(args.layers, 3000 // b)
                row = {"dtype": str(dtype).removeprefix("torch."), "batch": b, "context": args.context,
                       "kv_bytes_per_call": kv_bytes}
                ops = {"cpp": cpp.paged_decode}
                if baseline is not None:
                    ops[f"cpp at {args.baseline}"] = baseline.paged_decode
                if args.torch:
                    ops["torch"] = TorchKernels.paged_decode
                for name, op in ops.items():
                    n = max(args.layers, calls // 10) if name == "torch" else calls
                    hot = per_call_us(op, q, caches[:1], tables, lens, n, args.repeats)
                    cold = per_call_us(op, q, caches, tables, lens, n, args.repeats)
                    row[name] = {"hot_us": round(hot, 1), "cold_us": round(cold, 1),
                                 "cold_gbs": round(kv_bytes / cold / 1e3, 2),
                                 "cold_share_of_bandwidth": round(kv_bytes / cold / 1e3 / bandwidth, 3)}
                row["cpp_speedup_cold"] = {name: round(row[name]["cold_us"] / row["cpp"]["cold_us"], 2)
                                           for name in ops if name != "cpp"}
                print(json.dumps(row), flush=True)
                rows.append(row)
                del caches
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__},
              "read_bandwidth_gbs": bandwidth, "args": {k: str(v) for k, v in vars(args).items() if k != "out"},
              "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
