"""Decode tok/s in process, alone and beside another process that wakes in short bursts, in turn.

A served step shares the cores with the replica's HTTP loop, the gateway and the client: ~0.15 cores of short bursts
at 64 streams (per-thread CPU times from /proc, 2026-12-06). A thread of the step that such a burst preempts holds
up the step's other threads where they wait for it. Here a second process sleeps --period-us and then spins
--busy-us, over and over, while the engine decodes --batch streams (benchmarks/engine.py's loop); each round runs
once without it and once with it. Reports both medians and the median of each round's ratio (on / off).

    PYTHONPATH=. .venv/bin/python benchmarks/interference.py --out benchmarks/results/interference.json
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.engine import PROMPT_LEN, inferd_decode
from benchmarks.machine import cpu_name
from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.models.loader import load_model

BURSTS = """
import sys, time
period, busy = float(sys.argv[1]) / 1e6, float(sys.argv[2]) / 1e6
while True:
    time.sleep(period)
    end = time.perf_counter() + busy
    while time.perf_counter() < end:
        pass
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="auto:none", help="dtype:quantization")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--period-us", type=float, default=1000)
    ap.add_argument("--busy-us", type=float, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype, quantization = args.format.split(":")
    engine = LLMEngine(load_model(None, progress=False),
                       EngineConfig(dtype=dtype, quantization=quantization, max_model_len=2048, max_num_seqs=64,
                                    max_num_batched_tokens=64 * PROMPT_LEN, small_step_threads=torch.get_num_threads()))
    inferd_decode(engine, 2)  # warm-up
    runs = {"alone": [], "beside_bursts": []}
    for r in range(args.rounds):
        for mode in runs:
            bursts = None
            if mode == "beside_bursts":
                bursts = subprocess.Popen([sys.executable, "-c", BURSTS, str(args.period_us), str(args.busy_us)])
                time.sleep(0.3)
            try:
                runs[mode].append(round(inferd_decode(engine, args.batch), 1))
            finally:
                if bursts is not None:
                    bursts.kill()
                    bursts.wait()
        print(f"round {r}: {json.dumps({k: v[-1] for k, v in runs.items()})}", file=sys.stderr, flush=True)
    ratios = [round(b / a, 3) for a, b in zip(runs["alone"], runs["beside_bursts"])]
    result = {"machine": {"cpu": cpu_name(), "torch": torch.__version__}, "format": args.format,
              "batch": args.batch, "bursts": {"period_us": args.period_us, "busy_us": args.busy_us}, "runs": runs,
              "medians": {k: statistics.median(v) for k, v in runs.items()},
              "beside_over_alone": {"rounds": ratios, "median": statistics.median(ratios)}}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
