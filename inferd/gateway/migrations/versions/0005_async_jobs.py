"""asynchronous jobs, their webhook deliveries and the tenants' webhook secret generations; leases on batches
and batch lines, so that several gateways on one store run each line once; a tenant's own cap on queued batch
tokens

Revision ID: 0005
Revises: 0004
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def lease_columns() -> list[sa.Column]:
    return [sa.Column("lease_owner", sa.String(64)), sa.Column("lease_until", sa.Float)]


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("batch_queued_tokens", sa.BigInteger))
    for table in ("batches", "batch_lines"):
        with op.batch_alter_table(table) as batch:
            for column in lease_columns():
                batch.add_column(column)
    op.create_table(
        "async_jobs",
        sa.Column("seq", BigId, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(40), nullable=False, unique=True),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("key_id", sa.String(40), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("reserved_tokens", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("webhook_url", sa.Text),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("expires_at", sa.Integer, nullable=False),
        sa.Column("started_at", sa.Integer),
        sa.Column("ended_at", sa.Integer),
        sa.Column("status_code", sa.Integer),
        sa.Column("response", sa.Text),
        *lease_columns(),
        sa.Column("webhook_state", sa.String(16)),
        sa.Column("webhook_next_at", sa.Float),
    )
    op.create_index("ix_async_jobs_tenant_seq", "async_jobs", ["tenant_id", "seq"])
    op.create_index("ix_async_jobs_status", "async_jobs", ["status"])
    op.create_index("ix_async_jobs_webhook", "async_jobs", ["webhook_state"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("async_jobs.id"), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("at_unix_s", sa.Float, nullable=False),
        sa.Column("duration_s", sa.Float, nullable=False),
        sa.Column("status_code", sa.Integer),
        sa.Column("error", sa.String(256)),
    )
    op.create_index("ix_webhook_deliveries_job_id", "webhook_deliveries", ["job_id"])
    op.create_table(
        "webhook_secrets",
        sa.Column("tenant_id", sa.String(40), primary_key=True),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("rotated_at", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("webhook_secrets")
    op.drop_table("webhook_deliveries")
    op.drop_table("async_jobs")
    for table in ("batch_lines", "batches"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("lease_until")
            batch.drop_column("lease_owner")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("batch_queued_tokens")
