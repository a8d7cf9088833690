from inferd.gateway.degrade import DegradationSpec, DegradationStep
from inferd.gateway.degrade import Degrader, degrade

LADDER = [DegradationStep("reject_late"), DegradationStep("cap_max_tokens", max_tokens=64),
          DegradationStep("route", priority_class="batch", to="small")]


def test_the_ladder_climbs_one_step_per_sustained_period_and_steps_back_down():
    d = Degrader(DegradationSpec(LADDER, overload_queue_age_ms=1000, sustain_s=5), now=0.0)
    assert d.update(0.5, now=1) == []  # not overloaded
    assert d.update(2.0, now=2) == []  # overloaded since 2
    assert d.update(2.0, now=6.9) == []
    assert [s.action for s in d.update(2.0, now=7)] == ["reject_late"]
    assert d.update(2.0, now=11) == LADDER[:1]
    assert d.update(2.0, now=12) == LADDER[:2]
    assert d.update(2.0, now=17) == LADDER
    assert d.update(2.0, now=30) == LADDER  # no step beyond the last
    assert d.update(0.1, now=31) == LADDER  # recovered at 31: one step down per 5 s
    assert d.update(0.1, now=36) == LADDER[:2]
    assert d.update(0.1, now=41) == LADDER[:1]
    assert d.update(0.1, now=46) == []
    assert d.update(0.1, now=100) == []


def test_a_request_is_degraded_by_the_steps_in_force():
    late = degrade(LADDER, "interactive", seconds_left=0.5, expected_wait_s=3.0, max_output_tokens=200)
    assert late.reject and late.actions == ["reject_late"]
    ok = degrade(LADDER, "interactive", seconds_left=10.0, expected_wait_s=3.0, max_output_tokens=200)
    assert not ok.reject and ok.max_tokens == 64 and ok.route_to is None and ok.actions == ["cap_max_tokens"]
    assert ok.header == {"x-inferd-degraded": "cap_max_tokens"}
    batch = degrade(LADDER, "batch", seconds_left=None, expected_wait_s=30.0, max_output_tokens=16)
    assert not batch.reject and batch.max_tokens is None and batch.route_to == "small"  # 16 < cap: not capped
    assert batch.header == {"x-inferd-degraded": "route:small"}
    assert not degrade([], "batch", 0.1, 30.0, 200).actions
    barred = degrade(LADDER[2:], "batch", None, 30.0, 16, may_use=lambda name: name != "small")
    assert barred.route_to is None and not barred.actions  # a key that may not use `small` stays
