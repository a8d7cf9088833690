"""What a user who benchmarks the usual way sees: standard load generators against `inferd serve` and vLLM CPU, in
turn, on the same machine, the load generator's processes on the same cores.

Each sends requests at a constant rate (--rates, requests/s) for --seconds, prompts of --prompt-tokens asking for
exactly --output-tokens (ignore_eos), counted with the model's own tokenizer (inferd's Hugging Face export of the
packaged SmolLM2; no hub). Each has a venv of its own (--generators picks them); guidellm and aiperf pull torch,
so install its CPU build in the same pip command (`torch==2.13.0`, as the Makefile does) or pip takes a CUDA one:
  guidellm        `python3.11 -m venv ../venv-lg && ../venv-lg/bin/pip install torch==2.13.0 guidellm==0.8.1`;
                  chat completions, streamed; the prompts are a file written before the timed part (--data file,
                  the default): its synthetic prompts (--data synthetic) are made while it sends, and its data worker
                  then kept a core busy beside the servers
  aiperf          `python3.11 -m venv ../venv-aiperf && ../venv-aiperf/bin/pip install torch==2.13.0 aiperf==0.13.0`;
                  chat completions, streamed; its synthetic prompts (made before it sends), a seed per run
  inference-perf  `python3.12 -m venv ../venv-ip && ../venv-ip/bin/pip install inference-perf==0.7.0` (it needs
                  Python 3.12); completions (its random prompts are for that API only), streamed, a seed per run
Each target serves the same weights with the same limits (served_decode.py's SETTINGS): `inferd serve` with its
default deployment (threads follow the free cores), and vLLM CPU started as inferd's vLLM runtime starts it. Rounds
take turns, each starting with the next target; medians over the rounds of each generator's own TTFT and ITL
percentiles.

    PYTHONPATH=. .venv/bin/python benchmarks/load_generators.py --generators guidellm,aiperf,inference-perf \\
        --out benchmarks/results/load-generators.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import httpx
import torch

from benchmarks.machine import cpu_name, loadavg
from benchmarks.served_decode import KEY, SETTINGS, deployment_name, quiet, start_serve
from inferd.control.runtimes import RuntimeProcess
from inferd.control.runtimes import EngineChoice
from inferd.engine.config import EngineConfig
from inferd.models.export import exported_dir
from inferd.models.loader import default_model_path

FORMAT = "auto:none"  # inferd serve's default deployment


WORDS = "apple river stone cloud maple violet copper meadow lantern harbor".split()


def prompt_file(work: Path, tokenizer_dir: Path, count: int, prompt_tokens: int, output_tokens: int, run: str) -> Path:
    """`count` prompts of exactly `prompt_tokens` tokens (the model's tokenizer), each asking for `output_tokens`, as
    JSON lines in guidellm's columns; each starts with `run` and its number, so that no run finds another's in a
    prefix cache."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    path = work / f"prompts-{run}.jsonl"
    with path.open("w") as f:
        for i in range(count):
            words = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(prompt_tokens * 2))
            ids = tok(f"{run} {i}: {words}", add_special_tokens=False)["input_ids"][:prompt_tokens]
            f.write(json.dumps({"prompt": tok.decode(ids), "prompt_tokens_count": prompt_tokens,
                                "output_tokens_count": output_tokens}) + "\n")
    return path


def guidellm(binary: str, url: str, key: str, model: str, tokenizer: Path, rate: float, seconds: float,
             prompt_tokens: int, output_tokens: int, work: Path, prompts: Path | None) -> dict:
    """One guidellm run at a constant rate; its TTFT and ITL percentiles (ms), requests completed and errored.
    prompts: a file of them (prompt_file), else guidellm's synthetic ones."""
    out = work / f"guidellm-{model}-{rate:g}.json"
    data = {"kind": "json_file", "path": str(prompts)} if prompts else \
        {"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": model, "api_key": key,
                    "request_format": "/v1/chat/completions"},
        "profile": {"kind": "constant", "rate": [rate]},
        "constraints": [{"kind": "max_duration", "seconds": seconds}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "data": [data],
        "outputs": [{"kind": "json", "path": str(out)}]}}
    (work / "scenario.json").write_text(json.dumps(scenario))
    run = subprocess.run([binary, "run", "--scenario", str(work / "scenario.json"), "--disable-console-interactive"],
                         capture_output=True, text=True, timeout=seconds + 600)
    if run.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm failed ({run.returncode}): {run.stderr[-2000:]}")
    return summary(json.loads(out.read_text()))


def summary(report: dict) -> dict:
    """TTFT and ITL p50/p95/p99 (ms) of the successful requests, and the counts, from guidellm's JSON report."""
    (bench,) = report["benchmarks"]
    metrics = bench["metrics"]

    def pcts(name: str) -> dict:
        d = metrics[name]["successful"]["percentiles"]
        return {p: round(d[p], 1) for p in ("p50", "p95", "p99")}
    totals = bench["scheduler_metrics"]["requests_made"] if "scheduler_metrics" in bench else {}
    return {"ttft_ms": pcts("time_to_first_token_ms"), "itl_ms": pcts("inter_token_latency_ms"),
            "requests": {k: totals.get(k) for k in ("successful", "errored", "incomplete")}}


