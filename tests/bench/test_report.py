"""Report files, the sweep's search for the capacity, and compare."""
import json

import pytest

from inferd.bench import sweep as sweep_module
from inferd.bench.arrivals import LoadShape
from inferd.bench.cli import run_bench
from inferd.bench.client import Endpoint, RequestRecord
from inferd.bench.report import PlotInput, run_report, sample_rows, sweep_report, write_report
from inferd.bench.runner import RunConfig, RunResult
from inferd.bench.stats import parse_slo
from inferd.bench.sweep import SweepConfig, sweep

TARGET = {"id": "m", "source_path": None, "max_model_len": 512, "digests": {"weights": "ab" * 32}}
LAG = {"probes": 10, "mean_ms": 1.0, "p99_ms": 2.0, "max_ms": 3.0, "bound_ms": 50.0}


def fake_run(rate: float, n: int = 10) -> RunResult:
    """Latency that grows with the rate: ttft = 100 ms × rate."""
    ttft_s = 0.1 * rate
    records = [RequestRecord(i, i / rate, 20, sent_s=i / rate, outcome="completed",
                             chunk_s=[ttft_s, ttft_s + 0.05, ttft_s + 0.1], done_s=ttft_s + 0.1, output_tokens=3,
                             finish_reason="length") for i in range(n)]
    records[-1].outcome, records[-1].error_type = "failed", "internal_error"
    return RunResult(records, n / rate, LAG, None, rate)


def test_run_report_files(tmp_path):
    run = fake_run(2.0)
    report = run_report(run, TARGET, {"base_url": "http://x", "api": "chat"}, parse_slo("ttft_ms=500"), 3.6)
    paths = write_report(report, sample_rows(run.records, 2.0), tmp_path / "r", PlotInput(run.records, []))
    assert [p.name for p in paths] == ["r.json", "r.samples.jsonl", "r.md", "r.html"]
    saved = json.loads(paths[0].read_text())
    assert saved["samples_file"] == "r.samples.jsonl" and saved["summary"]["counts"]["failed"] == 1
    assert saved["summary"]["goodput"]["met_slo"] == 9 and "ttft_ms" in saved["definitions"]
    rows = [json.loads(line) for line in paths[1].read_text().splitlines()]
    assert len(rows) == 10 and rows[0]["chunk_s"] == pytest.approx([0.2, 0.25, 0.3])
    md = paths[2].read_text()
    assert "| TTFT | 9 | 200.0 |" in md and "1 failed {'internal_error': 1}" in md
    assert paths[3].read_text().count("data:image/png;base64,") == 4


def test_the_report_always_states_cost_per_accepted_result(tmp_path):
    """In USD with the machine's price (--usd-per-hour), else in seconds of the machine, naming the flag."""
    from inferd.bench.cli import add_bench_parser
    parser = __import__("argparse").ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["bench", "run", "--usd-per-hour", "3.6"]).usd_per_hour == 3.6
    assert parser.parse_args(["bench", "run", "--cost-per-hour", "2"]).usd_per_hour == 2.0  # its older name

    def line(usd_per_hour):
        report = run_report(fake_run(2.0), TARGET, {}, parse_slo("ttft_ms=500"), usd_per_hour)
        md = write_report(report, [], tmp_path / "r", None)[2].read_text()
        return next(x for x in md.splitlines() if x.startswith("- goodput:")).split("cost per accepted result: ")[1]
    # 9 of 10 requests accepted over 5 s
    assert line(3.6) == "0.000556 USD (0.556 s of the serving machine at 3.6 USD/h)"
    assert line(None) == ("0.556 s of the serving machine (no USD price: pass --usd-per-hour, the machine's "
                          "hardware price per hour)")


def test_sweep_ramps_then_bisects(monkeypatch, tmp_path):
    tried = []

    async def fake_run_load(client, config, requests):
        tried.append(config.load.rate_per_s)
        return fake_run(config.load.rate_per_s)
    monkeypatch.setattr(sweep_module, "run_load", fake_run_load)
    base = RunConfig(Endpoint("http://x", "m"), LoadShape("poisson", 1.0))
    config = SweepConfig(parse_slo("ttft_ms=500", 95), start_rate_per_s=1.0, rate_factor=2.0, bisect_steps=2,
                         max_failure_ratio=0.2)
    result = __import__("asyncio").run(sweep(None, base, config, lambda run, step: []))
    assert tried == [1.0, 2.0, 4.0, 8.0, 6.0, 5.0]  # ttft 100 × rate ms holds up to 5 req/s
    assert result.capacity_rate_per_s == 5.0 and [p.rate_per_s for p in result.points] == sorted(tried)
    report = sweep_report(result, config, TARGET, {"base_url": "http://x"}, None)
    paths = write_report(report, [], tmp_path / "s", PlotInput(result.points[0].result.records, []))
    assert "**Capacity: 5.000 req/s**" in paths[2].read_text()
    assert paths[3].read_text().count("data:image/png;base64,") == 5

    def compare(a, b):
        import argparse
        return run_bench(argparse.Namespace(bench_command="compare", a=a, b=b))
    run_path = tmp_path / "run"
    write_report(run_report(fake_run(2.0), TARGET, {}, parse_slo(None), None), [], run_path, None)
    assert compare(paths[0], paths[0]) == 0 and compare(run_path.with_suffix(".json"), paths[0]) == 0
    assert compare(tmp_path / "missing.json", paths[0]) == 2


def test_compare_ratios(capsys, tmp_path):
    from inferd.bench.compare import compare_table
    a = run_report(fake_run(1.0), TARGET, {}, parse_slo(None), None)
    b = run_report(fake_run(2.0), TARGET, {}, parse_slo(None), None)
    rows = {k: ratio for k, _, _, ratio in compare_table(a, b)}
    assert rows["summary.latency.ttft_ms.p50"] == pytest.approx(2.0)
    assert rows["summary.counts.sent"] == 1.0 and "summary.counts.finish_reasons.length" not in rows


def test_sweep_stops_at_a_lagging_step(monkeypatch):
    async def fake_run_load(client, config, requests):
        run = fake_run(config.load.rate_per_s)
        if config.load.rate_per_s >= 4:
            run.client_lag = LAG | {"p99_ms": 120.0}
        return run
    monkeypatch.setattr(sweep_module, "run_load", fake_run_load)
    base = RunConfig(Endpoint("http://x", "m"), LoadShape("poisson", 1.0))
    config = SweepConfig(parse_slo("ttft_ms=500"), rates_per_s=[1.0, 2.0, 4.0, 8.0], max_failure_ratio=0.2)
    result = __import__("asyncio").run(sweep(None, base, config, lambda run, step: []))
    assert [(p.rate_per_s, p.holds, bool(p.refused)) for p in result.points] == [(1, True, False), (2, True, False),
                                                                               (4, False, True)]
    assert result.capacity_rate_per_s == 2.0
    assert result.verdict().startswith("capacity: at least 2 req/s, not bracketed")
