"""The gateway's SQL schema (SQLAlchemy Core). Change it only together with a migration in migrations/versions."""
from sqlalchemy import (JSON, BigInteger, Boolean, Column, Float, ForeignKey, Index, Integer, MetaData, String, Table,
                        Text, UniqueConstraint, false)

metadata = MetaData()
BigId = BigInteger().with_variant(Integer, "sqlite")  # SQLite autoincrements only INTEGER PRIMARY KEY

tenants = Table(
    "tenants", metadata,
    Column("id", String(40), primary_key=True),
    Column("name", String(128), nullable=False, unique=True),
    Column("weight", Float, nullable=False, default=1.0),
    Column("priority_class", String(32), nullable=False, default="interactive"),
    Column("default_deadline_ms", Integer),
    Column("queue_share", Float, nullable=False, default=0.5),
    Column("limits", JSON, nullable=False, default=dict),
    Column("model_limits", JSON, nullable=False, default=dict),
    Column("allowed_models", JSON),
    Column("budget_usd", Float),
    Column("budget_period", String(8), nullable=False, default="month"),
    Column("batch_queued_tokens", BigInteger),  # None: the gateway's tenant_batch_queued_tokens
    Column("created_unix_s", Float, nullable=False),
    Column("updated_unix_s", Float, nullable=False),
)

api_keys = Table(
    "api_keys", metadata,
    Column("id", String(40), primary_key=True),
    Column("tenant_id", String(40), ForeignKey("tenants.id"), nullable=False, index=True),
    Column("name", String(128), nullable=False, default=""),
    Column("lookup_id", String(16), nullable=False, unique=True),
    Column("key_hash", String(64), nullable=False),
    Column("limits", JSON, nullable=False, default=dict),
    Column("allowed_models", JSON),
    Column("priority_class", String(32)),
    Column("created_unix_s", Float, nullable=False),
    Column("revoked_unix_s", Float),
)

usage_records = Table(
    "usage_records", metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("record_id", String(32), nullable=False),
    Column("request_id", String(160), nullable=False, index=True),
    Column("attempt", Integer, nullable=False, default=1),
    Column("tenant_id", String(40)),
    Column("key_id", String(40)),
    Column("model", String(256), nullable=False),
    Column("deployment_version", String(128)),
    Column("replica", String(256)),
    Column("priority_class", String(32)),
    Column("status", String(16), nullable=False),
    Column("http_status", Integer, nullable=False),
    Column("error_code", String(64)),
    Column("prompt_tokens", Integer, nullable=False, default=0),
    Column("cached_tokens", Integer, nullable=False, default=0),
    Column("completion_tokens", Integer, nullable=False, default=0),
    Column("queue_s", Float),
    Column("ttft_s", Float),
    Column("e2e_s", Float, nullable=False),
    Column("cost_usd", Float, nullable=False, default=0.0),
    Column("started_unix_s", Float, nullable=False),
    Column("ended_unix_s", Float, nullable=False),
    Column("gateway_id", String(64), nullable=False),
    Column("units", JSON),  # what a record counts beyond tokens (a robot session: observations, actions, ...)
    Column("batch_id", String(40)),  # the batch whose line this was (priced at the batch multiplier)
    Column("tpot_s", Float),
    Column("cache_hit", Boolean, nullable=False, server_default=false()),  # answered from the response cache  # mean time per output token after the first (streamed or unary); None: unknown
    UniqueConstraint("record_id", name="uq_usage_records_record_id"),
    Index("ix_usage_records_tenant_ended", "tenant_id", "ended_unix_s"),
)