def aiperf(binary: str, url: str, key: str, model: str, tokenizer: Path, rate: float, seconds: float,
           prompt_tokens: int, output_tokens: int, work: Path, seed: int) -> dict:
    """One aiperf run at a constant rate on its synthetic prompts (seed: this run's); the same summary as guidellm's."""
    out = work / f"aiperf-{seed}"
    run = subprocess.run([binary, "profile", "-m", model, "--url", url, "--endpoint-type", "chat", "--streaming",
                          "--api-key", key, "--tokenizer", str(tokenizer),
                          "--synthetic-input-tokens-mean", str(prompt_tokens), "--synthetic-input-tokens-stddev", "0",
                          "--output-tokens-mean", str(output_tokens), "--output-tokens-stddev", "0",
                          "--extra-inputs", "ignore_eos:true", "--request-rate", f"{rate:g}",
                          "--request-rate-mode", "constant", "--benchmark-duration", f"{seconds:g}",
                          "--random-seed", str(seed), "--ui-type", "none", "--artifact-dir", str(out)],
                         capture_output=True, text=True, timeout=seconds + 600)
    report = out / "profile_export_aiperf.json"
    if run.returncode != 0 or not report.exists():
        raise RuntimeError(f"aiperf failed ({run.returncode}): {(run.stderr or run.stdout)[-2000:]}")
    r = json.loads(report.read_text())

    def pcts(name: str) -> dict:
        return {p: round(r[name][p], 1) for p in ("p50", "p95", "p99")}
    errors = sum(e.get("count", 0) for e in r.get("error_summary") or [])
    return {"ttft_ms": pcts("time_to_first_token"), "itl_ms": pcts("inter_token_latency"),
            "requests": {"successful": int(r["request_count"]["avg"]), "errored": errors, "incomplete": None}}


def inference_perf(binary: str, url: str, key: str, model: str, tokenizer: Path, rate: float, seconds: float,
                   prompt_tokens: int, output_tokens: int, work: Path, seed: int) -> dict:
    """One inference-perf run at a constant rate on its random prompts (seed: this run's), over /v1/completions (its
    random prompts are for that API only); the same summary as guidellm's."""
    out = work / f"inference-perf-{seed}"
    count = int(rate * seconds) + 16

    def fixed(n: int) -> dict:
        return {"min": n, "max": n, "mean": n, "std_dev": 0, "total_count": count}
    config = {"api": {"type": "completion", "streaming": True},
              "data": {"type": "random", "input_distribution": fixed(prompt_tokens),
                       "output_distribution": fixed(output_tokens)},
              "load": {"type": "constant", "stages": [{"rate": rate, "duration": int(seconds)}], "base_seed": seed},
              "server": {"type": "vllm", "model_name": model, "base_url": url, "ignore_eos": True, "api_key": key},
              "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
              "report": {"request_lifecycle": {"summary": True, "per_stage": False}},
              "storage": {"local_storage": {"path": str(out)}}}
    (work / "inference-perf.json").write_text(json.dumps(config))  # YAML is a superset of JSON
    run = subprocess.run([binary, "-c", str(work / "inference-perf.json")], capture_output=True, text=True,
                         timeout=seconds + 600)
    report = out / "summary_lifecycle_metrics.json"
    if run.returncode != 0 or not report.exists():
        raise RuntimeError(f"inference-perf failed ({run.returncode}): {(run.stderr or run.stdout)[-2000:]}")
    r = json.loads(report.read_text())
    latency = r["successes"]["latency"]

    def pcts(name: str) -> dict:  # seconds in its report
        return {p: round(latency[name]["median" if p == "p50" else p] * 1000, 1) for p in ("p50", "p95", "p99")}
    return {"ttft_ms": pcts("time_to_first_token"), "itl_ms": pcts("inter_token_latency"),
            "requests": {"successful": r["successes"]["count"], "errored": r.get("failures", {}).get("count", 0),
                         "incomplete": None}}


