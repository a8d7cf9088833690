"""The degradation ladder: what a deployment gives up, step by step, under sustained overload.

Overloaded means the oldest request in the deployment's queue has waited overload_queue_age_ms. Each
sustain_s of overload climbs one step of the configured ladder; each sustain_s without overload steps
back down one. The steps (in the order the deployment lists them):

- reject_late: a request whose deadline falls before the queue could start it is refused at once
  (503 deadline_unmeetable, Retry-After) instead of waiting to expire;
- cap_max_tokens: max_tokens is lowered to the step's cap;
- route: requests (of one priority class, or all) go to a smaller deployment.

Every degraded response carries `x-inferd-degraded: <actions>`, and the gateway counts them.
"""
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from inferd.protocol.headers import DEGRADED

DEGRADE_ACTIONS = ("reject_late", "cap_max_tokens", "route")


@dataclass(slots=True)
class DegradationStep:
    action: str  # reject_late | cap_max_tokens | route
    max_tokens: int | None = None  # cap_max_tokens: the cap
    priority_class: str | None = None  # route: requests of this class (None: all)
    to: str | None = None  # route: the (smaller) deployment that takes them


@dataclass(slots=True)
class DegradationSpec:
    """Under sustained overload, climb these steps in order; each degraded response says so."""
    steps: list[DegradationStep]
    overload_queue_age_ms: float = 2000.0  # overloaded: the oldest queued request is this old ...
    sustain_s: float = 5.0  # ... for this long; each further sustain_s climbs one more step


class Degrader:
    def __init__(self, spec: DegradationSpec, now: float | None = None):
        self.spec = spec
        self.level = 0  # steps in force: spec.steps[:level]
        self._overloaded = False
        self._mark = time.monotonic() if now is None else now  # when the state began, or last moved the level

    def update(self, oldest_age_s: float, now: float | None = None) -> list[DegradationStep]:
        """The steps in force, given the age of the oldest queued request now."""
        now = time.monotonic() if now is None else now
        overloaded = oldest_age_s * 1000 >= self.spec.overload_queue_age_ms
        if overloaded != self._overloaded:
            self._overloaded, self._mark = overloaded, now
        if now - self._mark >= self.spec.sustain_s:
            moved = min(self.level + 1, len(self.spec.steps)) if overloaded else max(self.level - 1, 0)
            if moved != self.level:
                self.level, self._mark = moved, now
        return self.spec.steps[:self.level]


@dataclass(slots=True)
class Degradation:
    """What the ladder did to one request."""
    actions: list[str] = field(default_factory=list)
    max_tokens: int | None = None  # the cap, when cap_max_tokens applies
    route_to: str | None = None  # the deployment that takes it, when route applies
    reject: bool = False  # reject_late: it cannot meet its deadline

    @property
    def header(self) -> dict[str, str]:
        return {DEGRADED: ",".join(self.actions)} if self.actions else {}


def degrade(steps: list[DegradationStep], priority_class: str, seconds_left: float | None,
            expected_wait_s: float, max_output_tokens: int,
            may_use: Callable[[str], bool] = lambda name: True) -> Degradation:
    """Apply the steps in force to one request: its class, the seconds left before its deadline (None: no
    deadline), the output tokens it may make per choice, and which deployments its key may use."""
    out = Degradation()
    for step in steps:
        if step.action == "reject_late":
            if seconds_left is not None and expected_wait_s > seconds_left:
                out.reject = True
                out.actions.append("reject_late")
                return out
        elif step.action == "cap_max_tokens" and step.max_tokens < min(max_output_tokens, out.max_tokens or 1 << 62):
            out.max_tokens = step.max_tokens
            if "cap_max_tokens" not in out.actions:
                out.actions.append("cap_max_tokens")
        elif step.action == "route" and step.priority_class in (None, priority_class) and out.route_to is None \
                and may_use(step.to):
            out.route_to = step.to
            out.actions.append(f"route:{step.to}")
    return out