files = Table(  # the bytes are in the file storage (files.py), under the tenant, by id
    "files", metadata,
    Column("seq", BigId, primary_key=True, autoincrement=True),  # list order and cursor
    Column("id", String(40), nullable=False, unique=True),
    Column("tenant_id", String(40), nullable=False),
    Column("purpose", String(32), nullable=False),
    Column("filename", String(256), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("created_at", Integer, nullable=False),
    Index("ix_files_tenant_seq", "tenant_id", "seq"),
)

batches = Table(
    "batches", metadata,
    Column("seq", BigId, primary_key=True, autoincrement=True),
    Column("id", String(40), nullable=False, unique=True),
    Column("tenant_id", String(40), nullable=False),
    Column("key_id", String(40), nullable=False),  # the lines run as this key (its limits, its models)
    Column("endpoint", String(64), nullable=False),
    Column("input_file_id", String(40), nullable=False),
    Column("completion_window", String(16), nullable=False),
    Column("status", String(16), nullable=False),
    Column("metadata", JSON),
    Column("errors", JSON),  # validation's errors: [{code, message, param, line}]
    Column("output_file_id", String(40)),
    Column("error_file_id", String(40)),
    *(Column(f"{t}_at", Integer) for t in ("created", "in_progress", "expires", "finalizing", "completed",
                                           "failed", "expired", "cancelling", "cancelled")),
    Column("lease_owner", String(64)),  # the gateway validating or finalizing it (leases.py)
    Column("lease_until", Float),
    Index("ix_batches_tenant_seq", "tenant_id", "seq"),
    Index("ix_batches_status", "status"),
)

batch_lines = Table(  # one per input line; its result written once (state pending -> done, expired, cancelled)
    "batch_lines", metadata,
    Column("batch_id", String(40), ForeignKey("batches.id"), primary_key=True),
    Column("line", Integer, primary_key=True),  # 1-based, as in the input file
    Column("custom_id", String(512), nullable=False),
    Column("body", Text, nullable=False),  # the line's body as JSON
    Column("reserved_tokens", BigInteger, nullable=False),  # the plan's worst case (per-tenant queued caps)
    Column("state", String(16), nullable=False),
    Column("request_id", String(160)),
    Column("status_code", Integer),
    Column("response", Text),  # the answer's body (JSON), or the error's
    Column("ended_at", Integer),
    Column("lease_owner", String(64)),  # the gateway running the line (leases.py)
    Column("lease_until", Float),
    Index("ix_batch_lines_state", "batch_id", "state"),
)

# Daily rollups of usage_records, updated in the same transaction as each insert (gateway/rollups.py), so a
# usage report reads a row per (day, tenant, model, priority class) instead of scanning the records.
usage_daily = Table(
    "usage_daily", metadata,
    Column("day", Integer, primary_key=True),  # UTC days since 1970-01-01 of the record's ended_unix_s
    Column("tenant_id", String(40), primary_key=True),  # "" for records without a tenant
    Column("model", String(256), primary_key=True),
    Column("priority_class", String(32), primary_key=True),  # "" when the record has none
    Column("requests", BigInteger, nullable=False),
    Column("completed", BigInteger, nullable=False),
    Column("failed", BigInteger, nullable=False),
    Column("cancelled", BigInteger, nullable=False),
    Column("rejected", BigInteger, nullable=False),
    Column("expired", BigInteger, nullable=False),
    Column("prompt_tokens", BigInteger, nullable=False),
    Column("cached_tokens", BigInteger, nullable=False),
    Column("completion_tokens", BigInteger, nullable=False),
    Column("cost_usd", Float, nullable=False),
)

# Who changed what, when: every change to tenants and keys (CLI, admin API, console).
audit_log = Table(
    "audit_log", metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("at_unix_s", Float, nullable=False, index=True),
    Column("actor", String(128), nullable=False),  # cli:USER, admin-api@ADDRESS, console:ROLE@ADDRESS
    Column("action", String(32), nullable=False),  # tenant.create, tenant.update, key.create, key.revoke
    Column("target", String(128), nullable=False),  # the tenant's name or the key's id
    Column("detail", JSON),  # the settings changed (never a key itself)
)

# Asynchronous single requests (gateway/async_jobs.py): one row per job, its result written once.
async_jobs = Table(
    "async_jobs", metadata,
    Column("seq", BigId, primary_key=True, autoincrement=True),
    Column("id", String(40), nullable=False, unique=True),
    Column("tenant_id", String(40), nullable=False),
    Column("key_id", String(40), nullable=False),  # the job runs as this key (its limits, its models)
    Column("endpoint", String(64), nullable=False),
    Column("body", Text, nullable=False),  # the request's body as the client sent it
    Column("reserved_tokens", BigInteger, nullable=False),
    Column("status", String(16), nullable=False),  # queued, in_progress, completed, failed, cancelled
    Column("webhook_url", Text),
    Column("created_at", Integer, nullable=False),
    Column("expires_at", Integer, nullable=False),
    Column("started_at", Integer),
    Column("ended_at", Integer),
    Column("status_code", Integer),  # the answer's HTTP status
    Column("response", Text),  # the answer's body (JSON), or the error's
    Column("lease_owner", String(64)),  # the gateway running it (leases.py)
    Column("lease_until", Float),
    Column("webhook_state", String(16)),  # pending, delivered, failed (None: no webhook)
    Column("webhook_next_at", Float),  # the next delivery attempt (unix s)
    Index("ix_async_jobs_tenant_seq", "tenant_id", "seq"),
    Index("ix_async_jobs_status", "status"),
    Index("ix_async_jobs_webhook", "webhook_state"),
)

webhook_deliveries = Table(  # every attempt to deliver a job's result to its webhook
    "webhook_deliveries", metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("job_id", String(40), ForeignKey("async_jobs.id"), nullable=False, index=True),
    Column("attempt", Integer, nullable=False),
    Column("at_unix_s", Float, nullable=False),
    Column("duration_s", Float, nullable=False),
    Column("status_code", Integer),  # None: no answer (the error says why)
    Column("error", String(256)),
)

webhook_secrets = Table(  # no secret here: a tenant's is HMAC(master, tenant id, generation) (webhooks.py)
    "webhook_secrets", metadata,
    Column("tenant_id", String(40), primary_key=True),
    Column("generation", Integer, nullable=False),
    Column("rotated_at", Integer, nullable=False),
)

# Who may sign in to the console by name and password (`inferd console user ...`): never the password itself,
# only its salted scrypt hash (console/users.py).
console_users = Table(
    "console_users", metadata,
    Column("name", String(64), primary_key=True),
    Column("role", String(16), nullable=False),  # admin or viewer
    Column("password_hash", String(256), nullable=False),  # scrypt$N$r$p$salt$hash
    Column("created_unix_s", Float, nullable=False),
    Column("updated_unix_s", Float, nullable=False),
)

# The console's 10-minute buckets of each deployment version (console/window.py), written each minute by each
# gateway, so that its History charts outlive a restart.
console_history = Table(
    "console_history", metadata,
    Column("gateway_id", String(64), primary_key=True),
    Column("deployment", String(256), primary_key=True),
    Column("version", String(128), primary_key=True),
    Column("start_unix_s", Float, primary_key=True),
    Column("bucket", JSON, nullable=False),  # Bucket.to_dict()
    Index("ix_console_history_start", "start_unix_s"),
)
