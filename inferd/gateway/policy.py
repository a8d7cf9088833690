"""What a tenant or key may do: limits, model access, class, budget. Plain data, validated once."""
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from inferd.protocol.headers import PRIORITY_CLASSES

BUDGET_PERIODS = ("day", "month")


class PolicyError(ValueError):
    """A setting that cannot be honoured; the message names the field."""


@dataclass(slots=True, frozen=True)
class Limits:
    """None = unlimited. Token limits count input + output in the model's tokens."""
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    max_sessions: int | None = None  # robot policy sessions open at once (per gateway)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, where: str = "limits") -> "Limits":
        raw = raw or {}
        names = {f.name for f in fields(cls)}
        for key, value in raw.items():
            if key not in names:
                raise PolicyError(f"{where}: unknown limit '{key}' (known: {', '.join(sorted(names))})")
            if value is not None and (type(value) is not int or value < 1):
                raise PolicyError(f"{where}.{key}: must be a positive integer, got {value!r}")
        return cls(**raw)

    def to_dict(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def merged(self, changes: dict[str, Any]) -> "Limits":
        """These limits with `changes` applied; a value of 0 removes that limit."""
        raw = self.to_dict() | {k: v for k, v in changes.items() if v is not None}
        return Limits.from_dict({k: v for k, v in raw.items() if v != 0})


@dataclass(slots=True, frozen=True)
class TenantPolicy:
    id: str
    name: str
    weight: float = 1.0
    priority_class: str = "interactive"
    default_deadline_ms: int | None = None
    queue_share: float = 0.5
    limits: Limits = field(default_factory=Limits)
    model_limits: dict[str, Limits] = field(default_factory=dict)
    allowed_models: tuple[str, ...] | None = None
    budget_usd: float | None = None
    budget_period: str = "month"
    batch_queued_tokens: int | None = None  # its batch lines' and async jobs' not yet run (None: the gateway's)

    def __post_init__(self):
        check_priority_class(self.priority_class, "priority_class")
        if self.weight <= 0:
            raise PolicyError(f"weight: must be above 0, got {self.weight}")
        if not 0 < self.queue_share <= 1:
            raise PolicyError(f"queue_share: must be in (0, 1], got {self.queue_share}")
        if self.budget_period not in BUDGET_PERIODS:
            raise PolicyError(f"budget_period: must be one of {', '.join(BUDGET_PERIODS)}")
        if self.batch_queued_tokens is not None and self.batch_queued_tokens < 0:
            raise PolicyError(f"batch_queued_tokens: must be at least 0, got {self.batch_queued_tokens}")
        if self.budget_usd is not None and self.budget_usd < 0:
            raise PolicyError(f"budget_usd: must be at least 0, got {self.budget_usd}")
        if self.default_deadline_ms is not None and self.default_deadline_ms < 1:
            raise PolicyError(f"default_deadline_ms: must be a positive integer, got {self.default_deadline_ms}")


@dataclass(slots=True, frozen=True)
class KeyPolicy:
    id: str
    tenant: TenantPolicy
    name: str = ""
    limits: Limits = field(default_factory=Limits)
    allowed_models: tuple[str, ...] | None = None
    priority_class: str | None = None
    from_token: bool = False  # an identity provider's access token (gateway/oidc.py), not a stored key

    def may_use(self, model: str) -> bool:
        return all(allowed is None or model in allowed for allowed in (self.tenant.allowed_models,
                                                                       self.allowed_models))

    @property
    def effective_class(self) -> str:
        return self.priority_class or self.tenant.priority_class


def check_priority_class(value: str, where: str) -> str:
    if value not in PRIORITY_CLASSES:
        raise PolicyError(f"{where}: must be one of {', '.join(PRIORITY_CLASSES)}, got {value!r}")
    return value