GENERATORS = ("guidellm", "aiperf", "inference-perf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generators", default="guidellm", help=f"some of {','.join(GENERATORS)}")
    ap.add_argument("--guidellm", default="../venv-lg/bin/guidellm")
    ap.add_argument("--aiperf", default="../venv-aiperf/bin/aiperf")
    ap.add_argument("--inference-perf", default="../venv-ip/bin/inference-perf")
    ap.add_argument("--vllm-python", default=os.environ.get("INFERD_VLLM_PYTHON") or ".venv-vllm/bin/python")
    ap.add_argument("--rates", default="1,2")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--data", choices=("file", "synthetic"), default="file", help="guidellm's prompts")
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    generators = args.generators.split(",")
    if unknown := set(generators) - set(GENERATORS):
        raise SystemExit(f"unknown generators: {', '.join(sorted(unknown))}")
    work = Path(tempfile.mkdtemp(prefix="load-generators-"))
    tokenizer = exported_dir(default_model_path())
    stops: list = []
    try:
        serve, url = start_serve(work, [FORMAT])
        stops.append(serve.terminate)
        targets = {"inferd": (url, KEY, deployment_name(FORMAT))}
        vllm = RuntimeProcess(None, "smol-vllm", EngineConfig(**SETTINGS), EngineChoice("vllm", args.vllm_python, []))
        vllm.start()
        stops.append(vllm.stop)
        vllm.wait_ready(1800)
        targets["vllm"] = (vllm.url, vllm.api_key, "smol-vllm")
        for url_, key, model in targets.values():  # the first request of a shape pays its warm-up
            httpx.post(f"{url_}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=300,
                       json={"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi " * 250}]})
        runs = {g: {name: {f"{r:g}": [] for r in rates} for name in targets} for g in generators}
        names = list(targets)
        seed = 0
        for i in range(args.rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                for g in generators:
                    for rate in rates:
                        seed += 1  # a run of its own prompts: none finds another's in a prefix cache
                        quiet()
                        if g == "guidellm":
                            prompts = prompt_file(work, tokenizer, int(rate * args.seconds) + 16, args.prompt_tokens,
                                                  args.output_tokens, f"{seed}-{name}") if args.data == "file" else None
                            got = guidellm(args.guidellm, *targets[name], tokenizer, rate, args.seconds,
                                           args.prompt_tokens, args.output_tokens, work, prompts)
                        else:
                            run = aiperf if g == "aiperf" else inference_perf
                            got = run(getattr(args, g.replace("-", "_")), *targets[name], tokenizer, rate,
                                      args.seconds, args.prompt_tokens, args.output_tokens, work, seed)
                        runs[g][name][f"{rate:g}"].append(got)
                        print(f"round {i} {g} {name} {rate:g}/s: {json.dumps(got)}", file=sys.stderr, flush=True)
    finally:
        for stop in reversed(stops):
            stop()
    medians = {g: {name: {rate: {m: {p: statistics.median(x[m][p] for x in got) for p in ("p50", "p95", "p99")}
                                 for m in ("ttft_ms", "itl_ms")} for rate, got in by.items()}
                   for name, by in per.items()} for g, per in runs.items()}

    def ratio(g: str, rate: str, m: str, p: str) -> float | None:  # None where a target completed no request
        a, b = medians[g]["inferd"][rate][m][p], medians[g]["vllm"][rate][m][p]
        return round(a / b, 2) if a and b else None
    ratios = {g: {rate: {f"{m}_{p}": ratio(g, rate, m, p) for m in ("ttft_ms", "itl_ms") for p in ("p50", "p95")}
                  for rate in medians[g]["inferd"]} for g in generators}
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                          "load_average_after": loadavg(), "shared": args.note or "nothing else running"},
              "settings": SETTINGS | {k: v for k, v in vars(args).items()
                                      if k not in ("out", "guidellm", "aiperf", "inference_perf", "vllm_python")},
              "runs": runs, "medians": medians, "inferd_over_vllm": ratios}
    text = markdown(result)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        Path(args.out.removesuffix(".json") + ".md").write_text(text)


def markdown(r: dict) -> str:
    s, m = r["settings"], r["machine"]
    lines = [f"# Load generators against inferd serve and vLLM CPU ({r['date']})", "",
             f"{m['cpu']}, {m['cores']} cores; {s['prompt_tokens']} in / {s['output_tokens']} out, constant rate, "
             f"{s['seconds']:g} s a run, {s['rounds']} rounds, medians; {m['shared']}.", "",
             "| generator | rate req/s | target | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | requests done |",
             "|---|---|---|---|---|---|---|---|"]
    for g, per in r["medians"].items():
        for rate in per["inferd"]:
            for name, by in per.items():
                t, i = by[rate]["ttft_ms"], by[rate]["itl_ms"]
                done = statistics.median(x["requests"]["successful"] or 0 for x in r["runs"][g][name][rate])
                lines.append(f"| {g} | {rate} | {name} | {t['p50']:.0f} | {t['p95']:.0f} | {i['p50']:.1f} | "
                             f"{i['p95']:.1f} | {done:g} |")
            x = {k: "-" if v is None else f"{v:.2f}x" for k, v in r["inferd_over_vllm"][g][rate].items()}
            lines.append(f"| {g} | {rate} | inferd / vLLM | {x['ttft_ms_p50']} | {x['ttft_ms_p95']} | "
                         f"{x['itl_ms_p50']} | {x['itl_ms_p95']} | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
