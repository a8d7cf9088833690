"""The server's view: Prometheus deltas, histogram quantiles, gauges."""
import pytest

from inferd.bench.server import GaugePoint, gauge_point, histogram_quantile, parse_metrics, server_view

BEFORE = """
# TYPE inferd_requests_total counter
inferd_requests_total{finish_reason="length"} 2.0
# TYPE inferd_prompt_tokens_total counter
inferd_prompt_tokens_total 100.0
# TYPE inferd_generation_tokens_total counter
inferd_generation_tokens_total 20.0
# TYPE inferd_queue_time_seconds histogram
inferd_queue_time_seconds_bucket{le="0.1"} 2.0
inferd_queue_time_seconds_bucket{le="1.0"} 2.0
inferd_queue_time_seconds_bucket{le="+Inf"} 2.0
inferd_queue_time_seconds_count 2.0
inferd_queue_time_seconds_sum 0.1
"""

AFTER = """
# TYPE inferd_requests_total counter
inferd_requests_total{finish_reason="length"} 7.0
inferd_requests_total{finish_reason="abort"} 1.0
# TYPE inferd_prompt_tokens_total counter
inferd_prompt_tokens_total 400.0
# TYPE inferd_generation_tokens_total counter
inferd_generation_tokens_total 70.0
# TYPE inferd_queue_time_seconds histogram
inferd_queue_time_seconds_bucket{le="0.1"} 4.0
inferd_queue_time_seconds_bucket{le="1.0"} 6.0
inferd_queue_time_seconds_bucket{le="+Inf"} 6.0
inferd_queue_time_seconds_count 6.0
inferd_queue_time_seconds_sum 1.3
# TYPE inferd_kv_cache_blocks_used gauge
inferd_kv_cache_blocks_used 30.0
# TYPE inferd_kv_cache_blocks_capacity gauge
inferd_kv_cache_blocks_capacity 120.0
# TYPE inferd_num_requests_waiting gauge
inferd_num_requests_waiting 3.0
"""


def test_server_view_deltas():
    before, after = parse_metrics(BEFORE), parse_metrics(AFTER)
    view = server_view(before, after, [GaugePoint(0.0, 1, 0, 0.1), GaugePoint(1.0, 4, 3, 0.25)])
    assert view["requests_by_finish_reason"] == {"length": 5.0, "abort": 1.0}
    assert view["prompt_tokens"] == 300.0 and view["generation_tokens"] == 50.0
    assert view["queue_time"]["count"] == 4 and view["queue_time"]["mean_ms"] == pytest.approx(300.0)
    assert view["kv_cache_usage_peak_ratio"] == 0.25 and view["waiting_peak"] == 3
    assert view["prefix_cache_hit_ratio"] is None and server_view(None, after, []) is None


def test_histogram_quantile_interpolates_within_buckets():
    before, after = parse_metrics(BEFORE), parse_metrics(AFTER)
    # the run's 4 observations: 2 below 0.1 s, 2 in (0.1, 1.0]
    assert histogram_quantile(0.5, before, after, "inferd_queue_time_seconds") == pytest.approx(0.1)
    assert histogram_quantile(0.75, before, after, "inferd_queue_time_seconds") == pytest.approx(0.55)


def test_gauge_point_from_blocks():
    point = gauge_point(parse_metrics(AFTER), 2.0)
    assert (point.running, point.waiting, point.kv_usage_ratio) == (None, 3.0, 0.25)


def test_prefix_cache_hit_ratio_when_present():
    text = "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total 30.0\n" \
           "# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total 40.0\n"
    assert server_view({}, parse_metrics(text), [])["prefix_cache_hit_ratio"] == pytest.approx(0.75)
