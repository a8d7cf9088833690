"""the console: daily usage rollups (filled from the records already stored) and the audit log

Revision ID: 0004
Revises: 0003 (the merger re-points it to 0003)
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

STATUSES = ("completed", "failed", "cancelled", "rejected", "expired")


def upgrade() -> None:
    counts = [sa.Column(c, sa.BigInteger, nullable=False) for c in
              ("requests", *STATUSES, "prompt_tokens", "cached_tokens", "completion_tokens")]
    op.create_table("usage_daily",
                    sa.Column("day", sa.Integer, primary_key=True),
                    sa.Column("tenant_id", sa.String(40), primary_key=True),
                    sa.Column("model", sa.String(256), primary_key=True),
                    sa.Column("priority_class", sa.String(32), primary_key=True),
                    *counts, sa.Column("cost_usd", sa.Float, nullable=False))
    op.create_table("audit_log",
                    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True,
                              autoincrement=True),
                    sa.Column("at_unix_s", sa.Float, nullable=False),
                    sa.Column("actor", sa.String(128), nullable=False),
                    sa.Column("action", sa.String(32), nullable=False),
                    sa.Column("target", sa.String(128), nullable=False),
                    sa.Column("detail", sa.JSON))
    op.create_index("ix_audit_log_at_unix_s", "audit_log", ["at_unix_s"])
    day = ("CAST(floor(ended_unix_s / 86400) AS INTEGER)" if op.get_bind().dialect.name == "postgresql"
           else "CAST(ended_unix_s / 86400 AS INTEGER)")  # SQLite's CAST truncates; ended_unix_s > 0
    statuses = ", ".join(f"SUM(CASE WHEN status = '{s}' THEN 1 ELSE 0 END)" for s in STATUSES)
    op.execute(f"""INSERT INTO usage_daily SELECT {day}, COALESCE(tenant_id, ''), model,
                   COALESCE(priority_class, ''), COUNT(*), {statuses}, SUM(prompt_tokens), SUM(cached_tokens),
                   SUM(completion_tokens), SUM(cost_usd) FROM usage_records
                   GROUP BY {day}, COALESCE(tenant_id, ''), model, COALESCE(priority_class, '')""")


def downgrade() -> None:
    op.drop_table("audit_log")
    op.drop_table("usage_daily")
