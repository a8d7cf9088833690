from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from inferd.bench.client import RequestRecord
from inferd.bench.errors import BenchError

PERCENTILES = (50, 90, 95, 99)
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")

DEFINITIONS = {
    "ttft_ms": "time to first token: request sent → first chunk carrying output text (vLLM bench serve)",
    "tpot_ms": "time per output token, per request: (e2e − ttft) / (output tokens − 1); requests with ≥ 2 tokens",
    "itl_ms": "inter-token latency: gaps between consecutive output chunks, pooled over all requests",
    "e2e_ms": "end-to-end latency: request sent → end of stream ([DONE])",
    "percentiles": "numpy linear interpolation over completed requests only; count = samples used",
    "throughput": "per second of the measured wall time: first send → last request ended",
    "goodput_per_s": "completed requests meeting every given SLO (with --quality-set: and passing the item's "
                     "check), per second",
    "machine_s_per_accepted_result": "the measured wall time / accepted results: seconds of the serving machine "
                                     "each accepted result took; failed, rejected and cancelled attempts count in "
                                     "the time, not in the divisor",
    "cost_per_accepted_result": "USD: --usd-per-hour (the serving machine's hardware price) × "
                                "machine_s_per_accepted_result / 3600; none without a price",
    "excluded": "rejected (429/503), failed (by error type), cancelled and timed-out requests are counted "
                "apart and never enter latency figures",
}


# distributions

@dataclass(slots=True)
class Distribution:
    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None


def distribution(values_s: list[float], scale: float = 1e3) -> Distribution:
    """Percentiles of seconds, shown in ms by default."""
    if not values_s:
        return Distribution(0)
    arr = np.asarray(values_s) * scale
    p50, p90, p95, p99 = (float(v) for v in np.percentile(arr, PERCENTILES))
    return Distribution(len(values_s), float(arr.mean()), p50, p90, p95, p99)


def percentile_of(values_s: list[float], percentile: float, scale: float = 1e3) -> float | None:
    return float(np.percentile(np.asarray(values_s) * scale, percentile)) if values_s else None


# SLO

@dataclass(slots=True)
class SLO:
    """Bounds a request must meet; None = no bound. percentile applies to sweeps."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    percentile: float = 95.0

    @property
    def given(self) -> bool:
        return any(getattr(self, k) is not None for k in SLO_KEYS)

    def met_by(self, record: RequestRecord) -> bool:
        values = {"ttft_ms": record.ttft_s, "tpot_ms": record.tpot_s, "e2e_ms": record.e2e_s}
        return record.outcome == "completed" and all(
            bound is None or (values[k] if values[k] is not None else 0.0) * 1e3 <= bound
            for k, bound in ((k, getattr(self, k)) for k in SLO_KEYS))


def parse_slo(text: str | None, percentile: float = 95.0) -> SLO:
    """'ttft_ms=500,tpot_ms=50,e2e_ms=4000' (any subset)."""
    slo = SLO(percentile=percentile)
    for part in filter(None, (text or "").split(",")):
        key, _, value = part.partition("=")
        if key.strip() not in SLO_KEYS:
            raise BenchError(f"unknown SLO key {key.strip()!r} in --slo; use {', '.join(SLO_KEYS)}")
        try:
            setattr(slo, key.strip(), float(value))
        except ValueError as exc:
            raise BenchError(f"--slo {key.strip()} needs a number of milliseconds (got {value!r})") from exc
    if not 0 < percentile < 100:
        raise BenchError(f"--slo-percentile must be between 0 and 100 (got {percentile})")
    return slo


# summary of a run

def counts(records: list[RequestRecord]) -> dict:
    by = Counter(r.outcome for r in records)
    rejected = [r for r in records if r.outcome == "rejected"]
    return {"sent": len(records), "completed": by["completed"], "rejected": by["rejected"],
            "rejected_with_retry_after": sum(r.retry_after is not None for r in rejected),
            "failed": by["failed"], "failed_by_type": dict(Counter(r.error_type for r in records
                                                                  if r.outcome == "failed")),
            "cancelled": by["cancelled"], "timed_out": by["timed_out"],
            "finish_reasons": dict(Counter(r.finish_reason for r in records if r.outcome == "completed"))}


def latencies(records: list[RequestRecord]) -> dict[str, Distribution]:
    done = [r for r in records if r.outcome == "completed"]
    return {"ttft_ms": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
            "tpot_ms": distribution([r.tpot_s for r in done if r.tpot_s is not None]),
            "itl_ms": distribution([gap for r in done for gap in r.itl_s]),
            "e2e_ms": distribution([r.e2e_s for r in done if r.e2e_s is not None])}


def throughput(records: list[RequestRecord], duration_s: float) -> dict[str, float]:
    done = [r for r in records if r.outcome == "completed"]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return {"duration_s": duration_s, "request_throughput_per_s": len(done) * per_s,
            "output_tokens_per_s": sum(r.output_tokens for r in done) * per_s,
            "input_tokens_per_s": sum(r.input_tokens for r in done) * per_s}


def goodput(records: list[RequestRecord], duration_s: float, slo: SLO, usd_per_hour: float | None) -> dict:
    """Accepted results: met every SLO and, where the request had a quality check, passed it. Their cost: the
    machine's time each took, and in USD when the machine's price per hour is given."""
    good = sum(slo.met_by(r) and r.passed_check is not False for r in records)
    checked = [r for r in records if r.passed_check is not None]
    cost = None if usd_per_hour is None else usd_per_hour * duration_s / 3600
    out = {"met_slo": sum(slo.met_by(r) for r in records), "accepted": good,
           "goodput_per_s": good / duration_s if duration_s > 0 else 0.0,
           "machine_s_per_accepted_result": duration_s / good if good else None, "usd_per_hour": usd_per_hour,
           "run_cost": cost, "cost_per_accepted_result": cost / good if cost is not None and good else None}
    return out | ({"checked": len(checked), "passed_check": sum(r.passed_check for r in checked)} if checked else {})


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO, usd_per_hour: float | None) -> dict:
    return {"counts": counts(records),
            "tokens": {"input_tokens_sent": sum(r.input_tokens for r in records),
                       "output_tokens_completed": sum(r.output_tokens for r in records if r.outcome == "completed"),
                       "output_chunks_cancelled": sum(len(r.chunk_s) for r in records if r.outcome == "cancelled")},
            "latency": {k: asdict(v) for k, v in latencies(records).items()},
            "throughput": throughput(records, duration_s),
            "goodput": goodput(records, duration_s, slo, usd_per_hour)}


def slo_holds(records: list[RequestRecord], slo: SLO, max_failure_ratio: float) -> bool:
    """Every SLO holds at its percentile and failures (rejected, failed, timed out) stay within the ratio."""
    c = counts(records)
    attempted = c["sent"] - c["cancelled"]
    failures = c["rejected"] + c["failed"] + c["timed_out"]
    if c["completed"] == 0 or failures > max_failure_ratio * attempted:
        return False
    done = [r for r in records if r.outcome == "completed"]
    values = {"ttft_ms": [r.ttft_s for r in done if r.ttft_s is not None],
              "tpot_ms": [r.tpot_s for r in done if r.tpot_s is not None],
              "e2e_ms": [r.e2e_s for r in done if r.e2e_s is not None]}
    for key in SLO_KEYS:
        bound, value = getattr(slo, key), percentile_of(values[key], slo.percentile)
        if bound is not None and value is not None and value > bound:
            return False
    return True
