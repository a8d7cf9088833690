"""What a second OpenMP pool costs: one of SmolLM2's linears (8 rows, 576 -> 1536, as a decode step at B=8 runs
its gate/up projection) timed in a fresh process three ways, each in one run:
  one_pool      the main thread makes the weights and runs the linear (the only pool)
  second_pool   the main thread runs a parallel region first (as a model loaded on it would), then another
                thread runs the linear: two pools, as a replica had with its model loaded on the main thread
  passing_load  the weights are made in a thread that exits (inferd.replica.loading), another runs the linear
Microseconds per call, medians of --repeats, per dtype.

    PYTHONPATH=. .venv/bin/python benchmarks/openmp_pools.py --out benchmarks/results/openmp-pools-spr.json
"""
import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

CASE = """
import statistics, sys, threading, time, torch
import torch.nn.functional as F
from inferd.replica.loading import in_passing_thread
mode, dtype, repeats = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3])
make = lambda: (torch.randn(1536, 576).to(dtype), torch.randn(8, 576).to(dtype))
def timed(w, x):
    for _ in range(50):
        F.linear(x, w)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        F.linear(x, w)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6
out = {}
if mode == "one_pool":
    out["us"] = timed(*make())
else:
    w, x = make() if mode == "second_pool" else in_passing_thread(make)
    if mode == "second_pool":
        F.linear(x, w)  # a parallel region on the main thread: its pool stays
    worker = threading.Thread(target=lambda: out.update(us=timed(w, x)))
    worker.start(); worker.join()
print(out["us"])
"""
MODES = ("one_pool", "second_pool", "passing_load")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3, help="the modes take turns; the median round is kept")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from benchmarks.machine import cpu_name
    runs = {d: {m: [] for m in MODES} for d in args.dtypes.split(",")}
    for _ in range(args.rounds):
        for dtype, by in runs.items():
            for mode in MODES:
                out = subprocess.run([sys.executable, "-c", CASE, mode, dtype, str(args.repeats)], check=True,
                                     capture_output=True, text=True, env=os.environ).stdout
                by[mode].append(round(float(out), 1))
    medians = {d: {m: sorted(v)[len(v) // 2] for m, v in by.items()} for d, by in runs.items()}
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_name(),
              "cores": os.cpu_count(), "runs_us": runs, "medians_us": medians}
    print(json.dumps(medians, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
