"""What a request is charged against before it runs: rate limits, concurrency and budgets, in one place."""
import asyncio
import calendar
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from inferd.gateway import admission
from inferd.gateway.limits import Charge, RateLimited, ratelimit_headers, retry_after_header
from inferd.gateway.policy import KeyPolicy, Limits
from inferd.gateway.store import UNAVAILABLE, Store
from inferd.protocol.errors import APIError, InvalidRequest, Overloaded, RateLimitExceeded, ServiceUnavailable
from inferd.telemetry.gateway_metrics import OTHER, gauge

log = logging.getLogger(__name__)
BUDGET_READ_S = 60.0  # how often BudgetWatch reads the tenants' budgets and spend from the store

LIMIT_MESSAGES = {
    "requests_per_minute": "requests per minute", "tokens_per_minute": "tokens per minute",
    "max_concurrency": "concurrent requests", "budget": "budget (USD)",
}


@dataclass(slots=True)
class Plan:
    """What one attempt may cost at most, known before it runs, and the body it sends."""
    prompt_tokens: int
    max_output_tokens: int  # per choice
    num_outputs: int  # prompts × n
    cost_usd: float
    body: dict | None  # what the upstream gets (None: the client's body, byte for byte)
    stream: bool
    usage_mode: str = "none"  # what the client asked of a stream: none, final (include_usage) or continuous
    prompt_ids: list[int] = field(default_factory=list)  # the (first) prompt's tokens, for the router
    path: str | None = None  # the replica's path, when not the operation's (the model named in it: /v2/...)

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_tokens + self.max_output_tokens * self.num_outputs


class Charges:
    """The charges of one request: per-scope limits from the key's policy, and the tenant's budget, whose
    spend so far is read from the store once per budget period (a store that cannot be read then refuses the
    request 503 `store_unavailable`: a budget is never spent blind)."""

    def __init__(self, store: Store):
        self.store = store
        self._spent: dict[tuple[str, float], float] = {}

    async def of(self, key: KeyPolicy, model: str, plan: Plan) -> list[Charge]:
        out = limit_charges(key, model, plan.reserved_tokens)
        tenant = key.tenant
        if tenant.budget_usd is not None:
            start, end = budget_period(tenant.budget_period, time.time())
            spent = self._spent.get((tenant.id, start))
            if spent is None:
                try:
                    spent = await asyncio.to_thread(self.store.spent_usd, tenant.id, start)
                except UNAVAILABLE:
                    raise ServiceUnavailable("The store is unavailable and your tenant's budget spend is not known "
                                             "yet on this gateway; retry shortly.", code="store_unavailable",
                                             headers={"retry-after": "1"}) from None
                self._spent[(tenant.id, start)] = spent
            out.append(Charge(f"{tenant.id}:budget:{int(start)}", "budget", "budget", "tenant", tenant.budget_usd,
                              plan.cost_usd, end, spent))
        return out


class BudgetWatch:
    """Each budgeted tenant's budget, its spend this period and the period's end, read from the store every
    BUDGET_READ_S (the spend of every gateway's records, so each gateway exports the same figure), for /metrics:
    with the cost counters' rate they tell how soon a budget runs out (the InferdTenantBudgetBurning alert).
    The tenant label is the cost counters' (the tenant's id, within the gateway's tenant label budget)."""

    def __init__(self, store: Store, tenant_label):
        self.store, self.tenant_label = store, tenant_label
        self._rows: list[tuple[str, str, float, float, float]] = []  # (id, name, budget, spent, period end)
        self._task: asyncio.Task | None = None

    async def start(self, gateway) -> None:
        self._task = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _watch(self) -> None:
        while True:
            try:
                self._rows = await asyncio.to_thread(self.read, time.time())
            except UNAVAILABLE as exc:  # the figures read last stay
                log.warning("tenants' budgets not read from the store: %s", exc)
            await asyncio.sleep(BUDGET_READ_S)

    def read(self, now_unix_s: float) -> list[tuple[str, str, float, float, float]]:
        rows, spent = [], {}
        for t in self.store.tenants():
            if t.budget_usd is None:
                continue
            start, end = budget_period(t.budget_period, now_unix_s)
            if start not in spent:
                spent[start] = self.store.spent_by_tenant(start)
            rows.append((t.id, t.name, t.budget_usd, spent[start].get(t.id, 0.0), end))
        return rows

    def collect(self):
        labels = ["tenant", "tenant_name"]
        budget = gauge("inferd_tenant_budget_usd", "A tenant's budget for its period.", labels)
        spent = gauge("inferd_tenant_budget_spent_usd", "A budgeted tenant's spend this period, from the store.",
                      labels)
        end = gauge("inferd_tenant_budget_period_end_timestamp_seconds", "When a budgeted tenant's period ends.",
                    labels)
        for tenant_id, name, budget_usd, spent_usd, end_s in self._rows:
            if (label := self.tenant_label(tenant_id)) == OTHER:  # on the loop, as the cost counters' labels
                continue
            budget.add_metric([label, name], budget_usd)
            spent.add_metric([label, name], spent_usd)
            end.add_metric([label, name], end_s)
        yield from (budget, spent, end)


