"""Tenants, keys, usage records (with their daily rollups), console users, the console's History buckets and the
audit log of changes in SQL: an SQLite file by default, PostgreSQL when several gateways share."""
import time
import uuid
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, case, create_engine, delete, event, func, insert, select, update
from sqlalchemy.exc import ArgumentError, IntegrityError, InterfaceError, NoSuchModuleError, OperationalError

from inferd.gateway import rollups
from inferd.gateway.keys import NewKey, generate_key
from inferd.gateway.policy import KeyPolicy, Limits, PolicyError, TenantPolicy, check_priority_class
from inferd.gateway.tables import api_keys, audit_log, console_history, console_users, tenants, usage_records

MIGRATIONS = Path(__file__).parent / "migrations"
TENANT_SETTINGS = ("weight", "priority_class", "default_deadline_ms", "queue_share", "allowed_models",
                   "budget_usd", "budget_period", "batch_queued_tokens")


class StoreError(ValueError):
    """A store operation the caller can fix (unknown tenant, duplicate name)."""


UNAVAILABLE = (OperationalError, InterfaceError)  # the store cannot be reached (down, restarting, refusing)
CONNECT_TIMEOUT_S = 3  # a PostgreSQL that does not answer fails a read within this, instead of hanging it


def default_db_url() -> str:
    home = Path.home() / ".inferd"
    return f"sqlite:///{home / 'inferd.db'}"


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 10})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5,
                         connect_args={"connect_timeout": CONNECT_TIMEOUT_S} if url.startswith("postgresql") else {})


def _sqlite_pragmas(conn: Any, record: Any) -> None:
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA busy_timeout=10000")
    conn.execute("PRAGMA foreign_keys=ON")


