"""tenants, api keys, usage records

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("weight", sa.Float, nullable=False),
        sa.Column("priority_class", sa.String(32), nullable=False),
        sa.Column("default_deadline_ms", sa.Integer),
        sa.Column("queue_share", sa.Float, nullable=False),
        sa.Column("limits", sa.JSON, nullable=False),
        sa.Column("model_limits", sa.JSON, nullable=False),
        sa.Column("allowed_models", sa.JSON),
        sa.Column("budget_usd", sa.Float),
        sa.Column("budget_period", sa.String(8), nullable=False),
        sa.Column("created_unix_s", sa.Float, nullable=False),
        sa.Column("updated_unix_s", sa.Float, nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id"), nullable=False, index=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("lookup_id", sa.String(16), nullable=False, unique=True),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("limits", sa.JSON, nullable=False),
        sa.Column("allowed_models", sa.JSON),
        sa.Column("priority_class", sa.String(32)),
        sa.Column("created_unix_s", sa.Float, nullable=False),
        sa.Column("revoked_unix_s", sa.Float),
    )
    op.create_table(
        "usage_records",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("record_id", sa.String(32), nullable=False),
        sa.Column("request_id", sa.String(160), nullable=False, index=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("tenant_id", sa.String(40)),
        sa.Column("key_id", sa.String(40)),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("deployment_version", sa.String(128)),
        sa.Column("replica", sa.String(256)),
        sa.Column("priority_class", sa.String(32)),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("http_status", sa.Integer, nullable=False),
        sa.Column("error_code", sa.String(64)),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("cached_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("queue_s", sa.Float),
        sa.Column("ttft_s", sa.Float),
        sa.Column("e2e_s", sa.Float, nullable=False),
        sa.Column("cost_usd", sa.Float, nullable=False),
        sa.Column("started_unix_s", sa.Float, nullable=False),
        sa.Column("ended_unix_s", sa.Float, nullable=False),
        sa.Column("gateway_id", sa.String(64), nullable=False),
        sa.UniqueConstraint("record_id", name="uq_usage_records_record_id"),
    )
    op.create_index("ix_usage_records_tenant_ended", "usage_records", ["tenant_id", "ended_unix_s"])


def downgrade() -> None:
    op.drop_table("usage_records")
    op.drop_table("api_keys")
    op.drop_table("tenants")
