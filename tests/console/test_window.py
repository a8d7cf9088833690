"""The console's time series: bounded rings, only known deployments kept, rates and interpolated quantiles."""
import pytest

from inferd.console.window import COARSE_COUNT, FINE_COUNT, Window, quantile
from inferd.gateway.usage import UsageRecord


class Clock:
    t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def record(model="m", ttft_s=0.04, status="completed", error_code=None) -> UsageRecord:
    return UsageRecord("req", model, status, 200, 0.0, 0.1, "gw", deployment_version="v1", ttft_s=ttft_s,
                       error_code=error_code)


def test_recent_figures_and_failures_by_reason():
    clock = Clock()
    w = Window(lambda name, version: name == "m", clock)
    for _ in range(90):
        w.observe(record())
    for _ in range(10):
        w.observe(record(ttft_s=2.5, status="rejected", error_code="queue_full"))
    w.observe(record(model="unknown"))
    recent = w.recent("m", "v1")
    assert recent["last_5m"]["requests"] == 100 and recent["last_5m"]["failures"] == {"queue_full": 10}
    assert 0.03 < recent["last_5m"]["ttft_p50_s"] <= 0.05 and 2.0 < recent["last_5m"]["ttft_p95_s"] <= 3.0
    assert list(w.series) == [("m", "v1")]  # a record for a model the gateway does not serve keeps no series
    clock.t += 6 * 60
    assert w.recent("m", "v1")["last_5m"]["requests"] == 0 and w.recent("m", "v1")["last_60m"]["requests"] == 100


def test_what_did_not_complete_by_model_and_reason_over_a_day():
    clock = Clock()
    w = Window(lambda name, version: name in ("m", "n"), clock)
    for _ in range(3):
        w.observe(record(status="rejected", error_code="context_length_exceeded"))
    w.observe(record(status="cancelled", error_code="client_closed_request"))
    w.observe(record(model="n", status="failed"))  # no code: its status
    w.observe(record())
    assert w.reasons(clock.t - 86400) == [
        {"model": "m", "version": "v1", "reason": "context_length_exceeded", "count": 3},
        {"model": "m", "version": "v1", "reason": "client_closed_request", "count": 1},
        {"model": "n", "version": "v1", "reason": "failed", "count": 1}]
    clock.t += 86400 + 600
    assert w.reasons(clock.t - 86400) == []


def test_memory_stays_bounded_over_days():
    clock = Clock()
    w = Window(lambda name, version: True, clock)
    for _ in range(3 * 24 * 60):  # three days, a record and a sample every minute
        w.observe(record())
        w.sample("m", "v1", 3, 2, 1)
        clock.t += 60
    s = w.series[("m", "v1")]
    assert len(s.fine.buckets) == FINE_COUNT and len(s.coarse.buckets) == COARSE_COUNT
    points = w.history("m", "v1")
    assert len(points) == COARSE_COUNT and points[-1]["queue_length_max"] == 3


def test_quantile_interpolates_inside_a_bucket():
    counts = [0] * 25
    counts[9] = 10  # ten samples in (0.1, 0.15]
    assert quantile(0.5, counts) == 0.125 and quantile(0.5, [0] * 25) is None


def test_tpot_prefix_cache_hits_and_kv_cache_use():
    clock = Clock()
    w = Window(lambda name, version: True, clock)
    for _ in range(10):  # 10 ms per output token after the first (the records' TPOT: relay.Outcome.tpot_s)
        w.observe(UsageRecord("req", "m", "completed", 200, 0.0, 0.1, "gw", deployment_version="v1", ttft_s=0.04,
                              prompt_tokens=100, cached_tokens=25, completion_tokens=7, tpot_s=0.01))
    w.observe(UsageRecord("req", "m", "failed", 500, 0.0, 5.0, "gw", deployment_version="v1", ttft_s=0.04,
                          prompt_tokens=100, completion_tokens=2))  # failed: no TPOT
    w.sample("m", "v1", 0, 0, 1, 0.25)
    w.sample("m", "v1", 0, 0, 1, None)  # no replica reported it: the last value stays
    recent = w.recent("m", "v1")
    assert 0.005 < recent["last_5m"]["tpot_p50_s"] <= 0.01 and recent["last_5m"]["tpot_p95_s"] <= 0.01
    assert recent["last_5m"]["prefix_cache_hit_rate"] == 250 / 1100 and recent["kv_cache_usage"] == 0.25
    point = w.history("m", "v1")[-1]
    assert point["kv_cache_usage"] == 0.25 and point["tpot_p95_s"] <= 0.01
    assert Window(lambda n, v: True, clock).recent("m", "v1")["kv_cache_usage"] is None


def test_a_records_tpot_counts_streamed_and_unary_answers_alike():
    from inferd.gateway.relay import Outcome
    streamed, unary, external = Outcome(), Outcome(), Outcome()
    for o in (streamed, unary, external):
        o.end("completed", 200)
        o.completion_tokens, o.ttft_s = 11, 0.2
    streamed.streamed = True
    unary.decode_s = 0.5  # what our replica says in headers.DECODE_S
    assert streamed.tpot_s(1.2) == pytest.approx(0.1) and unary.tpot_s(0.7) == pytest.approx(0.05)
    assert external.tpot_s(0.7) is None  # a unary answer from a server that does not say: unknown, not ~0
    unary.completion_tokens = 1
    assert unary.tpot_s(0.7) is None
    failed = Outcome(streamed=True, ttft_s=0.1, completion_tokens=9)
    failed.end("failed", 500)
    assert failed.tpot_s(1.0) is None


def test_history_is_saved_and_restored_merging_the_gateways_and_leaving_the_bucket_in_progress():
    from inferd.console.window import COARSE_S
    clock = Clock()
    clock.t = 1_800_000_000.0 // COARSE_S * COARSE_S
    first, second = Window(lambda n, v: n == "m", clock), Window(lambda n, v: n == "m", clock)
    for w, n in ((first, 3), (second, 2)):
        for _ in range(n):
            w.observe(record())
        w.observe(record(status="cancelled", error_code="client_closed_request"))
    clock.t += COARSE_S  # a bucket later, each gateway's bucket in progress too
    first.observe(record())
    saved = [{"deployment": name, "version": version, "start_unix_s": start, "bucket": bucket}
             for w in (first, second) for name, version, start, bucket in w.coarse_buckets(clock.t - COARSE_S)]
    saved.append({"deployment": "gone", "version": "v1", "start_unix_s": saved[0]["start_unix_s"],
                  "bucket": saved[0]["bucket"]})
    restarted = Window(lambda n, v: n == "m", clock)
    restarted.restore(sorted(saved, key=lambda r: r["start_unix_s"]))
    points = restarted.history("m", "v1")
    assert [(p["requests_per_s"] * COARSE_S, p["failures"]) for p in points] == [(7, 2)]
    assert restarted.recent("m", "v1")["last_5m"]["requests"] == 0  # the minutes' rings start empty
    assert list(restarted.series) == [("m", "v1")]
