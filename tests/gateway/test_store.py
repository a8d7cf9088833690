import time

import pytest
from sqlalchemy import inspect, select, text

from inferd.gateway.keys import PREFIX, hash_key, imported_key, lookup_id_of
from inferd.gateway.policy import PolicyError
from inferd.gateway.store import Store, StoreError
from inferd.gateway.tables import api_keys, usage_records
from tests.gateway.services import postgres_url


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'inferd.db'}" if request.param == "sqlite" else postgres_url()
    s = Store(url)
    s.migrate()
    yield s
    s.close()


def usage_row(tenant_id: str, record_id: str, cost: float = 0.5, status: str = "completed") -> dict:
    now = time.time()
    return dict(record_id=record_id, request_id="req", attempt=1, tenant_id=tenant_id, key_id=None, model="m",
                deployment_version="v1", replica="r0", priority_class="interactive", status=status,
                http_status=200, error_code=None, prompt_tokens=10, cached_tokens=4, completion_tokens=5,
                queue_s=0.0, ttft_s=0.1, e2e_s=0.2, cost_usd=cost, started_unix_s=now, ended_unix_s=now,
                gateway_id="gw")


def test_migrate_is_idempotent_and_keeps_data(store):
    store.create_tenant("acme", limits={"tpm": 100})
    store.migrate()
    assert store.tenant("acme").limits.tpm == 100
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == "0008"
    assert {"tenants", "api_keys", "usage_records", "console_users"} <= set(inspect(store.engine).get_table_names())


def test_a_store_of_the_first_schema_upgrades_with_its_usage_records(tmp_path):
    old = Store(f"sqlite:///{tmp_path / 'old.db'}")
    old.migrate("0001")
    row = {"record_id": "r1", "request_id": "q1", "attempt": 1, "model": "m", "status": "completed",
           "http_status": 200, "prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": 4, "e2e_s": 0.1,
           "cost_usd": 0.0, "started_unix_s": 1.0, "ended_unix_s": 2.0, "gateway_id": "gw"}
    with old.engine.begin() as conn:
        conn.execute(text(f"INSERT INTO usage_records ({', '.join(row)}) VALUES ({', '.join(':' + k for k in row)})"),
                     row)
    old.migrate()
    old.insert_usage([row | {"record_id": "r2", "units": {"observations": 5}}])
    with old.engine.connect() as conn:
        got = conn.execute(text("SELECT record_id, prompt_tokens, units FROM usage_records ORDER BY id")).all()
    assert [(r[0], r[1]) for r in got] == [("r1", 3), ("r2", 3)] and got[0][2] is None and "observations" in got[1][2]


def test_keys_are_stored_only_as_hashes(store):
    store.create_tenant("acme")
    policy, new = store.create_key("acme", "ci", allowed_models=["m"])
    assert new.key.startswith(PREFIX) and len(new.key) > 50
    with store.engine.connect() as conn:
        rows = [dict(r) for r in conn.execute(select(api_keys)).mappings()]
    assert new.key not in repr(rows) and rows[0]["key_hash"] == hash_key(new.key)
    found, stored_hash = store.find_key(lookup_id_of(new.key))
    assert found.tenant.name == "acme" and found.may_use("m") and not found.may_use("other")
    assert store.revoke_key(policy.id) and store.find_key(lookup_id_of(new.key)) is None
    assert not store.revoke_key(policy.id)


def test_imported_keys_are_found_by_their_hash(store):
    store.create_tenant("acme")
    store.create_key("acme", new_key=imported_key("sk-my-own-key"))
    assert store.find_key(lookup_id_of("sk-my-own-key"))[1] == hash_key("sk-my-own-key")


def test_tenant_updates_merge_and_validate(store):
    store.create_tenant("acme", limits={"rpm": 5, "tpm": 100})
    t = store.update_tenant("acme", limits={"tpm": 0, "max_concurrency": 2}, model_limits={"m": {"tpm": 7}},
                            budget_usd=3.0, priority_class="batch")
    assert t.limits.to_dict() == {"rpm": 5, "max_concurrency": 2}
    assert t.model_limits["m"].tpm == 7 and t.budget_usd == 3.0 and t.priority_class == "batch"
    with pytest.raises(PolicyError, match="unknown limit 'tpd'"):
        store.update_tenant("acme", limits={"tpd": 1})
    with pytest.raises(PolicyError, match="priority_class"):
        store.update_tenant("acme", priority_class="urgent")
    with pytest.raises(StoreError, match="already exists"):
        store.create_tenant("acme")
    with pytest.raises(StoreError, match="no tenant"):
        store.create_key("nobody")


def test_usage_insert_skips_replayed_records_and_sums(store):
    t = store.create_tenant("acme")
    store.insert_usage([usage_row(t.id, "a"), usage_row(t.id, "b", status="failed", cost=0.0)])
    store.insert_usage([usage_row(t.id, "a"), usage_row(t.id, "c")])  # "a" again: a replayed spill
    with store.engine.connect() as conn:
        assert conn.execute(select(usage_records.c.record_id)).scalars().all().__len__() == 3
    [row] = store.usage_summary(0, time.time() + 1)
    assert row["tenant"] == "acme" and row["requests"] == 3 and row["completed"] == 2 and row["failed"] == 1
    assert row["prompt_tokens"] == 30 and row["cost_usd"] == pytest.approx(1.0)
    assert store.spent_usd(t.id, 0) == pytest.approx(1.0)


def test_the_consoles_history_buckets_are_replaced_read_back_and_pruned(store):
    b = {"requests": 1}
    store.save_history("gw1", [("m", "v1", 600.0, b), ("m", "v1", 1200.0, b)], before_unix_s=0.0)
    store.save_history("gw1", [("m", "v1", 1200.0, {"requests": 5})], before_unix_s=0.0)  # the same bucket, later
    store.save_history("gw2", [("m", "v1", 1200.0, {"requests": 2})], before_unix_s=0.0)
    rows = [(r["gateway_id"], r["start_unix_s"], r["bucket"]["requests"]) for r in store.history_since(1200.0)]
    assert sorted(rows) == [("gw1", 1200.0, 5), ("gw2", 1200.0, 2)]
    store.save_history("gw2", [], before_unix_s=1000.0)  # every gateway's older buckets go
    assert [r["start_unix_s"] for r in store.history_since(0.0)] == [1200.0, 1200.0]
