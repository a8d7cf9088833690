"""Daily usage rollups: kept by insert_usage in the same transaction as the records, filled by migration 0004
from the records already stored, and equal to a scan of the records."""
import pytest
from sqlalchemy import insert, text

from inferd.gateway.rollups import DAY_S
from inferd.gateway.store import Store
from inferd.gateway.tables import usage_records
from tests.gateway.services import postgres_url
from tests.gateway.test_store import usage_row


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'inferd.db'}" if request.param == "sqlite" else postgres_url()
    s = Store(url)
    s.migrate()
    yield s
    s.close()


def rows_on(day: int, n: int, tenant_id: str, prefix: str, **fields) -> list[dict]:
    at = day * DAY_S + 3600.0
    return [usage_row(tenant_id, f"{prefix}{i}") | {"ended_unix_s": at, "started_unix_s": at - 1} | fields
            for i in range(n)]


def test_rollups_count_each_record_once_per_day_tenant_model_and_class(store):
    acme = store.create_tenant("acme").id
    store.insert_usage(rows_on(20000, 3, acme, "a") + rows_on(20001, 2, acme, "b", status="rejected"))
    store.insert_usage(rows_on(20001, 2, acme, "b") + rows_on(20001, 1, acme, "c", priority_class="batch"))
    days = store.usage_daily(0, 30000 * DAY_S)
    got = {(r["day"], r["priority_class"]): (r["requests"], r["completed"], r["rejected"], r["prompt_tokens"],
                                             r["cost_usd"]) for r in days}
    assert got == {(20001, "interactive"): (2, 0, 2, 20, 1.0), (20001, "batch"): (1, 1, 0, 10, 0.5),
                   (20000, "interactive"): (3, 3, 0, 30, 1.5)}  # the replayed b0, b1 counted once
    assert {r["tenant"] for r in days} == {"acme"}
    assert store.spent_by_tenant(20001 * DAY_S + 5) == {acme: 1.5}
    assert [r["day"] for r in store.usage_daily(20001 * DAY_S, 20002 * DAY_S)] == [20001, 20001]


def test_rollups_agree_with_a_scan_of_the_records(store):
    acme, bolt = store.create_tenant("acme").id, store.create_tenant("bolt").id
    store.insert_usage(rows_on(20000, 5, acme, "a") + rows_on(20000, 4, bolt, "b", model="n", cost_usd=0.25)
                       + rows_on(20002, 3, acme, "c", status="failed"))
    scan = {(r["tenant"], r["model"]): (r["requests"], r["failed"], r["completion_tokens"], r["cost_usd"])
            for r in store.usage_summary(0, 30000 * DAY_S)}
    summed: dict = {}
    for r in store.usage_daily(0, 30000 * DAY_S):
        old = summed.get((r["tenant"], r["model"]), (0, 0, 0, 0.0))
        summed[(r["tenant"], r["model"])] = tuple(a + b for a, b in zip(old, (r["requests"], r["failed"],
                                                                             r["completion_tokens"], r["cost_usd"])))
    assert summed == scan


def test_migration_0004_rolls_up_the_records_already_stored(tmp_path):
    old = Store(f"sqlite:///{tmp_path / 'old.db'}")
    old.migrate("0002")
    with old.engine.begin() as conn:
        conn.execute(insert(usage_records), rows_on(20000, 3, "ten_x", "a") + rows_on(20001, 1, "", "b"))
    old.migrate()
    got = [(r["day"], r["tenant"], r["requests"], r["completed"], r["prompt_tokens"]) for r in
           old.usage_daily(0, 30000 * DAY_S)]
    assert got == [(20001, "", 1, 1, 10), (20000, "ten_x", 3, 3, 30)]
    with old.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM audit_log")).scalar_one() == 0


def test_changes_to_tenants_and_keys_are_audited_with_their_actor(store):
    store.create_tenant("acme", budget_usd=5.0, actor="cli:ops")
    policy, new = store.create_key("acme", "ci", actor="console:admin@127.0.0.1")
    store.revoke_key(policy.id, actor="admin-api@10.0.0.1")
    assert not store.revoke_key(policy.id, actor="admin-api@10.0.0.1")  # nothing changed: nothing audited
    got = [(a["actor"], a["action"], a["target"]) for a in store.audit()]
    assert got == [("admin-api@10.0.0.1", "key.revoke", policy.id), ("console:admin@127.0.0.1", "key.create",
                   policy.id), ("cli:ops", "tenant.create", "acme")]
    assert store.audit()[2]["detail"] == {"budget_usd": 5.0}
    assert new.key not in str(store.audit())


def test_budget_watch_reads_each_budgeted_tenants_spend_this_period(store):
    """BudgetWatch's figures for /metrics: the budget, the spend since the period's start, the period's end; a
    tenant with no budget, or past the metrics' tenant label budget, is left out."""
    from inferd.gateway.charges import BudgetWatch
    from inferd.telemetry.gateway_metrics import LabelBudget
    day_tenant = store.create_tenant("daily", budget_usd=10.0, budget_period="day").id
    month_tenant = store.create_tenant("monthly", budget_usd=100.0, budget_period="month").id
    store.create_tenant("unbudgeted")
    now = 19997 * DAY_S + 7200.0  # 1 Oct 2024, 02:00 UTC; each record costs 0.5
    store.insert_usage(rows_on(19997, 2, day_tenant, "d") + rows_on(19996, 3, day_tenant, "y")
                       + rows_on(19996, 4, month_tenant, "m") + rows_on(19997, 1, month_tenant, "o"))
    rows = BudgetWatch(store, LabelBudget(100)).read(now)
    assert rows == [(day_tenant, "daily", 10.0, 1.0, 19998 * DAY_S),  # yesterday's 1.5 was another period
                    (month_tenant, "monthly", 100.0, 0.5, (19997 + 31) * DAY_S)]  # and 30 Sep another month
    watch = BudgetWatch(store, LabelBudget(1))
    watch._rows = rows
    budget = next(f for f in watch.collect() if f.name == "inferd_tenant_budget_usd")
    assert [s.labels for s in budget.samples] == [{"tenant": day_tenant, "tenant_name": "daily"}]  # the other: 'other'
