import json
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from inferd.bench.client import RequestRecord
from inferd.bench.runner import RunResult
from inferd.bench.stats import DEFINITIONS, SLO, summarize
from inferd.bench.sweep import SweepConfig, SweepResult

FORMAT_VERSION = 1


@dataclass(slots=True)
class PlotInput:
    """The run whose timelines and distributions are drawn (for a sweep: the one at capacity)."""
    records: list[RequestRecord]
    gauges: list[list]


# JSON documents

def run_section(run: RunResult, slo: SLO, usd_per_hour: float | None) -> dict:
    return {"offered_rate_per_s": run.offered_rate_per_s,
            "summary": summarize(run.records, run.duration_s, slo, usd_per_hour),
            "server": run.server, "client_lag": run.client_lag}


def header(kind: str, target: dict, settings: dict, slo: SLO) -> dict:
    return {"kind": kind, "format_version": FORMAT_VERSION,
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "target": target, "settings": settings, "slo": asdict(slo), "definitions": DEFINITIONS}


def run_report(run: RunResult, target: dict, settings: dict, slo: SLO, usd_per_hour: float | None) -> dict:
    return header("run", target, settings, slo) | run_section(run, slo, usd_per_hour)


def sweep_report(result: SweepResult, config: SweepConfig, target: dict, settings: dict,
                 usd_per_hour: float | None) -> dict:
    points = [{"rate_per_s": p.rate_per_s, "slo_holds": p.holds, "refused": p.refused}
              | run_section(p.result, config.slo, usd_per_hour) for p in result.points]
    capacity = {"rate_per_s": result.capacity_rate_per_s, "slo_percentile": config.slo.percentile,
                "max_failure_ratio": config.max_failure_ratio, "verdict": result.verdict()}
    return header("sweep", target, settings, config.slo) | {"capacity": capacity, "points": points}


# files

def sample_rows(records: list[RequestRecord], rate_per_s: float | None) -> list[dict]:
    return [asdict(r) | {"rate_per_s": rate_per_s} for r in records]


def write_report(report: dict, samples: list[dict], out: Path, plot: PlotInput | None) -> list[Path]:
    """out.json (summary), out.samples.jsonl (every request), out.md, and out.html when plot is given."""
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_name(out.name + suffix) for suffix in (".json", ".samples.jsonl", ".md", ".html")]
    report = report | {"samples_file": paths[1].name}
    text = markdown(report)
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    paths[1].write_text("".join(json.dumps(row) + "\n" for row in samples))
    paths[2].write_text(text)
    if plot is None:
        return paths[:3]
    from inferd.bench.plots import html_page
    paths[3].write_text(html_page(report, text, plot.records, plot.gauges))
    return paths


# Markdown

