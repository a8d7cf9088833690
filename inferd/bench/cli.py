import argparse
import os
from pathlib import Path

EXIT_USAGE, EXIT_CLIENT_LAG = 2, 3
LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


# parser

def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """`inferd bench run|sweep|compare`."""
    bench = commands.add_parser("bench", help="load-test an OpenAI-compatible endpoint and report against SLOs")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    shared = _load_options()
    kinds.add_parser("run", parents=[shared], help="one measured load; JSON, JSONL, Markdown and HTML report")
    sweep = kinds.add_parser("sweep", parents=[shared], help="raise the rate until the SLO breaks: the capacity")
    sweep.add_argument("--rates", type=_floats, default=[], help="explicit rates in req/s, e.g. 0.5,1,2")
    sweep.add_argument("--start-rate", type=float, default=0.5, help="first rate in req/s (default 0.5)")
    sweep.add_argument("--rate-factor", type=float, default=2.0, help="next rate = rate × factor (default 2)")
    sweep.add_argument("--max-steps", type=int, default=8)
    sweep.add_argument("--bisect-steps", type=int, default=2, help="bisections between the last held rate "
                       "and the first broken one (default 2)")
    sweep.add_argument("--max-failure-ratio", type=float, default=0.01,
                       help="rejected+failed+timed out over attempted requests a holding rate may have")
    compare = kinds.add_parser("compare", help="side-by-side ratios of two bench reports (B/A)")
    compare.add_argument("a", type=Path)
    compare.add_argument("b", type=Path)
    compare.add_argument("--log-level", choices=LOG_LEVELS, default="warning")


def _load_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root or its /v1")
    target.add_argument("--api-key", default=os.environ.get("INFERD_API_KEY"), help="default: $INFERD_API_KEY")
    target.add_argument("--model", default=None, help="model id (default: the first one /v1/models lists)")
    target.add_argument("--api", choices=["chat", "completions"], default="chat")
    target.add_argument("--tokenizer", default=None, help="a .gguf file or Hugging Face directory "
                        "(default: source_path from a replica's /v1/models, when it is on this machine, else the packaged "
                        "SmolLM2 when its tokenizer digest is the served model's)")
    target.add_argument("--metrics-url", default=None, help="Prometheus endpoint (default: BASE/metrics)")
    target.add_argument("--extra-body", type=_json_object, default={}, help="JSON merged into every request body")
    _workload_options(p.add_argument_group("workload"))
    _arrival_options(p.add_argument_group("arrivals"))
    _report_options(p.add_argument_group("measures and report"))
    return p


def _workload_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--workload", choices=["synthetic", "shared-prefix", "trace"], default="synthetic")
    g.add_argument("--input-tokens", type=int, default=256, help="prompt tokens as the server counts them")
    g.add_argument("--output-tokens", type=int, default=64, help="max_tokens, with ignore_eos")
    g.add_argument("--num-documents", type=int, default=4, help="shared-prefix: K documents")
    g.add_argument("--document-tokens", type=int, default=512, help="shared-prefix: L tokens each")
    g.add_argument("--questions-per-document", type=int, default=4, help="shared-prefix: M questions each")
    g.add_argument("--question-tokens", type=int, default=16)
    g.add_argument("--trace", type=Path, default=None, help="JSONL: arrival_offset_s, input_tokens|text, "
                   "output_tokens")
    g.add_argument("--quality-set", type=Path, default=None, help="an eval set folder (e.g. evals/docqa-v1): its "
                   "items are the requests (greedy, each once unless --num-requests); a result is accepted only "
                   "when it met the SLO and passed the item's check")
    g.add_argument("--quality-split", choices=["tuning", "acceptance"], default="acceptance")
    g.add_argument("--cancel-fraction", type=float, default=0.0, help="share of requests that close their "
                   "stream after half their output")


def _arrival_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--arrival", choices=["poisson", "gamma", "constant", "closed"], default="poisson")
    g.add_argument("--rate", type=float, default=1.0, help="open loop: requests/s")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson, < 1 burstier")
    g.add_argument("--concurrency", type=int, default=1, help="closed loop: requests in flight")
    g.add_argument("--num-requests", type=int, default=None, help="default 100 (trace: all, shared-prefix: K×M)")
    g.add_argument("--duration-s", type=float, default=None, help="open loop: arrivals within; "
                   "closed loop: stop sending after")
    g.add_argument("--warmup-requests", type=int, default=1, help="sent before measuring, excluded")
    g.add_argument("--request-timeout-s", type=float, default=300.0)
    g.add_argument("--seed", type=int, default=0)


def _report_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--slo", default=None, help="e.g. ttft_ms=500,tpot_ms=50,e2e_ms=5000")
    g.add_argument("--slo-percentile", type=float, default=95.0, help="sweep: percentile the SLO is held at")
    g.add_argument("--usd-per-hour", "--cost-per-hour", dest="usd_per_hour", type=float, default=None,
                   help="the serving machine's hardware price, USD per hour: cost per accepted result in USD "
                   "(without it, in seconds of the machine)")
    g.add_argument("--max-client-lag-ms", type=float, default=50.0,
                   help="refuse the run when the client's event-loop lag p99 is above this")
    g.add_argument("--metrics-poll-s", type=float, default=1.0, help="gauge polling interval")
    g.add_argument("--out", type=Path, default=Path("bench"), help="prefix: OUT.json, OUT.samples.jsonl, "
                   "OUT.md, OUT.html")
    g.add_argument("--no-html", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="warning")


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from exc


def _json_object(text: str) -> dict:
    import json
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


# commands

def run_bench(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from inferd.bench.errors import BenchError, ClientLagExceeded
    try:
        if args.bench_command == "compare":
            return _compare(args)
        from inferd.bench.command import bench_command
        return asyncio.run(bench_command(args))
    except ClientLagExceeded as exc:
        print(f"inferd bench: refused: {exc}", file=sys.stderr)
        return EXIT_CLIENT_LAG
    except BenchError as exc:
        print(f"inferd bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _compare(args: argparse.Namespace) -> int:
    from inferd.bench.compare import compare_table, format_table, load
    print(format_table(compare_table(load(args.a), load(args.b)), str(args.a), str(args.b)))
    return 0
