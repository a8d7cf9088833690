"""One decode forward taken apart: its time with the layers as one C++ call and as the Python loop, and where the
Python loop's time goes, op by op.

The engine (SmolLM2, --format dtype:quantization) prefills B prompts of --context random tokens, then one decode
forward of those B rows is timed, taking turns between the C++ layer loop (decode_loop.py) and the Python loop,
medians of --repeats passes of 20 forwards. Then each op of the Python loop (the four linears, lm_head, the small
ops) is wrapped in a timer for 100 forwards: the ops' sum, and what is left (Python between them). The wrappers
cost ~0.3 µs a call themselves, so "outside the ops" is a little high.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_step.py --format auto:int4 --batches 1,8 \
        --out benchmarks/results/decode-step-zen4.json
"""
import argparse
import json
import statistics
import time
from datetime import datetime, timezone

import torch

from benchmarks.cpu_kernels import per_call_us
from benchmarks.engine import random_prompts
from benchmarks.machine import cpu_name
from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.model_runner import Chunk
from inferd.engine.request import SamplingParams
from inferd.models.loader import load_model

SMALL_OPS = ("rms_norm", "add_rms_norm", "silu_mul", "rope_cache", "paged_decode")


def decode_forward(engine: LLMEngine, batch: int, context: int):
    """A function running one decode forward of `batch` rows at `context` tokens, and the model."""
    for i, ids in enumerate(random_prompts(batch, context, engine.model.config.vocab_size)):
        engine.add_request(f"b{batch}-{i}", ids, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    while (batch_ := engine.scheduler.schedule()).prefills:
        engine.run_batch(batch_)
    chunks = [Chunk(s.seq, s.seq.num_computed_tokens, s.seq.token_ids[-1:], 1) for s in batch_.decodes]
    return lambda: engine.runner.forward(chunks, [])


def by_op(net, forward, calls: int = 100) -> dict[str, float]:
    """ms a forward in each op of the Python loop, and outside them."""
    spent: dict[str, int] = {}

    def wrap(name, f):
        def run(*args):
            t = time.perf_counter_ns()
            y = f(*args)
            spent[name] = spent.get(name, 0) + time.perf_counter_ns() - t
            return y
        return run

    kernels, (layers, head) = net.kernels, net._planned()
    for ops in layers:
        for name in ("qkv", "o", "gated", "down"):  # gated: gate_up and its silu (fused, or silu_mul after it)
            setattr(ops, name, wrap(name, getattr(ops, name)))
    net.kernels = type("Timed", (), {n: staticmethod(wrap(n, getattr(kernels, n))) for n in SMALL_OPS})
    net._plan, net._loop = (layers, wrap("lm_head", head)), lambda meta, rows: None
    try:
        for _ in range(10):
            forward()
        spent.clear()
        t = time.perf_counter()
        for _ in range(calls):
            forward()
        total = (time.perf_counter() - t) / calls * 1e3
    finally:
        del net._loop
        net.kernels = kernels
        net.replan()
    ops = {k: round(v / calls / 1e6, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    return {"forward_ms": round(total, 3), "ops_ms": ops, "outside_ops_ms": round(total - sum(ops.values()), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: packaged SmolLM2)")
    ap.add_argument("--format", default="auto:int4", help="dtype:quantization")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype, quantization = args.format.split(":")
    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(load_model(args.model, progress=False), EngineConfig(
        dtype=dtype, quantization=quantization, max_num_seqs=max(batches), enable_prefix_caching=False,
        max_num_batched_tokens=max(batches) * args.context, small_step_threads=torch.get_num_threads()))
    net = engine.runner.model
    result = {"machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "date": datetime.now(timezone.utc).isoformat(timespec="minutes")},
              "format": f"{engine.dtype} {engine.quantization}".replace("torch.", ""), "context": args.context,
              "batches": {}}
    python_loop = lambda meta, rows: None  # noqa: E731
    for b in batches:
        forward = decode_forward(engine, b, args.context)
        runs = {"C++ loop": [], "Python loop": []}
        for round_ in range(args.repeats):
            for name in ("C++ loop", "Python loop") if round_ % 2 == 0 else ("Python loop", "C++ loop"):
                if name == "Python loop":
                    net._loop = python_loop
                runs[name].append(per_call_us(forward, 20, 1) / 1e3)
                net.__dict__.pop("_loop", None)
        medians = {k: round(statistics.median(v), 3) for k, v in runs.items()}
        result["batches"][str(b)] = {"forward_ms": medians, "runs_ms": runs,
                                     "cpp_loop_planned": net._loops.get(b) is not None,
                                     "python_loop_by_op": by_op(net, forward)}
        for i in range(b):
            engine.abort(f"b{b}-{i}")
        r = result["batches"][str(b)]
        print(f"B={b}: forward C++ loop {medians['C++ loop']} ms (planned: {r['cpp_loop_planned']}), Python loop "
              f"{medians['Python loop']} ms; Python loop by op: {r['python_loop_by_op']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
