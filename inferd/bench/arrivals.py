from dataclasses import dataclass
from typing import Literal

import numpy as np

from inferd.bench.errors import BenchError

ArrivalKind = Literal["poisson", "gamma", "constant", "closed"]


@dataclass(slots=True)
class LoadShape:
    """How requests arrive: open loop at rate_per_s (gamma shape = burstiness; 1 = Poisson) or closed loop."""
    kind: ArrivalKind = "poisson"
    rate_per_s: float = 1.0
    burstiness: float = 1.0
    concurrency: int = 1

    def __post_init__(self):
        if self.kind != "closed" and self.rate_per_s <= 0:
            raise BenchError(f"--rate must be positive (got {self.rate_per_s} requests/s)")
        if self.burstiness <= 0:
            raise BenchError(f"--burstiness must be positive (got {self.burstiness}); 1 is Poisson")
        if self.concurrency < 1:
            raise BenchError(f"--concurrency must be at least 1 (got {self.concurrency})")

    @property
    def open_loop(self) -> bool:
        return self.kind != "closed"

    @property
    def gamma_shape(self) -> float:
        return 1.0 if self.kind == "poisson" else self.burstiness


# intervals

def intervals_s(shape: LoadShape, count: int, rng: np.random.Generator) -> np.ndarray:
    """Gaps between arrivals: mean 1/rate; gamma's coefficient of variation is 1/sqrt(shape)."""
    assert shape.open_loop
    if shape.kind == "constant":
        return np.full(count, 1.0 / shape.rate_per_s)
    k = shape.gamma_shape
    return rng.gamma(k, 1.0 / (shape.rate_per_s * k), size=count)


def arrival_offsets_s(shape: LoadShape, count: int, seed: int) -> list[float]:
    """Send offsets from the run's start for count requests; the first goes at 0."""
    gaps = intervals_s(shape, max(count - 1, 0), np.random.default_rng(seed))
    return [0.0, *np.cumsum(gaps).tolist()][:count]


def arrival_offsets_within_s(shape: LoadShape, duration_s: float, seed: int) -> list[float]:
    """Send offsets of every arrival before duration_s."""
    rng, offsets, now_s = np.random.default_rng(seed), [0.0], 0.0
    while True:
        for gap in intervals_s(shape, int(shape.rate_per_s * duration_s) + 16, rng):
            now_s += float(gap)
            if now_s >= duration_s:
                return offsets
            offsets.append(now_s)
