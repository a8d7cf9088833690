"""The progress of a long step (a model's tensors loaded): log lines, which the process's log format carries (a
start, every STEP_PERCENT, done with its duration), and tqdm's bar only where stderr is a terminal; on a
terminal the bar shows the steps. Never a bar in a stream a machine reads (JSON log lines)."""
import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger(__name__)

STEP_PERCENT = 10


class Progress:
    """with Progress("loading tensors", total, "tensor", enabled) as p: ... p.update() per item."""

    def __init__(self, what: str, total: int, unit: str, enabled: bool = True):
        self.what, self.total, self.unit, self.enabled = what, total, unit, enabled
        self.done, self.logged_percent = 0, 0
        self.bar = tqdm(total=total, desc=what, unit=unit) if enabled and sys.stderr.isatty() else None
        self.started_s = time.monotonic()

    def __enter__(self) -> "Progress":
        if self.enabled:
            log.info("%s: %d %ss", self.what, self.total, self.unit, extra={"percent": 0})
        return self

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        percent = self.done * 100 // max(self.total, 1) // STEP_PERCENT * STEP_PERCENT
        if self.enabled and self.logged_percent < percent < 100:
            self.logged_percent = percent
            log.info("%s: %d%%", self.what, percent, extra={"percent": percent})

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.enabled and exc_type is None:
            duration_s = time.monotonic() - self.started_s
            log.info("%s: done, %d %ss in %.1f s", self.what, self.done, self.unit, duration_s,
                     extra={"percent": 100, "duration_s": round(duration_s, 3)})
