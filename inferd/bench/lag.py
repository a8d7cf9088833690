import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from inferd.bench.errors import ClientLagExceeded

PROBE_INTERVAL_S = 0.01


@dataclass(slots=True)
class LagMonitor:
    """How late the client's own event loop wakes up: a 10 ms sleep, measured over and over."""
    interval_s: float = PROBE_INTERVAL_S
    lags_ms: list[float] = field(default_factory=list)

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.lags_ms.append((time.perf_counter() - start - self.interval_s) * 1e3)

    def summary(self) -> dict[str, float | int]:
        lags = np.asarray(self.lags_ms or [0.0])
        return {"probes": len(self.lags_ms), "mean_ms": float(lags.mean()), "p99_ms": float(np.percentile(lags, 99)),
                "max_ms": float(lags.max())}


def check_lag(summary: dict[str, float | int], max_lag_ms: float) -> None:
    """Refuses a run whose client lag p99 is over the bound: its timestamps are not the server's."""
    if summary["p99_ms"] > max_lag_ms:
        raise ClientLagExceeded(
            f"the bench client's event loop lagged {summary['p99_ms']:.1f} ms at p99 (max {summary['max_ms']:.1f} ms), "
            f"over the bound of {max_lag_ms:g} ms: its latencies would include its own delay, so no report is "
            "written. Give the client a free CPU core (or another machine), lower the load, or raise "
            "--max-client-lag-ms if that error is acceptable.")
