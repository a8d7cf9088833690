"""The rollout's rules and state changes, fed usage records directly (no replicas)."""
import asyncio
import json

import pytest

from inferd.control.probes import read_probes
from inferd.control.rollout import (
    Rollout,
    RolloutController,
    RolloutError,
    judge,
    p95,
    sample_of,
    stats_of,
)
from inferd.control.spec import RolloutSpec
from inferd.gateway.admission import AdmissionQueue, QueueConfig
from inferd.gateway.deployments import Deployment, Deployments, TextModel, Upstream
from inferd.gateway.usage import UsageRecord

POLICY = RolloutSpec(weight=0.25, window_s=60, min_requests=4)


def record(version: str, status: str = "completed", ttft_s: float = 0.1, e2e_s: float = 0.5, tokens: int = 5,
           cost_usd: float = 0.001, model: str = "smol") -> UsageRecord:
    return UsageRecord(request_id="r", model=model, status=status, http_status=200, started_unix_s=0.0,
                       e2e_s=e2e_s, gateway_id="g", deployment_version=version, completion_tokens=tokens,
                       ttft_s=ttft_s, cost_usd=cost_usd,
                       tpot_s=(e2e_s - ttft_s) / (tokens - 1) if status == "completed" and tokens > 1 else None)


def stats(*records: UsageRecord, probe_score: float | None = None):
    return stats_of([sample_of(r, 0.0) for r in records], probe_score)


def test_p95_is_the_nearest_rank():
    assert p95([]) is None and p95([3.0]) == 3.0
    assert p95([float(i) for i in range(1, 21)]) == 19.0 and p95([float(i) for i in range(1, 101)]) == 95.0


def test_stats_count_errors_but_not_cancellations_and_tpot_per_token():
    s = stats(record("v2", tokens=5, ttft_s=0.1, e2e_s=0.5), record("v2", "failed"), record("v2", "expired"),
              record("v2", "cancelled"), record("v2", "rejected"))
    assert (s.requests, s.errors) == (3, 2) and s.error_rate == pytest.approx(2 / 3)
    assert s.tpot_p95_s == pytest.approx(0.1) and s.ttft_p95_s == 0.1 and s.cost_per_request_usd == 0.001


def test_judge_waits_for_min_requests_then_promotes_a_good_canary():
    stable = stats(*[record("v1")] * 8)
    assert judge(POLICY, stats(*[record("v2")] * 3), stable).action == "wait"
    verdict = judge(POLICY, stats(*[record("v2")] * 4), stable)
    assert verdict.action == "promote" and any("TTFT p95 1.00x" in r for r in verdict.reasons)


@pytest.mark.parametrize("canary, reason", [
    ([record("v2", ttft_s=0.2)] * 4, "TTFT p95 2.00x stable (max 1.5x)"),
    ([record("v2", e2e_s=1.0)] * 4, "TPOT p95 2.25x stable (max 1.5x)"),
    ([record("v2", cost_usd=0.002)] * 4, "cost per request 2.00x stable (max 1.25x)"),
    ([record("v2")] * 4 + [record("v2", "failed")], "error rate 20.0% vs 0.0% (max +2.0%)"),
])
def test_judge_rolls_back_when_any_rule_fails(canary, reason):
    verdict = judge(POLICY, stats(*canary), stats(*[record("v1")] * 8))
    assert verdict.action == "rollback" and verdict.reasons == [reason]


def test_judge_needs_the_probe_score_when_there_is_a_probe_set():
    policy = RolloutSpec(min_requests=1, probes="probes.jsonl", min_probe_score=1.0)
    stable = stats(record("v1"), probe_score=1.0)
    assert judge(policy, stats(record("v2")), stable).action == "wait"
    verdict = judge(policy, stats(record("v2"), probe_score=0.5), stable)
    assert verdict.action == "rollback" and verdict.reasons == ["probe score 50% (min 100%, stable 100%)"]
    assert judge(policy, stats(record("v2"), probe_score=1.0), stable).action == "promote"


def test_no_stable_baseline_passes_the_ratio_rules():
    verdict = judge(POLICY, stats(*[record("v2")] * 4), stats())
    assert verdict.action == "promote" and "TTFT p95: no stable baseline" in verdict.reasons


def test_read_probes_names_the_bad_line(tmp_path):
    path = tmp_path / "probes.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "Capital of France?"}], "expect": "(?i)paris"})
    path.write_text(good + "\n\n" + good + "\n")
    assert [p.expect.pattern for p in read_probes(path)] == ["(?i)paris"] * 2
    path.write_text(good + "\n" + json.dumps({"messages": [], "expect": "x"}) + "\n")
    with pytest.raises(ValueError, match="line 2: messages must be a non-empty list"):
        read_probes(path)
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}], "expect": "(unclosed"}))
    with pytest.raises(ValueError, match="line 1: missing \\)"):
        read_probes(path)


# routing and the controller's state changes (on an event loop, as in the gateway; no pools: nothing to stop)

def deployment(version: str) -> Deployment:
    return Deployment(name="smol", model=TextModel(None, 128), version=version,
                      upstreams=[Upstream(f"http://127.0.0.1:1/{version}")], queue=AdmissionQueue(QueueConfig()))


def setup(policy: RolloutSpec = POLICY) -> tuple[Deployments, RolloutController]:
    deployments = Deployments()
    deployments.add(deployment("v1"))
    deployments.add(deployment("v2"), canary=True)
    rollout = Rollout("smol", deployments.by_name["smol"], deployments.canaries["smol"], policy)
    return deployments, RolloutController(deployments, [rollout])


