"""How much of a decode step is decode attention: the step with the paged-attention kernel, then with it
replaced by a copy of q (wrong tokens, the same work everywhere else), taking turns, in one run.

The workload is benchmarks/engine.py's (B prompts of 128 random tokens, 128 new tokens, greedy, no EOS);
attention's cost per step = step time with it - step time without it. Where the profiler names the kernel's
calls it also adds its own cost to every op; this does not. The C++ decode loop (inferd/models/decode_loop.py) calls
the kernel directly, so both runs take the Python loop (until 2026-12-07 the C++ loop was given a copy's address).

    PYTHONPATH=. python benchmarks/decode_attention_share.py --out benchmarks/results/decode-attention-share.json
"""
import argparse
import json
import platform
import statistics
from datetime import datetime, timezone

import torch

from benchmarks.engine import _log, inferd_decode, inferd_engine
from benchmarks.machine import cpu_name
from benchmarks.limits import isa_limits
from inferd.models.loader import load_model

class PythonLoop:
    """The kernels of `real` without the C++ decode loop: the layers run from Python."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        if name in ("make_plan", "run_plan"):
            raise AttributeError(name)
        return getattr(self.real, name)


class WithoutAttention(PythonLoop):
    """The same, with decode attention replaced by a copy of q."""

    @staticmethod
    def paged_decode(q, *args):
        return q.clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="auto:none,auto:int4")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = load_model(None, progress=False)
    engines = dict(inferd_engine(model, spec, batches) for spec in args.formats.split(","))
    runs: dict[tuple, list[float]] = {}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            real = engine.model.kernels
            for b in batches:
                for mode, kernels in (("with", PythonLoop(real)), ("without", WithoutAttention(real))):
                    engine.model.use_kernels(kernels)
                    runs.setdefault((name, b, mode), []).append(inferd_decode(engine, b))
                    _log(f"{name} B={b} {mode} attention: {runs[name, b, mode][-1]:.1f} tok/s")
            engine.model.use_kernels(real)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": model.name,
              "machine": {"cpu": cpu_name(), "cores": torch.get_num_threads(), "torch": torch.__version__,
                          "python": platform.python_version(),
                          "cpu_capability": torch.backends.cpu.get_cpu_capability(), "isa_limits": isa_limits()},
              "rows": []}
    lines = ["| format | B | step ms, with attention | step ms, without | attention ms per step | share |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in engines:
        for b in batches:
            tok_s = {mode: statistics.median(runs[name, b, mode]) for mode in ("with", "without")}
            step = {mode: 1000 * b / v for mode, v in tok_s.items()}
            attention = step["with"] - step["without"]
            result["rows"].append({"format": name, "batch": b, "step_ms": step, "attention_ms": attention,
                                   "share": attention / step["with"],
                                   "runs_tok_s": {m: [round(x, 1) for x in runs[name, b, m]] for m in step}})
            lines.append(f"| {name} | {b} | {step['with']:.2f} | {step['without']:.2f} | {attention:.2f} | "
                         f"{attention / step['with']:.0%} |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        with open(args.out.removesuffix(".json") + ".md", "w") as f:
            f.write(f"# Decode attention's share of a step\n\n{result['date']} · {result['machine']['cpu']}, "
                    f"{result['machine']['cores']} threads · ISA limits: {result['machine']['isa_limits']} · medians "
                    f"of {args.repeats} runs\n\n")
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
