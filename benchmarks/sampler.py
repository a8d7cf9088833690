"""The engine's Sampler over SmolLM2's vocabulary (49,152), every row sampled at temperature 1: its draw (one
uniform per row, searched in the float64 cumulative sum) as the C++ op `sample_rows` and as the same steps in
torch, against the exponential race it used until 2026-12-04 (argmax of p / E, one E ~ Exp(1) per vocabulary
entry), the rest of the call the same, same logits, same threads, in one run. Milliseconds per call (the whole
call, and the draw alone), medians of --repeats. Greedy rows: torch's argmax and max(dim).indices (the torch path's
pick) against the C++ op `best_rows` (the Sampler's where it is built).

    PYTHONPATH=. .venv/bin/python benchmarks/sampler.py --out benchmarks/results/sampler-spr.json
"""
import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.machine import cpu_name
from inferd.engine.request import SamplingParams
from inferd.engine.sampler import Sampler
from inferd.engine.sequence import Sequence
from inferd.models.cpu_kernels import TorchKernels
from inferd.kernels.variants import load_kernels

VOCAB = 49152


class RaceSampler(Sampler):
    """The draw as it was: one exponential per vocabulary entry, on one thread."""

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temperature = torch.tensor([s.params.temperature for s in seqs]).unsqueeze(1)
        probs = (logits / temperature).softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        return (probs / noise).argmax(dim=-1)


def ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    generator, rows = torch.Generator().manual_seed(0), []
    cpp = load_kernels()
    samplers = {"exponential_race": RaceSampler(seed=0), "inverse_cdf_torch": Sampler(seed=0, kernels=TorchKernels),
                "inverse_cdf_cpp": Sampler(seed=0, kernels=cpp)}
    for b in map(int, args.batches.split(",")):
        logits = torch.randn(b, VOCAB, generator=generator) * 3
        seqs = [Sequence(f"s{i}", [1], SamplingParams(max_tokens=1, temperature=1.0)) for i in range(b)]
        row = {"rows": b}
        for _ in range(3):  # the two take turns
            for name, sampler in samplers.items():
                row.setdefault(f"{name}_call_ms", []).append(ms(lambda: sampler(logits, seqs), args.repeats))
                row.setdefault(f"{name}_draw_ms", []).append(ms(lambda: sampler._sample(logits, seqs), args.repeats))
            row.setdefault("greedy_argmax_ms", []).append(ms(lambda: logits.argmax(dim=-1), args.repeats))
            row.setdefault("greedy_max_indices_ms", []).append(ms(lambda: TorchKernels.best_rows(logits), args.repeats))
            row.setdefault("greedy_cpp_ms", []).append(ms(lambda: cpp.best_rows(logits), args.repeats))
        row = {k: round(statistics.median(v), 3) if isinstance(v, list) else v for k, v in row.items()}
        row["cpp_call_speedup_over_torch"] = round(row["inverse_cdf_torch_call_ms"] / row["inverse_cdf_cpp_call_ms"], 2)
        row["greedy_speedup"] = round(row["greedy_argmax_ms"] / row["greedy_max_indices_ms"], 2)
        row["greedy_cpp_speedup_over_max_indices"] = round(row["greedy_max_indices_ms"] / row["greedy_cpp_ms"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_name(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "vocab": VOCAB, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