def _n(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def latency_table(latency: dict) -> list[str]:
    rows = ["| measure (ms) | count | mean | p50 | p90 | p95 | p99 |", "|---|---:|---:|---:|---:|---:|---:|"]
    for key, d in latency.items():
        cells = [str(d["count"])] + [_n(d[k]) for k in ("mean", "p50", "p90", "p95", "p99")]
        rows.append(f"| {key.removesuffix('_ms').upper()} | " + " | ".join(cells) + " |")
    return rows


def run_lines(section: dict) -> list[str]:
    s, server, lag = section["summary"], section["server"], section["client_lag"]
    c, t, g = s["counts"], s["throughput"], s["goodput"]
    lines = latency_table(s["latency"]) + [
        "",
        f"- requests: {c['sent']} sent, {c['completed']} completed, {c['rejected']} rejected "
        f"({c['rejected_with_retry_after']} with Retry-After), {c['failed']} failed{_types(c['failed_by_type'])}, "
        f"{c['cancelled']} cancelled, {c['timed_out']} timed out; finish reasons {c['finish_reasons']}",
        f"- throughput over {_n(t['duration_s'])} s: {_n(t['request_throughput_per_s'], 3)} req/s, "
        f"{_n(t['output_tokens_per_s'])} output tokens/s, {_n(t['input_tokens_per_s'])} input tokens/s",
        f"- goodput: {_n(g['goodput_per_s'], 3)} accepted results/s ({g['met_slo']} requests met the SLO"
        + (f", {g['passed_check']} of {g['checked']} passed the quality check" if "checked" in g else "")
        + f", {g['accepted']} accepted); cost per accepted result: {cost_text(g)}",
        f"- client lag: p99 {_n(lag['p99_ms'])} ms, max {_n(lag['max_ms'])} ms (bound {lag['bound_ms']:g} ms at p99)"]
    return lines + server_lines(server)


def cost_text(g: dict) -> str:
    """Always a cost: the serving machine's seconds per accepted result, in USD too when its price is known."""
    if not g["accepted"]:
        return "none (no result accepted)"
    machine = f"{_n(g['machine_s_per_accepted_result'], 3)} s of the serving machine"
    if g.get("cost_per_accepted_result") is None:
        return machine + " (no USD price: pass --usd-per-hour, the machine's hardware price per hour)"
    return f"{_n(g['cost_per_accepted_result'], 6)} USD ({machine} at {g['usd_per_hour']:g} USD/h)"


def server_lines(server: dict | None) -> list[str]:
    if server is None:
        return ["- server view: no /metrics endpoint"]
    q = server["queue_time"] or {}
    return [f"- server: requests {server['requests_by_finish_reason']}, "
            f"prompt tokens {_n(server['prompt_tokens'], 0)}, "
            f"generation tokens {_n(server['generation_tokens'], 0)}, preemptions {_n(server['preemptions'], 0)}",
            f"- server queue time: mean {_n(q.get('mean_ms'))} ms, p95 ≈ {_n(q.get('p95_ms_from_buckets'))} ms; "
            f"KV cache peak {_n(_pct(server['kv_cache_usage_peak_ratio']))} %, waiting peak "
            f"{_n(server['waiting_peak'], 0)}, prefix-cache hit rate {_n(_pct(server['prefix_cache_hit_ratio']))} %"]


def _types(by_type: dict) -> str:
    return f" {by_type}" if by_type else ""


def _pct(ratio: float | None) -> float | None:
    return None if ratio is None else ratio * 100


def sweep_lines(report: dict) -> list[str]:
    cap, slo = report["capacity"], report["slo"]
    bounds = ", ".join(f"{k} ≤ {v:g}" for k, v in slo.items() if k != "percentile" and v is not None)
    lines = [f"**Capacity: {_n(cap['rate_per_s'], 3)} req/s** — the highest offered rate where "
             f"p{slo['percentile']:g} {bounds} held with at most {cap['max_failure_ratio']:.0%} failures.", "",
             f"Verdict: {cap['verdict']}.", "",
             "| offered req/s | achieved req/s | TTFT p50 | TTFT p95 | TTFT p99 | TPOT p95 | E2E p95 | goodput/s | "
             "failed+rejected | SLO |", "|" + "---:|" * 10]
    for p in report["points"]:
        s = p["summary"]
        lat, c = s["latency"], s["counts"]
        cells = [_n(p["rate_per_s"], 3), _n(s["throughput"]["request_throughput_per_s"], 3),
                 _n(lat["ttft_ms"]["p50"]), _n(lat["ttft_ms"]["p95"]), _n(lat["ttft_ms"]["p99"]),
                 _n(lat["tpot_ms"]["p95"]), _n(lat["e2e_ms"]["p95"]), _n(s["goodput"]["goodput_per_s"], 3),
                 str(c["failed"] + c["rejected"] + c["timed_out"]), _verdict(p)]
        lines.append("| " + " | ".join(cells) + " |")
    at_capacity = [p for p in report["points"] if p["rate_per_s"] == cap["rate_per_s"]]
    if at_capacity:
        lines += ["", f"## At capacity ({_n(cap['rate_per_s'], 3)} req/s offered)", ""] + run_lines(at_capacity[0])
    return lines


def _verdict(point: dict) -> str:
    return "client lag: refused" if point.get("refused") else "holds" if point["slo_holds"] else "broken"


def markdown(report: dict) -> str:
    target, settings = report["target"], report["settings"]
    lines = [f"# inferd bench {report['kind']}: {target.get('id')}", "",
             f"{report['created_at']} · {settings.get('base_url')} · {settings.get('api')} · "
             f"weights sha256 {(target.get('digests') or {}).get('weights', '–')[:16]}", ""]
    lines += sweep_lines(report) if report["kind"] == "sweep" else run_lines(report)
    lines += ["", "## Definitions", ""] + [f"- **{k}**: {v}" for k, v in report["definitions"].items()]
    lines += ["", "## Settings", "", "```json", json.dumps(settings, indent=1), "```"]
    return "\n".join(lines) + "\n"
