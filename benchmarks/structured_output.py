"""Structured output: what the grammar masks cost a decode step.

B streams decode (SmolLM2-135M-Instruct, fp32, one chat prompt, temperature 1, seeded, no EOS stop), K of
them constrained by a JSON schema (nested objects, enums, arrays); a constrained stream ends when its JSON
is complete. Per decode step: the model's forward; the worker thread's time on the K masks (llguidance
fills the bitmasks, numpy turns them into 0/-inf logit rows) while the forward runs, which is what the
step would pay without the overlap; and the engine thread's own grammar time (starting the worker, waiting
for it if the forward finished first, adding the K bias rows to the logits). Compile times apart: the
first includes llguidance's view of the vocabulary (built once per engine), the second is a new schema.
--serial runs the same with the masks filled on the engine thread after the forward, for comparison;
configurations are interleaved over --repeats, each in a fresh engine.

    python benchmarks/structured_output.py --out benchmarks/results/structured_output.json
"""
import argparse
import json
import os
import platform
import statistics
import time
from concurrent.futures import Future
from datetime import UTC, datetime

import llguidance
import torch

from inferd.engine import grammar
from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.request import ResponseFormat, SamplingParams
from inferd.models.loader import load_model

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "address", "tags", "items"],
          "properties": {
              "name": {"type": "string"}, "kind": {"enum": ["person", "company", "other"]},
              "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                          "properties": {"city": {"type": "string"},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
              "tags": {"type": "array", "items": {"type": "string"}},
              "items": {"type": "array", "items": {"type": "object", "required": ["sku", "qty"],
                                                   "properties": {"sku": {"type": "string"},
                                                                  "qty": {"type": "integer", "minimum": 1}}}}}}
PROMPT = "Describe a customer of a hardware store as JSON, with the items they bought."


class Timers:
    """Per step: forward, llguidance fill (worker thread) and engine-thread grammar time, in ms."""

    def __init__(self, engine: LLMEngine):
        self.forward, self.fill, self.engine_side, self.constrained, self.step = [], [], [], [], []
        self._wrap_forward(engine)
        self._wrap_masks(engine)

    def _wrap_forward(self, engine: LLMEngine) -> None:
        run = engine.runner.run
        def timed(batch):
            t0 = time.perf_counter()
            out = run(batch)
            self.forward.append((time.perf_counter() - t0) * 1e3)
            return out
        engine.runner.run = timed
        start = engine.masker.start
        def timed_start(seqs):
            t0 = time.perf_counter()
            pending = start(seqs)
            self._start_ms = (time.perf_counter() - t0) * 1e3
            self.constrained.append(len(pending.rows) if pending else 0)
            if pending is None:
                self.fill.append(0.0)
                self.engine_side.append(self._start_ms)
            return pending
        engine.masker.start = timed_start

    def _wrap_masks(self, engine: LLMEngine) -> None:
        bias, apply = engine.masker._bias, grammar.PendingMasks.apply
        def timed_bias(matchers):
            t0 = time.perf_counter()
            out = bias(matchers)
            self.fill.append((time.perf_counter() - t0) * 1e3)
            return out
        def timed_apply(masks, logits):
            t0 = time.perf_counter()
            apply(masks, logits)
            self.engine_side.append(self._start_ms + (time.perf_counter() - t0) * 1e3)
        engine.masker._bias = timed_bias
        grammar.PendingMasks.apply = timed_apply


class Inline:
    """An executor that runs what it is given at once, on the calling thread."""

    def submit(self, fn, *args) -> Future:
        done = Future()
        done.set_result(fn(*args))
        return done


def run(model, streams: int, constrained: int, steps: int, serial: bool) -> dict:
    engine = LLMEngine(model, EngineConfig(dtype="float32", enable_prefix_caching=False))
    if serial:
        engine.masker._executor, engine.masker._worker = llguidance.LLExecutor(), Inline()
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    engine.grammars.matcher(fmt)
    first_compile_ms = (time.perf_counter() - t0) * 1e3  # includes the llguidance tokenizer (once per engine)
    t0 = time.perf_counter()
    engine.grammars.matcher(ResponseFormat("json_schema", json.dumps(SCHEMA | {"title": "other"})))
    compile_ms = (time.perf_counter() - t0) * 1e3
    tok = model.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]), add_special_tokens=False)
    for i in range(streams):
        params = SamplingParams(max_tokens=4 * steps, temperature=1.0, seed=i, ignore_eos=True,
                                response_format=fmt if i < constrained else None)
        engine.add_request(f"s{i}", prompt, params)
    while any(s.num_output_tokens == 0 for s in engine.seqs.values()):
        engine.step()
    timers = Timers(engine)
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        timers.step.append((time.perf_counter() - t0) * 1e3)
    return {"streams": streams, "constrained": constrained, "serial": serial, "steps": steps,
            "first_compile_ms": first_compile_ms, "compile_ms": compile_ms,
            "step_ms": _summary(timers.step), "forward_ms": _summary(timers.forward), "fill_ms": _summary(timers.fill),
            "engine_thread_grammar_ms": _summary(timers.engine_side),
            "constrained_per_step": _summary([float(k) for k in timers.constrained])}


def _summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50": statistics.median(xs), "p90": xs[int(0.9 * (len(xs) - 1))], "max": xs[-1]}


def _table(results: list[dict]) -> str:
    """Per configuration, the median over repeats of each run's p50 and p90, in ms."""
    rows = ["| constrained | masks | step p50 | forward p50 | worker fill p50 / p90 | engine thread p50 / p90 |",
            "|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["constrained"], r["serial"]) for r in results):
        runs = [r for r in results if (r["constrained"], r["serial"]) == key]
        step, fwd, fill, eng = (_median(runs, name) for name in ("step_ms", "forward_ms", "fill_ms",
                                                                 "engine_thread_grammar_ms"))
        mode = "-" if not key[0] else "engine thread" if key[1] else "overlapped"
        rows.append(f"| {key[0]}/{runs[0]['streams']} | {mode} | {step[0]:.1f} | {fwd[0]:.1f} | "
                    f"{fill[0]:.2f} / {fill[1]:.2f} | {eng[0]:.2f} / {eng[1]:.2f} |")
    return "\n".join(rows)


def _median(runs: list[dict], name: str) -> tuple[float, float]:
    return statistics.median(r[name]["p50"] for r in runs), statistics.median(r[name]["p90"] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--constrained", default="0,4,16")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serial", action="store_true", help="also fill the masks on the engine thread")
    parser.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(progress=False)
    configs = [(int(k), False) for k in args.constrained.split(",")]
    configs += [(k, True) for k, _ in configs if k and args.serial]
    results = [run(model, args.streams, k, args.steps, serial) for _ in range(args.repeats) for k, serial in configs]
    report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.processor()
              or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
              "llguidance": llguidance.__version__, "loadavg_1m_after": os.getloadavg()[0], "results": results}
    print(_table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
