"""usage records: units beyond tokens (a robot session's observations, actions, missed deadlines, seconds)

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(sa.Column("units", sa.JSON))


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("units")
