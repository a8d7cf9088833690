"""the console's History buckets, kept across restarts

Revision ID: 0008
Revises: 0007
"""
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("console_history",
                    sa.Column("gateway_id", sa.String(64), primary_key=True),
                    sa.Column("deployment", sa.String(256), primary_key=True),
                    sa.Column("version", sa.String(128), primary_key=True),
                    sa.Column("start_unix_s", sa.Float, primary_key=True),
                    sa.Column("bucket", sa.JSON, nullable=False))
    op.create_index("ix_console_history_start", "console_history", ["start_unix_s"])


def downgrade() -> None:
    op.drop_index("ix_console_history_start", "console_history")
    op.drop_table("console_history")
