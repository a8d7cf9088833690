"""Daily usage rollups: what Store.insert_usage adds to usage_daily in the transaction that inserts the records,
and the report read from them (per day, tenant, model and priority class) in time independent of how many
records the store holds."""
from collections import defaultdict
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite

from inferd.gateway.tables import tenants, usage_daily

DAY_S = 86400
STATUSES = ("completed", "failed", "cancelled", "rejected", "expired")
SUMS = ("requests", *STATUSES, "prompt_tokens", "cached_tokens", "completion_tokens", "cost_usd")


def day_of(unix_s: float) -> int:
    """UTC days since 1970-01-01."""
    return int(unix_s // DAY_S)


def add(conn: Any, records: list[dict]) -> None:
    """Add these (just inserted) records to their days' rollup rows: one upsert per group."""
    groups: dict[tuple, dict[str, float]] = defaultdict(lambda: dict.fromkeys(SUMS, 0))
    for r in records:
        g = groups[(day_of(r["ended_unix_s"]), r.get("tenant_id") or "", r["model"], r.get("priority_class") or "")]
        g["requests"] += 1
        if r["status"] in STATUSES:
            g[r["status"]] += 1
        for k in ("prompt_tokens", "cached_tokens", "completion_tokens", "cost_usd"):
            g[k] += r.get(k) or 0
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    rows = [dict(zip(("day", "tenant_id", "model", "priority_class"), key)) | sums for key, sums in
            sorted(groups.items())]  # in key order: two gateways upserting the same rows cannot deadlock
    statement = dialect.insert(usage_daily)
    conn.execute(statement.on_conflict_do_update(
        index_elements=["day", "tenant_id", "model", "priority_class"],
        set_={k: usage_daily.c[k] + statement.excluded[k] for k in SUMS}), rows)


def report(conn: Any, since_day: int, until_day: int, tenant_name: str | None = None) -> list[dict]:
    """Rows per day, tenant, model and priority class for days since_day <= day < until_day, newest first."""
    d = usage_daily
    query = (select(d.c.day, func.coalesce(tenants.c.name, d.c.tenant_id).label("tenant"), d.c.model,
                    d.c.priority_class, *(d.c[k] for k in SUMS))
             .select_from(d.outerjoin(tenants, tenants.c.id == d.c.tenant_id))
             .where(d.c.day >= since_day, d.c.day < until_day)
             .order_by(d.c.day.desc(), "tenant", d.c.model, d.c.priority_class))
    if tenant_name is not None:
        query = query.where(tenants.c.name == tenant_name)
    result = conn.execute(query)
    names = tuple(result.keys())
    return [dict(zip(names, row)) for row in result]  # about 1.5x faster than .mappings() at 12,400 rows


def spent_since(conn: Any, since_day: int) -> dict[str, float]:
    """Cost per tenant id from the start of since_day on."""
    d = usage_daily
    query = select(d.c.tenant_id, func.sum(d.c.cost_usd)).where(d.c.day >= since_day).group_by(d.c.tenant_id)
    return {tenant_id: float(cost or 0.0) for tenant_id, cost in conn.execute(query)}
