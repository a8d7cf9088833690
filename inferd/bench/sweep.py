import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import httpx

from inferd.bench.arrivals import LoadShape
from inferd.bench.errors import BenchError, ClientLagExceeded
from inferd.bench.lag import check_lag
from inferd.bench.runner import RunConfig, RunResult, run_load
from inferd.bench.stats import SLO, slo_holds
from inferd.bench.workloads import BenchRequest

log = logging.getLogger(__name__)

RequestsFor = Callable[[RunConfig, int], list[BenchRequest]]  # (config of the step, step number) → requests


@dataclass(slots=True)
class SweepConfig:
    """Rates to try: the given list, else start × factor^k until the SLO breaks; then bisect."""
    slo: SLO
    rates_per_s: list[float] = field(default_factory=list)
    start_rate_per_s: float = 0.5
    rate_factor: float = 2.0
    max_steps: int = 8
    bisect_steps: int = 2
    max_failure_ratio: float = 0.01

    def __post_init__(self):
        if not self.slo.given:
            raise BenchError("a sweep needs an SLO to test against: --slo ttft_ms=...,tpot_ms=...,e2e_ms=...")
        if not self.rates_per_s and (self.start_rate_per_s <= 0 or self.rate_factor <= 1):
            raise BenchError("--start-rate must be positive and --rate-factor above 1")

    def ramp(self) -> list[float]:
        return sorted(self.rates_per_s) or [self.start_rate_per_s * self.rate_factor ** k
                                            for k in range(self.max_steps)]


@dataclass(slots=True)
class SweepPoint:
    rate_per_s: float
    holds: bool
    result: RunResult
    refused: str | None = None  # why the step's timings cannot be trusted (client lag); never a capacity


@dataclass(slots=True)
class SweepResult:
    points: list[SweepPoint]

    @property
    def capacity_rate_per_s(self) -> float | None:
        """The highest rate that holds below the lowest rate that does not."""
        broken = min((p.rate_per_s for p in self.points if not (p.holds or p.refused)), default=float("inf"))
        held = [p.rate_per_s for p in self.points if p.holds and p.rate_per_s < broken]
        return max(held, default=None)

    def verdict(self) -> str:
        cap, refused = self.capacity_rate_per_s, [p for p in self.points if p.refused]
        if refused:
            return (f"capacity: at least {cap or 0:.3g} req/s, not bracketed: the client lagged at "
                    f"{refused[0].rate_per_s:.3g} req/s ({refused[0].refused})")
        if cap is None:
            return "capacity: the SLO did not hold at any rate tried; lower --start-rate or relax --slo"
        if all(p.holds for p in self.points):
            return (f"capacity: at least {cap:.3g} req/s, not bracketed: the SLO held at every rate tried; "
                    "raise --max-steps")
        return f"capacity: {cap:.3g} req/s"


# running

async def sweep(client: httpx.AsyncClient, base: RunConfig, config: SweepConfig,
                requests_for: RequestsFor) -> SweepResult:
    result = SweepResult([])
    for rate in config.ramp():
        point = await _step(client, base, config, requests_for, rate, len(result.points))
        result.points.append(point)
        if point.refused:
            return _sorted(result)
        if not point.holds:
            break
    await _bisect(client, base, config, requests_for, result)
    return _sorted(result)


def _sorted(result: SweepResult) -> SweepResult:
    result.points.sort(key=lambda p: p.rate_per_s)
    return result


async def _bisect(client: httpx.AsyncClient, base: RunConfig, config: SweepConfig, requests_for: RequestsFor,
                  result: SweepResult) -> None:
    for _ in range(config.bisect_steps):
        low = result.capacity_rate_per_s
        high = min((p.rate_per_s for p in result.points if not p.holds), default=None)
        if low is None or high is None:
            return
        point = await _step(client, base, config, requests_for, (low + high) / 2, len(result.points))
        result.points.append(point)
        if point.refused:
            return


async def _step(client: httpx.AsyncClient, base: RunConfig, config: SweepConfig, requests_for: RequestsFor,
                rate: float, step: int) -> SweepPoint:
    step_config = replace(base, load=LoadShape(base.load.kind, rate, base.load.burstiness), seed=base.seed + step)
    run = await run_load(client, step_config, requests_for(step_config, step))
    try:
        check_lag(run.client_lag, base.max_client_lag_ms)
    except ClientLagExceeded as exc:
        log.warning("rate %.3g req/s: refused, the sweep stops here: %s", rate, exc)
        return SweepPoint(rate, False, run, refused=str(exc))
    holds = slo_holds(run.records, config.slo, config.max_failure_ratio)
    log.warning("rate %.3g req/s: %s", rate, "SLO holds" if holds else "SLO broken")
    return SweepPoint(rate, holds, run)