class Store:
    def __init__(self, url: str):
        self.url = url
        try:
            self.engine = make_engine(url)
        except (ArgumentError, NoSuchModuleError) as exc:
            raise StoreError(f"{url!r} is not a store URL: {exc}") from None

    def migrate(self, revision: str = "head") -> None:
        """Bring the schema to the newest migration (or `revision`); data already there is kept."""
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        try:
            with self.engine.begin() as conn:
                config.attributes["connection"] = conn
                command.upgrade(config, revision)
        except UNAVAILABLE as exc:
            raise StoreError(f"cannot reach the store {self.engine.url.render_as_string(hide_password=True)}: "
                             f"{str(exc.orig or exc).splitlines()[0]}") from exc

    def close(self) -> None:
        self.engine.dispose()

    # tenants

    def create_tenant(self, name: str, limits: dict | None = None, model_limits: dict | None = None,
                      actor: str = "store", **settings: Any) -> TenantPolicy:
        now = time.time()
        row = {"id": f"ten_{uuid.uuid4().hex[:16]}", "name": name, "created_unix_s": now, "updated_unix_s": now,
               "weight": 1.0, "priority_class": "interactive", "queue_share": 0.5, "budget_period": "month",
               "default_deadline_ms": None, "allowed_models": None, "budget_usd": None, "batch_queued_tokens": None,
               "limits": Limits.from_dict(limits).to_dict(), "model_limits": _model_limits({}, model_limits)}
        row |= _tenant_settings(settings)
        policy = tenant_policy(row)
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(tenants).values(**row))
                _audit(conn, actor, "tenant.create", name, {"limits": limits, "model_limits": model_limits} | settings)
        except IntegrityError:
            raise StoreError(f"a tenant named '{name}' already exists") from None
        return policy

    def update_tenant(self, name: str, limits: dict | None = None, model_limits: dict | None = None,
                      actor: str = "store", **settings: Any) -> TenantPolicy:
        with self.engine.begin() as conn:
            row = self._tenant_row(conn, name)
            row["limits"] = Limits.from_dict(row["limits"]).merged(limits or {}).to_dict()
            row["model_limits"] = _model_limits(row["model_limits"], model_limits)
            row |= _tenant_settings(settings) | {"updated_unix_s": time.time()}
            policy = tenant_policy(row)
            conn.execute(update(tenants).where(tenants.c.id == row["id"]).values(**row))
            _audit(conn, actor, "tenant.update", name, {"limits": limits, "model_limits": model_limits} | settings)
        return policy

    def tenant(self, name: str) -> TenantPolicy:
        with self.engine.connect() as conn:
            return tenant_policy(self._tenant_row(conn, name))

    def tenants(self) -> list[TenantPolicy]:
        with self.engine.connect() as conn:
            return [tenant_policy(dict(r)) for r in conn.execute(select(tenants).order_by(tenants.c.name)).mappings()]

    def _tenant_row(self, conn: Any, name: str) -> dict:
        row = conn.execute(select(tenants).where(tenants.c.name == name)).mappings().first()
        if row is None:
            raise StoreError(f"no tenant named '{name}'")
        return dict(row)

    # keys

    def create_key(self, tenant_name: str, name: str = "", limits: dict | None = None,
                   allowed_models: list[str] | None = None, priority_class: str | None = None,
                   new_key: NewKey | None = None, actor: str = "store") -> tuple[KeyPolicy, NewKey]:
        new = new_key or generate_key()
        if priority_class is not None:
            check_priority_class(priority_class, "priority_class")
        row = {"id": f"key_{new.lookup_id}", "name": name, "lookup_id": new.lookup_id, "key_hash": new.key_hash,
               "limits": Limits.from_dict(limits).to_dict(), "allowed_models": allowed_models,
               "priority_class": priority_class, "created_unix_s": time.time()}
        with self.engine.begin() as conn:
            tenant = self._tenant_row(conn, tenant_name)
            conn.execute(insert(api_keys).values(**row, tenant_id=tenant["id"]))
            _audit(conn, actor, "key.create", row["id"], {"tenant": tenant_name, "name": name, "limits": limits,
                                                          "allowed_models": allowed_models,
                                                          "priority_class": priority_class})
        return key_policy(row, tenant_policy(tenant)), new

    def keys(self, tenant_name: str | None = None) -> list[dict]:
        """Keys without their hashes, newest first."""
        query = (select(api_keys.c.id, api_keys.c.name, api_keys.c.lookup_id, tenants.c.name.label("tenant"),
                        api_keys.c.limits, api_keys.c.allowed_models, api_keys.c.priority_class,
                        api_keys.c.created_unix_s, api_keys.c.revoked_unix_s)
                 .join(tenants).order_by(api_keys.c.created_unix_s.desc()))
        if tenant_name is not None:
            query = query.where(tenants.c.name == tenant_name)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    def revoke_key(self, key_id: str, actor: str = "store") -> bool:
        """Revoke by id (key_...) or lookup id; True if a live key was revoked."""
        lookup = key_id.removeprefix("key_")
        with self.engine.begin() as conn:
            done = conn.execute(update(api_keys).where(api_keys.c.lookup_id == lookup,
                                                       api_keys.c.revoked_unix_s.is_(None))
                                .values(revoked_unix_s=time.time()))
            if done.rowcount > 0:
                _audit(conn, actor, "key.revoke", f"key_{lookup}", None)
        return done.rowcount > 0

    def find_key(self, lookup_id: str) -> tuple[KeyPolicy, str] | None:
        """The live key with this lookup id and its stored hash."""
        return self.find_keys([lookup_id]).get(lookup_id)

    def find_keys(self, lookup_ids: list[str]) -> dict[str, tuple[KeyPolicy, str]]:
        """The live keys among these lookup ids, each with its stored hash, in one query."""
        query = select(api_keys, tenants).join(tenants).where(api_keys.c.lookup_id.in_(lookup_ids),
                                                              api_keys.c.revoked_unix_s.is_(None))
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        found = {}
        for row in rows:
            key = {c.name: row._mapping[c] for c in api_keys.c}
            tenant = {c.name: row._mapping[c] for c in tenants.c}
            found[key["lookup_id"]] = key_policy(key, tenant_policy(tenant)), key["key_hash"]
        return found

    # usage

    def insert_usage(self, records: list[dict]) -> None:
        """Insert records and add them to their daily rollups in the same transaction; ones already stored (same
        record_id, e.g. a replayed spill) are skipped, and counted once."""
        if not records:
            return
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(usage_records), records)
                rollups.add(conn, records)
        except IntegrityError:
            for record in records:
                try:
                    with self.engine.begin() as conn:
                        conn.execute(insert(usage_records).values(**record))
                        rollups.add(conn, [record])
                except IntegrityError:
                    pass

    def spent_usd(self, tenant_id: str, since_unix_s: float) -> float:
        query = select(func.coalesce(func.sum(usage_records.c.cost_usd), 0.0)).where(
            usage_records.c.tenant_id == tenant_id, usage_records.c.ended_unix_s >= since_unix_s)
        with self.engine.connect() as conn:
            return float(conn.execute(query).scalar_one())

    def usage_summary(self, since_unix_s: float, until_unix_s: float, tenant_name: str | None = None,
                      gateway_id: str | None = None) -> list[dict]:
        """Per tenant, model and spend ("batch": batch lines, "async": async jobs, both at the batch price; else
        "interactive")."""
        u = usage_records
        spend = case((u.c.batch_id.is_(None), "interactive"), (u.c.batch_id.like("async_%"), "async"),
                     else_="batch").label("spend")
        query = (select(func.coalesce(tenants.c.name, u.c.tenant_id).label("tenant"), u.c.model, spend,
                        func.count().label("requests"),
                        *(func.sum(_status_is(u, s)).label(s) for s in STATUSES),
                        func.sum(u.c.prompt_tokens).label("prompt_tokens"),
                        func.sum(u.c.cached_tokens).label("cached_tokens"),
                        func.sum(u.c.completion_tokens).label("completion_tokens"),
                        func.sum(u.c.cost_usd).label("cost_usd"))
                 .select_from(u.outerjoin(tenants, tenants.c.id == u.c.tenant_id))
                 .where(u.c.ended_unix_s >= since_unix_s, u.c.ended_unix_s < until_unix_s)
                 .group_by("tenant", u.c.model, "spend").order_by("tenant", u.c.model, "spend"))
        if tenant_name is not None:
            query = query.where(tenants.c.name == tenant_name)
        if gateway_id is not None:
            query = query.where(u.c.gateway_id == gateway_id)
        with self.engine.connect() as conn:
            return [_numbers(dict(r)) for r in conn.execute(query).mappings()]


    def usage_daily(self, since_unix_s: float, until_unix_s: float, tenant_name: str | None = None) -> list[dict]:
        """The daily rollups of the UTC days that overlap [since, until), newest first."""
        with self.engine.connect() as conn:
            return rollups.report(conn, rollups.day_of(since_unix_s), rollups.day_of(until_unix_s - 1e-6) + 1,
                                  tenant_name)

    def spent_by_tenant(self, since_unix_s: float) -> dict[str, float]:
        """Cost per tenant id since the start of the UTC day holding since_unix_s (budget periods start on one)."""
        with self.engine.connect() as conn:
            return rollups.spent_since(conn, rollups.day_of(since_unix_s))

    # console users (their password hashes are made and checked by console/users.py)

    def create_console_user(self, name: str, role: str, password_hash: str, actor: str = "store") -> None:
        now = time.time()
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(console_users).values(name=name, role=role, password_hash=password_hash,
                                                          created_unix_s=now, updated_unix_s=now))
                _audit(conn, actor, "user.create", name, {"role": role})
        except IntegrityError:
            raise StoreError(f"console user {name!r} exists") from None

    def console_user(self, name: str) -> dict | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(console_users).where(console_users.c.name == name)).mappings().first()
        return dict(row) if row else None

    def console_users(self) -> list[dict]:
        """Every console user without the hash."""
        u = console_users
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(select(u.c.name, u.c.role, u.c.created_unix_s, u.c.updated_unix_s)
                                                  .order_by(u.c.name)).mappings()]

    def update_console_user(self, name: str, actor: str = "store", password_hash: str | None = None,
                            role: str | None = None) -> bool:
        """A new password (hash) and/or role; False if there is no such user."""
        changes = {k: v for k, v in (("password_hash", password_hash), ("role", role)) if v is not None}
        with self.engine.begin() as conn:
            done = conn.execute(update(console_users).where(console_users.c.name == name)
                                .values(updated_unix_s=time.time(), **changes)).rowcount
            if done:
                _audit(conn, actor, "user.update", name, {"role": role, "password": "changed" if password_hash
                                                          else None})
        return bool(done)

    def remove_console_user(self, name: str, actor: str = "store") -> bool:
        with self.engine.begin() as conn:
            done = conn.execute(console_users.delete().where(console_users.c.name == name)).rowcount
            if done:
                _audit(conn, actor, "user.remove", name, None)
        return bool(done)

    # audit

    def record_change(self, actor: str, action: str, target: str, detail: dict | None = None) -> None:
        """Audit a change whose state lives outside the store (a rollout start, promotion or rollback)."""
        with self.engine.begin() as conn:
            _audit(conn, actor, action, target, detail)

    # the console's History

    def save_history(self, gateway_id: str, buckets: list[tuple[str, str, float, dict]], before_unix_s: float
                     ) -> None:
        """This gateway's buckets (deployment, version, start, bucket), each replacing its earlier copy; every
        gateway's buckets that started before before_unix_s go."""
        h = console_history.c
        with self.engine.begin() as conn:
            conn.execute(delete(console_history).where(h.start_unix_s < before_unix_s))
            for name, version, start, bucket in buckets:
                conn.execute(delete(console_history).where(h.gateway_id == gateway_id, h.deployment == name,
                                                           h.version == version, h.start_unix_s == start))
            if buckets:
                conn.execute(insert(console_history), [
                    {"gateway_id": gateway_id, "deployment": name, "version": version, "start_unix_s": start,
                     "bucket": bucket} for name, version, start, bucket in buckets])

    def history_since(self, since_unix_s: float) -> list[dict]:
        """Every gateway's buckets that started at or after since_unix_s, oldest first."""
        query = select(console_history).where(console_history.c.start_unix_s >= since_unix_s).order_by(
            console_history.c.start_unix_s)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    def audit(self, limit: int = 100) -> list[dict]:
        """The newest changes first: tenants, keys and operator rollout actions."""
        query = select(audit_log).order_by(audit_log.c.id.desc()).limit(limit)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]