def limit_charges(key: KeyPolicy, model: str, tokens: int) -> list[Charge]:
    tenant = key.tenant
    scopes = [("tenant", tenant.id, tenant.limits), ("key", key.id, key.limits)]
    if model in tenant.model_limits:
        scopes.append(("model", f"{tenant.id}:model:{model}", tenant.model_limits[model]))
    out = []
    for scope, sid, lim in scopes:
        if lim.rpm:
            out.append(Charge(f"{sid}:rpm", "rate", "requests_per_minute", scope, lim.rpm, 1))
        if lim.tpm:
            out.append(Charge(f"{sid}:tpm", "rate", "tokens_per_minute", scope, lim.tpm, tokens))
        if lim.max_concurrency:
            out.append(Charge(f"{sid}:concurrency", "concurrency", "max_concurrency", scope, lim.max_concurrency, 1))
    return out


def request_charges(key: KeyPolicy, model: str) -> list[Charge]:
    """The charges counted in requests (rate and concurrency), known before the prompt is tokenized."""
    return [c for c in limit_charges(key, model, 0) if c.name != "tokens_per_minute"]


def actual_amounts(charges: list[Charge], tokens: int, cost_usd: float) -> dict[str, float]:
    """What settling a reservation counts: the tokens and cost the request really used."""
    return {c.key: tokens if c.name == "tokens_per_minute" else cost_usd
            for c in charges if c.name in ("tokens_per_minute", "budget")}


def budget_period(period: str, now_unix_s: float) -> tuple[float, float]:
    """[start, end) of the budget period holding now, in UTC."""
    now = datetime.fromtimestamp(now_unix_s, timezone.utc)
    if period == "day":
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return start.timestamp(), start.timestamp() + 86400
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    days = calendar.monthrange(start.year, start.month)[1]
    return start.timestamp(), start.timestamp() + days * 86400


def check_request_limits(key: KeyPolicy, model: str, prompt_tokens: int, requested_output: int | None,
                         param: str, unit: str = "tokens") -> int | None:
    """Raises if the request is bigger than allowed; returns the output cap to apply (None: no cap). A
    classical request's rows count as its input tokens (unit "rows")."""
    scopes: list[Limits] = [key.tenant.limits, key.limits, key.tenant.model_limits.get(model, Limits())]
    max_in = min((s.max_input_tokens for s in scopes if s.max_input_tokens), default=None)
    max_out = min((s.max_output_tokens for s in scopes if s.max_output_tokens), default=None)
    if max_in is not None and prompt_tokens > max_in:
        what = "The prompt has" if unit == "tokens" else "The request has"
        raise InvalidRequest(f"{what} {prompt_tokens} {unit}; your limit is {max_in} input {unit} per request.",
                             param=param, code="max_input_tokens")
    if max_out is not None and requested_output is not None and requested_output > max_out:
        raise InvalidRequest(f"max_tokens is {requested_output}; your limit is {max_out} output tokens per "
                             "request.", param="max_tokens", code="max_output_tokens")
    return max_out


# refusals as API errors

def rate_limited(exc: RateLimited) -> RateLimitExceeded:
    c = exc.charge
    what = LIMIT_MESSAGES.get(c.name, c.name)
    headers = ratelimit_headers(exc.states)
    if exc.retry_after_s is None:
        return RateLimitExceeded(f"This request needs {c.amount:g} against a {c.scope} limit of {c.limit:g} "
                                 f"{what}; it can never fit. Lower max_tokens or the prompt.",
                                 code=f"{c.name}_request_too_large", headers=headers)
    headers["retry-after"] = retry_after_header(exc.retry_after_s)
    return RateLimitExceeded(f"Rate limit reached for {what} ({c.scope} limit {c.limit:g}). "
                             f"Retry after {exc.retry_after_s:.1f} s.", code=c.name, headers=headers)


def queue_rejected(exc: admission.QueueRejected) -> APIError:
    headers = {"retry-after": retry_after_header(exc.retry_after_s)}
    if exc.reason == "tenant_queue_share":
        return RateLimitExceeded("Your share of this model's queue is full; retry later.",
                                 code="tenant_queue_share", headers=headers)
    return Overloaded("The model's queue is full; retry later.", code=exc.reason, headers=headers)