def on_loop(test):
    return lambda: asyncio.run(test())


@on_loop
async def test_the_canary_gets_its_exact_share_only_once_started():
    deployments, controller = setup()
    assert {deployments.route("smol").version for _ in range(20)} == {"v1"}
    assert deployments.route(None).version == "v1" and deployments.route("nope") is None
    controller.start_rollout("smol")
    versions = [deployments.route("smol").version for _ in range(100)]
    assert versions.count("v2") == 25 and versions[:4] == ["v1", "v1", "v1", "v2"]


@on_loop
async def test_a_worse_canary_is_rolled_back_and_stable_keeps_everything():
    deployments, controller = setup()
    controller.observe(record("v2"))  # before the start: counted in metrics, not judged
    controller.start_rollout("smol")
    for _ in range(6):
        controller.observe(record("v1"))
    for _ in range(4):
        controller.observe(record("v2", ttft_s=0.5))
    verdict = controller.evaluate(controller.rollouts["smol"])
    assert verdict.action == "rollback" and "TTFT p95 5.00x" in verdict.reasons[0]
    status = controller.status("smol")[0]
    assert status["state"] == "rolled_back" and status["decision"]["by"] == "auto" and status["weight"] == 0
    assert status["versions"]["v2"]["requests"] == 4 and status["versions"]["v1"]["requests"] == 6
    assert "smol" not in deployments.canaries and {deployments.route("smol").version for _ in range(8)} == {"v1"}
    with pytest.raises(RolloutError, match="already rolled_back"):
        controller.promote("smol")
    with pytest.raises(RolloutError, match="cannot start again"):
        controller.start_rollout("smol")
    metrics = {m.name: m for m in controller.collect()}
    state = {s.labels["state"]: s.value for s in metrics["inferd_gateway_rollout_state"].samples}
    assert state == {"pending": 0, "running": 0, "promoted": 0, "rolled_back": 1, "refused": 0}
    requests = {(s.labels["version"], s.labels["status"]): s.value
                for s in metrics["inferd_gateway_version_requests"].samples}
    assert requests[("v2", "completed")] == 5 and requests[("v1", "completed")] == 6


@on_loop
async def test_a_good_canary_is_promoted_and_takes_all_traffic():
    deployments, controller = setup()
    controller.start_rollout("smol", weight=0.5)
    for _ in range(4):
        controller.observe(record("v1"))
        controller.observe(record("v2"))
    assert controller.evaluate(controller.rollouts["smol"]).action == "promote"
    assert controller.status()[0]["state"] == "promoted"
    assert deployments.canaries == {} and {deployments.route("smol").version for _ in range(8)} == {"v2"}


@on_loop
async def test_without_auto_the_decision_is_only_reported():
    deployments, controller = setup(RolloutSpec(min_requests=1, auto=False))
    controller.start_rollout("smol")
    controller.observe(record("v2", status="failed"))
    assert controller.evaluate(controller.rollouts["smol"]).action == "rollback"
    assert controller.status("smol")[0]["state"] == "running" and "smol" in deployments.canaries
    controller.rollback("smol")
    assert controller.status("smol")[0]["decision"]["by"] == "operator"
    with pytest.raises(KeyError, match="no canary for 'other'"):
        controller.start_rollout("other")


SPEC = """
deployments:
  - name: smol
    model: {source: default}
    price: {input_usd_per_mtok: 1.0}
  - name: smol
    version: v2
    role: canary
    model: {source: default}
    rollout: {probes: PROBES}
"""


def test_the_spec_checks_a_canary_s_probe_set_and_price(tmp_path):
    from inferd.control.spec import SpecError, load_spec
    probes, config = tmp_path / "probes.jsonl", tmp_path / "deploy.yaml"
    probes.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "expect": "(?i)hello"}) + "\n")
    config.write_text(SPEC.replace("PROBES", str(probes)))
    assert load_spec(config).deployments[1].rollout.probes == str(probes)
    probes.write_text('{"messages": [{"role": "user", "content": "Hi"}]}\n')
    with pytest.raises(SpecError, match=r"deployments\[1\].rollout.probes: .*line 1: expect must be a regex"):
        load_spec(config)
    config.write_text(SPEC.replace("rollout: {probes: PROBES}", "price: {input_usd_per_mtok: 2.0}"))
    with pytest.raises(SpecError, match=r"deployments\[1\].price: a canary is billed at its name's price"):
        load_spec(config)


def quality(passed: int, n: int = 10) -> dict:
    from inferd.eval.report import tally
    return {"metrics": {"answer": tally([True] * passed + [False] * (n - passed))}}


def test_judge_rolls_back_a_canary_worse_on_the_quality_set_beyond_the_interval():
    stable = stats(*[record("v1")] * 8)
    stable.quality = quality(8)
    canary = stats()  # no traffic yet: quality alone decides a clear regression
    assert judge(POLICY, canary, stable, quality=True).reasons == ["the quality set is still running"]
    canary.quality = quality(0)
    verdict = judge(POLICY, canary, stable, quality=True)
    assert verdict.action == "rollback" and verdict.reasons[0].startswith("quality answer 0% vs 80%: -80% [")
    canary = stats(*[record("v2")] * 4)
    canary.quality = quality(6)  # worse, but within the interval: the other rules decide
    verdict = judge(POLICY, canary, stable, quality=True)
    assert verdict.action == "promote" and "quality answer 60% vs 80%" in verdict.reasons[-1]
