"""Statistics against inputs whose answers are known by hand."""
import pytest

from inferd.bench.client import RequestRecord
from inferd.bench.errors import BenchError
from inferd.bench.stats import SLO, counts, distribution, goodput, latencies, parse_slo, slo_holds, throughput


def record(index: int, chunk_s: list[float], done_s: float, output_tokens: int | None = None,
           outcome: str = "completed") -> RequestRecord:
    return RequestRecord(index, 0.0, 10, outcome=outcome, chunk_s=chunk_s, done_s=done_s,
                         output_tokens=len(chunk_s) if output_tokens is None else output_tokens)


# percentiles

def test_distribution_matches_linear_interpolation():
    d = distribution([float(v) for v in range(1, 101)], scale=1.0)
    assert d.count == 100 and d.mean == pytest.approx(50.5)
    assert (d.p50, d.p90, d.p95, d.p99) == pytest.approx((50.5, 90.1, 95.05, 99.01))


def test_distribution_in_ms_and_empty():
    assert distribution([0.1, 0.3]).mean == pytest.approx(200.0)
    assert distribution([]).count == 0 and distribution([]).p50 is None


# TTFT, TPOT, ITL, E2E as in vLLM's bench serve

def test_latency_definitions():
    r = record(0, [0.5, 0.7, 1.0, 1.6], done_s=1.7, output_tokens=5)  # 5 tokens in 4 chunks (from usage)
    assert r.ttft_s == 0.5 and r.e2e_s == 1.7
    assert r.tpot_s == pytest.approx((1.7 - 0.5) / 4)
    assert r.itl_s == pytest.approx([0.2, 0.3, 0.6])
    assert record(1, [0.5], done_s=0.6).tpot_s is None  # one token: no TPOT


def test_only_completed_requests_enter_latency():
    records = [record(0, [0.1, 0.2], 0.3), record(1, [5.0, 6.0], 7.0, outcome="cancelled"),
               record(2, [], 9.0, outcome="failed"), record(3, [], 9.0, outcome="rejected")]
    lat = latencies(records)
    assert lat["ttft_ms"].count == 1 and lat["ttft_ms"].mean == pytest.approx(100.0)
    assert lat["itl_ms"].count == 1 and lat["e2e_ms"].p99 == pytest.approx(300.0)


def test_counts_keep_outcomes_apart():
    records = [record(0, [0.1], 0.2), record(1, [], 0.0, outcome="rejected"),
               record(2, [], 0.0, outcome="failed"), record(3, [0.1], 0.2, outcome="cancelled"),
               record(4, [], 0.0, outcome="timed_out")]
    records[1].retry_after = "1"
    records[2].error_type = "internal_error"
    records[0].finish_reason = "length"
    c = counts(records)
    assert (c["sent"], c["completed"], c["rejected"], c["failed"], c["cancelled"], c["timed_out"]) == (5, 1, 1, 1, 1, 1)
    assert c["rejected_with_retry_after"] == 1 and c["failed_by_type"] == {"internal_error": 1}
    assert c["finish_reasons"] == {"length": 1}


# throughput, goodput, cost

def test_throughput_counts_completed_only():
    records = [record(i, [0.1, 0.2], 0.3, output_tokens=4) for i in range(6)]
    records.append(record(9, [0.1], 0.2, outcome="cancelled"))
    t = throughput(records, duration_s=2.0)
    assert t["request_throughput_per_s"] == 3.0 and t["output_tokens_per_s"] == 12.0 and t["input_tokens_per_s"] == 30.0


def test_goodput_and_cost_per_accepted_result():
    fast = [record(i, [0.1, 0.2, 0.3], 0.3) for i in range(3)]  # ttft 100 ms, tpot 100 ms
    slow_first = [record(3, [0.9, 1.0], 1.0)]  # ttft 900 ms
    slow_tokens = [record(4, [0.1, 0.6], 0.6)]  # tpot 500 ms
    failed = [record(5, [], 0.0, outcome="failed")]
    slo = parse_slo("ttft_ms=500,tpot_ms=200")
    g = goodput(fast + slow_first + slow_tokens + failed, duration_s=10.0, slo=slo, usd_per_hour=36.0)
    assert g["met_slo"] == 3 and g["goodput_per_s"] == pytest.approx(0.3)
    assert g["run_cost"] == pytest.approx(0.1) and g["cost_per_accepted_result"] == pytest.approx(0.1 / 3)
    assert g["machine_s_per_accepted_result"] == pytest.approx(10.0 / 3)
    assert goodput(failed, 10.0, slo, 36.0)["cost_per_accepted_result"] is None
    unpriced = goodput(fast, 10.0, slo, None)
    assert unpriced["cost_per_accepted_result"] is None and unpriced["machine_s_per_accepted_result"] == 10.0 / 3


def test_e2e_slo_and_no_slo():
    r = record(0, [0.1, 0.2], 2.0)
    assert not parse_slo("e2e_ms=1500").met_by(r) and parse_slo("e2e_ms=2500").met_by(r)
    assert SLO().met_by(r) and not SLO().met_by(record(1, [0.1], 0.2, outcome="cancelled"))


def test_parse_slo_rejects_unknown_keys_and_numbers():
    with pytest.raises(BenchError, match="unknown SLO key 'ttft'"):
        parse_slo("ttft=5")
    with pytest.raises(BenchError, match="needs a number"):
        parse_slo("ttft_ms=fast")
    with pytest.raises(BenchError, match="between 0 and 100"):
        parse_slo("ttft_ms=5", percentile=100)


def test_slo_holds_at_percentile_and_failure_ratio():
    records = [record(i, [0.1 * (i + 1)], 0.1 * (i + 1)) for i in range(10)]  # ttft 100..1000 ms
    assert slo_holds(records, parse_slo("ttft_ms=1000", 95), 0.0)
    assert not slo_holds(records, parse_slo("ttft_ms=900", 95), 0.0)
    assert slo_holds(records, parse_slo("ttft_ms=900", 50), 0.0)
    failing = records + [record(10, [], 0.0, outcome="rejected")]
    assert not slo_holds(failing, parse_slo("ttft_ms=1000", 95), 0.05)
    assert slo_holds(failing, parse_slo("ttft_ms=1000", 95), 0.1)