STATUSES = rollups.STATUSES


def _audit(conn: Any, actor: str, action: str, target: str, detail: dict | None) -> None:
    detail = {k: v for k, v in (detail or {}).items() if v is not None} or None
    conn.execute(insert(audit_log).values(at_unix_s=time.time(), actor=actor, action=action, target=target,
                                          detail=detail))


# rows to policies

def tenant_policy(row: dict) -> TenantPolicy:
    return TenantPolicy(
        id=row["id"], name=row["name"], weight=row["weight"], priority_class=row["priority_class"],
        default_deadline_ms=row["default_deadline_ms"], queue_share=row["queue_share"],
        limits=Limits.from_dict(row["limits"]),
        model_limits={m: Limits.from_dict(v, f"model_limits.{m}") for m, v in (row["model_limits"] or {}).items()},
        allowed_models=tuple(row["allowed_models"]) if row.get("allowed_models") is not None else None,
        budget_usd=row["budget_usd"], budget_period=row["budget_period"],
        batch_queued_tokens=row.get("batch_queued_tokens"))


def key_policy(row: dict, tenant: TenantPolicy) -> KeyPolicy:
    allowed = row.get("allowed_models")
    return KeyPolicy(id=row["id"], tenant=tenant, name=row["name"], limits=Limits.from_dict(row["limits"]),
                     allowed_models=tuple(allowed) if allowed is not None else None,
                     priority_class=row.get("priority_class"))


def _tenant_settings(settings: dict) -> dict:
    unknown = set(settings) - set(TENANT_SETTINGS)
    if unknown:
        raise PolicyError(f"unknown tenant setting(s): {', '.join(sorted(unknown))}")
    return {k: v for k, v in settings.items() if v is not None}


def _model_limits(current: dict, changes: dict | None) -> dict:
    merged = dict(current or {})
    for model, limits in (changes or {}).items():
        merged[model] = Limits.from_dict(merged.get(model)).merged(limits).to_dict()
    return {m: v for m, v in merged.items() if v}


def _status_is(u: Any, status: str) -> Any:
    return func.coalesce(func.cast(u.c.status == status, u.c.prompt_tokens.type), 0)


def _numbers(row: dict) -> dict:
    return {k: (v if v is not None or k in ("tenant", "model", "spend") else 0) for k, v in row.items()}
