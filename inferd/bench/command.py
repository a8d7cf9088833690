import argparse
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from inferd.bench.arrivals import LoadShape, arrival_offsets_within_s
from inferd.bench.client import Endpoint
from inferd.bench.errors import BenchError, WorkloadError
from inferd.bench.lag import check_lag
from inferd.bench.report import PlotInput, run_report, sample_rows, sweep_report, write_report
from inferd.bench.runner import RunConfig, http_client, run_load, warm_up
from inferd.bench.stats import SLO, parse_slo
from inferd.bench.sweep import SweepConfig, sweep
from inferd.bench.target import ModelCard, model_card
from inferd.bench.tokenizer import PromptCounter, served_tokenizer, word_pool
from inferd.bench.workloads import BenchRequest, WorkloadConfig, build_requests, quality_requests

DEFAULT_NUM_REQUESTS = 100
UNBOUNDED = 10**9


@dataclass(slots=True)
class Workload:
    """Everything needed to make requests for a run: config, length counter and word pool."""
    config: WorkloadConfig
    counter: PromptCounter
    pool: list[str]
    num_requests: int | None
    quality_set: Path | None = None  # the items of this eval set are the requests
    quality_split: str = "acceptance"

    def requests_for(self, run: RunConfig, step: int = 0) -> list[BenchRequest]:
        if self.quality_set is not None:
            return quality_requests(self.quality_set, self.quality_split, self.counter, self.num_requests)
        count = planned_count(run, self.num_requests, self.config)
        return build_requests(replace(self.config, seed=self.config.seed + step), self.counter, self.pool, count)


def planned_count(run: RunConfig, num_requests: int | None, workload: WorkloadConfig) -> int:
    if run.load.open_loop and run.duration_s is not None and workload.kind != "trace":
        return len(arrival_offsets_within_s(run.load, run.duration_s, run.seed))
    if num_requests is not None:
        return num_requests
    return UNBOUNDED if workload.kind != "synthetic" else DEFAULT_NUM_REQUESTS


# setup from arguments

def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(args.workload, args.input_tokens, args.output_tokens, args.num_documents,
                          args.document_tokens, args.questions_per_document, args.question_tokens, args.trace,
                          args.cancel_fraction, args.seed)


def run_config(args: argparse.Namespace, card: ModelCard) -> RunConfig:
    endpoint = Endpoint(args.base_url, card.id, args.api, args.api_key, args.request_timeout_s, args.extra_body)
    load = LoadShape(args.arrival, args.rate, args.burstiness, args.concurrency)
    return RunConfig(endpoint, load, args.duration_s, args.warmup_requests, args.max_client_lag_ms,
                     args.metrics_url, args.metrics_poll_s, not args.no_progress, args.seed)


def workload(args: argparse.Namespace, card: ModelCard) -> Workload:
    tokenizer = served_tokenizer(args.tokenizer, card.source_path, card.digests.get("tokenizer"))
    config = workload_config(args)
    if args.num_requests is not None and args.num_requests < 1:
        raise BenchError(f"--num-requests must be at least 1 (got {args.num_requests})")
    if card.max_model_len and config.kind == "synthetic" and \
            config.input_tokens + config.output_tokens > card.max_model_len:
        raise WorkloadError(f"{config.input_tokens} input + {config.output_tokens} output tokens exceed the "
                            f"server's max_model_len of {card.max_model_len}")
    if args.quality_set is not None and (args.api != "chat" or args.bench_command != "run"):
        raise BenchError("--quality-set sends chat messages: use it with bench run and --api chat")
    return Workload(config, PromptCounter(tokenizer, args.api), word_pool(tokenizer), args.num_requests,
                    args.quality_set, args.quality_split)


def settings(args: argparse.Namespace) -> dict:
    skip = {"command", "bench_command", "api_key", "no_progress", "no_html", "log_level"}
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip}


# commands

async def bench_command(args: argparse.Namespace) -> int:
    slo = parse_slo(args.slo, args.slo_percentile)
    async with http_client() as client:
        card = await model_card(client, args.base_url, args.api_key, args.model)
        load = workload(args, card)
        base = run_config(args, card)
        await warm_up(client, base)
        if args.bench_command == "sweep":
            return await _sweep(client, args, card, load, base, slo)
        return await _run(client, args, card, load, base, slo)


async def _run(client: httpx.AsyncClient, args: argparse.Namespace, card: ModelCard, load: Workload,
               base: RunConfig, slo: SLO) -> int:
    requests = load.requests_for(base)
    result = await run_load(client, base, requests)
    check_replies(result.records, requests)
    check_lag(result.client_lag, base.max_client_lag_ms)
    report = run_report(result, card.as_dict(), settings(args), slo, args.usd_per_hour)
    plot = None if args.no_html else PlotInput(result.records, (result.server or {}).get("gauges", []))
    _written(write_report(report, sample_rows(result.records, result.offered_rate_per_s), args.out, plot))
    return 0


async def _sweep(client: httpx.AsyncClient, args: argparse.Namespace, card: ModelCard, load: Workload,
                 base: RunConfig, slo: SLO) -> int:
    if not base.load.open_loop:
        raise BenchError("a sweep raises the arrival rate: use an open-loop --arrival (poisson, gamma, constant)")
    config = SweepConfig(slo, args.rates, args.start_rate, args.rate_factor, args.max_steps, args.bisect_steps,
                         args.max_failure_ratio)
    result = await sweep(client, base, config, load.requests_for)
    report = sweep_report(result, config, card.as_dict(), settings(args), args.usd_per_hour)
    chosen = [p for p in result.points if p.rate_per_s == result.capacity_rate_per_s] or result.points[:1]
    plot = None if args.no_html else PlotInput(chosen[0].result.records,
                                                (chosen[0].result.server or {}).get("gauges", []))
    samples = [row for p in result.points for row in sample_rows(p.result.records, p.rate_per_s)]
    _written(write_report(report, samples, args.out, plot))
    print(result.verdict())
    return 0


def check_replies(records: list, requests: list[BenchRequest]) -> None:
    """A quality item's record: passed_check from its streamed reply (a request that did not complete fails)."""
    by_index = {r.index: r for r in requests}
    for record in records:
        check = by_index[record.index].check
        if check is not None:
            record.passed_check = record.outcome == "completed" and check("".join(record.reply))


def _written(paths: list[Path]) -> None:
    print(paths[2].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
