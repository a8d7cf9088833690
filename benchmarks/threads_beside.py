"""Where a step's threads should stop counting a shared core: decode on all cores against one core fewer, in
process, beside a neighbour that uses a share of one core (busy for share x 10 ms of every 10 ms).

For each share and batch, the engine decodes on `cores` threads and on `cores - 1` (adapt_threads off: fixed
counts), in turn, each round; the table is the median ratio of the two rates. Where it crosses 1 is what
inferd/models/cores.py's BEARABLE should be: beyond it, others' use of a core costs a parallel step more than
that core's thread gives.

    PYTHONPATH=. .venv/bin/python benchmarks/threads_beside.py --out benchmarks/results/threads-beside.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.engine import random_prompts
from benchmarks.machine import cpu_name
from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams
from inferd.models.loader import load_model

NEIGHBOUR = """
import sys, time
share, period = float(sys.argv[1]), 0.010
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < share * period:
        pass
    time.sleep(max(period - (time.perf_counter() - start), 0))
"""


def decode(engine: LLMEngine, batch: int, new_tokens: int, seed: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(random_prompts(batch, 128, engine.model.config.vocab_size, seed=seed)):
        engine.add_request(f"s{seed}-{i}", ids, params)
    decode_s, tokens = 0.0, 0
    while engine.has_work():
        batch_now = engine.scheduler.schedule()
        t = time.perf_counter()
        outs = engine.run_batch(batch_now)
        if not batch_now.prefills:
            decode_s += time.perf_counter() - t
            tokens += len(outs)
    return tokens / decode_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shares", default="0,0.1,0.2,0.3,0.4,0.6,1.0")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shares, batches = [float(s) for s in args.shares.split(",")], [int(b) for b in args.batches.split(",")]
    cores = len(os.sched_getaffinity(0))
    counts = (cores, cores - 1)
    model = load_model(None, progress=False)
    engines = {n: LLMEngine(model, EngineConfig(num_threads=n, adapt_threads=False, enable_prefix_caching=False,
                                                 max_model_len=1024)) for n in counts}
    for e in engines.values():
        decode(e, 2, 4, seed=999)  # warm-up
    runs = {f"{s}_b{b}": {n: [] for n in counts} for s in shares for b in batches}
    seed = 0
    for _ in range(args.rounds):
        for s in shares:
            neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(s)]) if s > 0 else None
            time.sleep(0.5)
            try:
                for b in batches:
                    for n in counts:
                        seed += 1
                        runs[f"{s}_b{b}"][n].append(round(decode(engines[n], b, args.new_tokens, seed), 1))
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
            print(json.dumps({k: {n: v[-1] for n, v in by.items()} for k, by in runs.items() if k.startswith(f"{s}_")}),
                  file=sys.stderr, flush=True)
    ratio = {k: round(statistics.median(a / b for a, b in zip(by[counts[0]], by[counts[1]])), 3)
             for k, by in runs.items()}
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "cores": cores, "torch": torch.__version__},
              "settings": vars(args), "threads": counts, "runs": runs,
              f"ratio_{counts[0]}_over_{counts[1]}_threads": ratio}
    lines = [f"# {counts[0]} threads over {counts[1]} beside a neighbour using a share of a core ({result['date']})",
             "", f"{cpu_name()}, {cores} cores; median of {args.rounds} rounds' ratios of decode tok/s.", "",
             "| neighbour's share | " + " | ".join(f"B={b}" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    lines += [f"| {s} | " + " | ".join(f"{ratio[f'{s}_b{b}']:.2f}" for b in batches) + " |" for s in shares]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        Path(args.out.removesuffix(".json") + ".md").write_text(text)


if __name__ == "__main__":
    main()
