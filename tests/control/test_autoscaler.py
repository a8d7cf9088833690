"""The autoscaler's decisions from given signals on a fake clock (no processes)."""
from inferd.control.autoscaler import HOUR_S, Autoscaler, ColdStart, Signals, TtftWindow
from inferd.control.spec import AutoscalingSpec


def scaler(**kw) -> Autoscaler:
    spec = AutoscalingSpec(**({"min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 5.0,
                               "downscale_delay_s": 30.0} | kw))
    return Autoscaler(spec, max_num_seqs=4)


def test_scale_up_needs_the_breach_to_hold_for_the_upscale_delay():
    a = scaler()
    hot = Signals(replicas=1, starting=0, queue_length=6, queue_age_s=3.0, waiting_tokens=600, inflight=4)
    assert a.decide(0.0, hot).desired == 1
    assert a.decide(4.0, hot).desired == 1
    calm = Signals(replicas=1, starting=0, inflight=2)
    assert a.decide(4.5, calm).desired == 1  # the breach ended: its clock restarts
    assert a.decide(6.0, hot).desired == 1
    d = a.decide(11.0, hot)
    assert d.desired == 2 and "queue age 3000 ms" in d.reason


def test_each_signal_breaches_on_its_own():
    a = scaler(target_ttft_ms=500, max_kv_usage=0.8, max_waiting_tokens_per_replica=100)
    assert a.breaches(Signals(1, 0, waiting_tokens=150), False)[0].startswith("waiting tokens 150")
    assert a.breaches(Signals(1, 0, kv_usage=0.9), False)[0].startswith("KV usage 0.90")
    assert a.breaches(Signals(1, 0, ttft_p95_s=0.7, inflight=3), False)[0].startswith("TTFT p95 700 ms")
    assert a.breaches(Signals(1, 0, ttft_p95_s=0.7, inflight=1), False) == []  # idle: a slow model, not load
    assert a.breaches(Signals(1, 0, ttft_p95_s=0.3, kv_usage=0.5, waiting_tokens=50), False) == []


def test_a_growing_queue_breaches_early_by_the_cold_start():
    a = scaler(target_queue_age_ms=2000)
    young = Signals(replicas=1, starting=0, queue_length=2, queue_age_s=0.5, cold_start_s=10.0)
    assert a.breaches(young, growing=True)[0].startswith("queue growing")
    assert a.breaches(young, growing=False) == []  # a queue being served down is no reason
    assert a.breaches(Signals(1, 0, queue_length=2, queue_age_s=0.5, cold_start_s=1.0), True) == []
    a.decide(0.0, Signals(1, 0, queue_length=1, queue_age_s=0.1, cold_start_s=10.0))
    assert a.decide(1.0, young).reason.startswith("breach held back: queue growing")


def test_no_second_replica_while_one_is_starting_and_never_above_max():
    a = scaler(max_replicas=2, upscale_delay_s=0.0)
    hot = Signals(replicas=2, starting=1, queue_length=5, queue_age_s=9.0)
    assert a.decide(0.0, hot).desired == 2
    assert a.decide(1.0, Signals(2, 0, queue_length=5, queue_age_s=9.0)).desired == 2  # at max
    assert a.decide(2.0, Signals(3, 0)).desired == 2  # above max: one down


def test_scale_down_one_at_a_time_after_the_downscale_delay():
    a = scaler()
    idle = Signals(replicas=3, starting=0, inflight=1)
    assert a.decide(0.0, idle).desired == 3
    assert a.decide(29.0, idle).desired == 3
    d = a.decide(30.0, idle)
    assert d.desired == 2 and d.reason == "idle for 30 s"
    assert a.decide(31.0, Signals(2, 0, inflight=1)).desired == 2  # the delay starts again
    assert a.decide(61.0, Signals(2, 0, inflight=1)).desired == 1
    assert a.decide(200.0, Signals(1, 0)).desired == 1  # min_replicas


def test_busy_replicas_are_not_idle():
    a = scaler()
    busy = Signals(replicas=2, starting=0, inflight=3)  # one replica alone would be 3/4 full
    for t in (0.0, 40.0, 80.0):
        assert a.decide(t, busy).desired == 2


def test_scale_to_zero_and_back_on_the_first_waiting_request():
    a = scaler(min_replicas=0, scale_to_zero=True, upscale_delay_s=60.0)
    assert a.decide(0.0, Signals(1, 0, inflight=1)).desired == 1  # running work keeps the last one
    assert a.decide(1.0, Signals(1, 0)).desired == 1
    assert a.decide(31.0, Signals(1, 0)).desired == 0
    assert a.decide(32.0, Signals(0, 0)).desired == 0
    d = a.decide(33.0, Signals(0, 0, queue_length=1, queue_age_s=0.01))
    assert d.desired == 1 and "no replica" in d.reason  # at once, not after the upscale delay


def test_below_min_starts_at_once():
    assert scaler(min_replicas=2).decide(0.0, Signals(1, 0)).desired == 2


def test_cost_ceiling_counts_replica_hours_over_the_last_hour():
    a = scaler(max_replicas=2, upscale_delay_s=0.0, max_replica_hours_per_hour=1.5)
    hot = lambda n: Signals(replicas=n, starting=0, queue_length=9, queue_age_s=9.0)  # noqa: E731
    assert a.decide(0.0, hot(1)).desired == 2
    t = 0.0
    while a.decide(t, hot(2)).desired == 2 and t < HOUR_S:  # 2 replicas until 1.5 replica-hours are spent
        t += 60.0
    assert 0.7 * HOUR_S <= t <= 0.8 * HOUR_S
    d = a.decide(t, hot(2))
    assert d.desired == 1 and d.reason.startswith("cost ceiling")
    assert a.decide(t + 1, hot(1)).desired == 1  # no scale-up while over budget
    assert a.decide(t + 2 * HOUR_S, hot(1)).desired == 2  # an hour later the budget is back


def test_ttft_window_p95_and_cold_start_estimate():
    w = TtftWindow(window_s=10.0)
    assert w.p95(0.0) is None
    for i in range(20):
        w.add(float(i) / 10, 0.1 if i < 19 else 2.0)
    assert w.p95(2.0) == 0.1
    w.add(2.0, 3.0)
    assert w.p95(2.0) == 2.0
    assert w.p95(30.0) is None  # all older than the window
    c = ColdStart(initial_s=20.0)
    c.observe({"weights_loaded": 2.0, "warm": 5.0, "ready": 6.0})
    assert c.estimate_s == 6.0
    c.observe({"weights_loaded": 2.0, "warm": 9.0, "ready": 10.0})
    assert c.estimate_s == 8.0 and c.last["warm"] == 9.0
