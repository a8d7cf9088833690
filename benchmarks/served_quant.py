"""Served single-stream decode per weight format: `inferd replica` against the same engine in process, one run.

For each --formats entry (dtype:quantization) in turn: an `inferd replica` of the packaged SmolLM2 with
those settings, and `inferd bench run` streaming completions to it from this machine (closed loop, one
request at a time: B=1, --input-tokens in, --output-tokens out, ignore_eos), so tok/s = 1000 / median
TPOT; then the same engine in this process (benchmarks/engine.py's decode loop, B=1). The bench client,
the replica's HTTP loop and the engine share the machine's cores.

    PYTHONPATH=. python benchmarks/served_quant.py --formats auto:none,auto:int4 \\
        --out benchmarks/results/served-quant-zen4-avx512bf16.json
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.engine import PROMPT_LEN, inferd_decode
from benchmarks.machine import cpu_name, loadavg
from inferd.control.replicas import free_port, wait_until_ready
from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.models.loader import load_model

KEY = "sk-served-quant-bench"


def served_tok_s(dtype: str, quantization: str, args, work: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / f"replica-{dtype}-{quantization}.log", "w")
    replica = subprocess.Popen([sys.executable, "-m", "inferd.cli", "replica", "--port", str(port), "--api-key", KEY,
                                "--dtype", dtype, "--quantization", quantization, "--served-model-name", "chat",
                                *shlex.split(args.replica_args)],
                               stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        wait_until_ready(url, lambda: replica.poll() is None, lambda: f"exited with {replica.returncode}", 600)
        runs = []
        for i in range(args.repeats):
            out = work / f"bench-{dtype}-{quantization}-{i}"
            subprocess.run([sys.executable, "-m", "inferd.cli", "bench", "run", "--base-url", url, "--api-key", KEY,
                            "--api", "completions", "--arrival", "closed", "--concurrency", str(args.concurrency),
                            "--num-requests", str(args.requests * args.concurrency), "--warmup-requests", "1",
                            "--input-tokens", str(args.input_tokens), "--output-tokens", str(args.output_tokens),
                            "--no-html", "--no-progress", "--out", str(out)], check=True, capture_output=True)
            report = json.loads(out.with_name(out.name + ".json").read_text())
            runs.append(args.concurrency * 1000 / report["summary"]["latency"]["tpot_ms"]["p50"])
        return {"median_tok_s": round(statistics.median(runs), 1), "runs_tok_s": [round(r, 1) for r in runs]}
    finally:
        replica.terminate()
        replica.wait(timeout=60)


def in_process_tok_s(model, dtype: str, quantization: str, repeats: int, batch: int) -> dict:
    engine = LLMEngine(model, EngineConfig(dtype=dtype, quantization=quantization, enable_prefix_caching=False,
                                           small_step_threads=torch.get_num_threads(),  # the engine at its best
                                           max_num_batched_tokens=max(512, batch * PROMPT_LEN)))  # as engine.py
    inferd_decode(engine, batch)  # warm-up, as the replica's readiness inference and warm-up request are
    runs = [inferd_decode(engine, batch) for _ in range(repeats)]
    return {"median_tok_s": round(statistics.median(runs), 1), "runs_tok_s": [round(r, 1) for r in runs],
            "dtype": str(engine.dtype).removeprefix("torch."), "quantization": engine.quantization}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="auto:none,auto:int4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4, help="measured requests per stream and served repeat")
    ap.add_argument("--input-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--replica-args", default="",
                    help='more options for the replica (e.g. "--num-threads 1"); the in-process engine keeps its defaults')
    ap.add_argument("--concurrency", type=int, default=1, help="streams at once (B); tok/s = B x 1000 / p50 TPOT")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = load_model(None, progress=False)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": model.name,
              "machine": {"cpu": cpu_name(), "cores": torch.get_num_threads(), "torch": torch.__version__,
                          "load_average_before": loadavg(), "shared": "other work ran on the same cores"},
              "workload": {"input_tokens": args.input_tokens, "output_tokens": args.output_tokens, "batch": args.concurrency,
                           "replica_args": args.replica_args},
              "formats": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.formats.split(","):
            dtype, _, quantization = spec.partition(":")
            row = {"served_replica": served_tok_s(dtype, quantization, args, Path(tmp)),
                   "in_process": in_process_tok_s(model, dtype, quantization, args.repeats, args.concurrency)}
            row["served_share"] = round(row["served_replica"]["median_tok_s"] / row["in_process"]["median_tok_s"], 3)
            result["formats"][spec] = row
            print(spec, json.dumps(row), file=sys.stderr, flush=True)
    result["machine"]["load_average_after"] = loadavg()
    b = args.concurrency
    lines = [f"| format (asked) | runs as | in process B={b} tok/s | `inferd replica` B={b} tok/s | served / in process |",
             "|---|---|---|---|---|"]
    for spec, row in result["formats"].items():
        ours = row["in_process"]
        lines.append(f"| {spec} | {ours['dtype']} {ours['quantization']} | {ours['median_tok_s']} | "
                     f"{row['served_replica']['median_tok_s']} | {row['served_share']:.2f} |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        Path(args.out.removesuffix(".json") + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
